"""What a reshard did: :class:`ReshardSummary`, returned by :func:`~tiered.reshard.reshard` and printed by the CLI."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..stats import compression_ratios

__all__ = ["ReshardSummary"]


def _human(n: int) -> str:
    """Decimal units, as disks are quoted: 3.34 GB, 898.6 kB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.{3 if unit == 'GB' else 1}f} {unit}"
    return f"{n} B"


@dataclass(frozen=True)
class ReshardSummary:
    """What :func:`reshard` did. Bytes are exact; GB/s is decimal (1e9 bytes/s), as disks are quoted."""

    src: Path
    dst: Path
    input_format: str  # the source kind: "safetensors", "torch" (.bin / .pt, read with torch.load(mmap=True, weights_only=True))
    input_files: int  # weight files read
    shards: int  # output shards written
    tensors: int  # tensors written
    data_bytes: int  # tensor bytes written (the index's metadata.total_size)
    file_bytes: int  # bytes of the output shards, headers included
    seconds: float  # wall time from the call to the rename into place
    write_seconds: float  # of that, writing the shards and files (no planning, no --verify pass)
    order: str  # "plan": the loader's unit plan; "layer-index": by the layer number in tensor names
    architecture: str | None  # the transformers class whose plan ordered the units
    units: int  # streaming units, each contiguous inside one shard
    reordered: bool  # the output tensor order differs from the input's
    cast: int  # tensors cast to ``dtype``
    dtype: str | None  # the requested dtype ("bfloat16", ...), or None
    dropped_tied: dict[str, str]  # duplicate of a tied weight -> the tensor kept
    copied_files: tuple[str, ...]  # non-weight files copied, and files the source generated (sorted)
    verified: bool  # every tensor re-read from disk and compared by BLAKE2b hash
    kernel_copy_bytes: int  # bytes moved with copy_file_range (no user-space pages)
    notes: tuple[str, ...] = ()
    stored_bytes: int | None = None  # --compress: bytes of the shards' data sections (coded); None: not compressed
    coded_tensors: int = 0  # --compress: tensors written coded (the rest are small or did not shrink)
    coded_plain_bytes: int = 0  # --compress: plain bytes of the coded tensors (what they decode to)
    coded_stored_bytes: int = 0  # --compress: their coded bytes in the shards (part of stored_bytes)
    codec: str = "bytegroup-zstd1"  # --compress: the code (exp3: "exp3-bf16 for bf16, bytegroup-zstd1 otherwise")

    @property
    def gb_per_s(self) -> float:
        return self.data_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def __str__(self) -> str:
        lines = [f"resharded {self.src} -> {self.dst}",
                 f"  {self.shards} shard(s), {self.tensors} tensors, {_human(self.data_bytes)} "
                 f"({self.data_bytes} bytes) in {self.seconds:.2f} s in all"
                 + (f"; written in {self.write_seconds:.2f} s = {self.data_bytes / self.write_seconds / 1e9:.2f} GB/s"
                    if self.write_seconds > 0 else f" = {self.gb_per_s:.2f} GB/s")]
        if self.order == "plan":
            lines.append(f"  order: execution order of {self.architecture}, {self.units} units, each contiguous "
                         "in one shard; data sections 4 KiB-aligned")
        else:
            lines.append(f"  order: by layer index in tensor names (no usable config.json), {self.units} units, "
                         "each contiguous in one shard; data sections 4 KiB-aligned")
        changed = ["reordered" if self.reordered else "order unchanged"]
        if self.cast:
            changed.append(f"cast {self.cast} tensors to {self.dtype}")
        if self.dropped_tied:
            pairs = ", ".join(f"{d} (= {k})" for d, k in self.dropped_tied.items())
            changed.append(f"dropped duplicates of tied weights: {pairs}")
        lines.append(f"  changed: {'; '.join(changed)}")
        if self.stored_bytes is not None:
            ratios = compression_ratios(self.stored_bytes, self.data_bytes, self.coded_stored_bytes,
                                        self.coded_plain_bytes)  # the figures `tiered inspect` prints
            lines.append(f"  compressed: {ratios} ({_human(self.stored_bytes)} stored for {_human(self.data_bytes)}; "
                         f"{self.coded_tensors} of {self.tensors} tensors coded, {self.codec}, CRC-32 per chunk); "
                         "index model.lossless.index.json (tiered.load reads it; from_pretrained does not)")
        if self.copied_files:
            lines.append(f"  copied: {', '.join(self.copied_files)}")
        if self.verified:
            lines.append("  verified: every tensor re-read from disk, BLAKE2b hashes match")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)
