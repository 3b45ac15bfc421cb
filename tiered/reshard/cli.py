"""The command line: ``tiered reshard SRC DST ...`` (:func:`add_parser`, for :mod:`tiered.cli`) and
``python tools/reshard.py SRC DST ...`` (:func:`main`), one parser for both.

Exit status: 0 done, 1 error (nothing written), 2 usage error (argparse: a missing argument, an unknown
option, a bad ``--dtype`` or ``--max-shard-size``, ``--compress`` with ``--decompress``; a SRC that does not exist,
checked before the conversion starts; a DST that is SRC, inside it or contains it; a DST that exists without
``--force``), 130 interrupted (Ctrl-C or SIGTERM;
nothing written).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from typing import Any

from ..errors import TieredError

__all__ = ["add_parser", "main"]

_DESCRIPTION = """\
Reshard a checkpoint for streaming: rewrite its weights as safetensors shards in execution order
(every unit -- one decoder layer, the embeddings, the head -- contiguous inside one shard), each
shard's data section 4 KiB-aligned, with a standard model.safetensors.index.json; config,
generation config and tokenizer files are copied. Tensor names and bytes are kept (bit-equal; with
--dtype, cast; from GGUF, dequantized), so the output loads with transformers' from_pretrained as
well as with tiered.load.

SRC is a Hugging Face model directory (safetensors, one file or sharded; pytorch_model.bin, sharded
.bin with index, or .pt/.pth) or one weight file, or one llama.cpp GGUF file (Llama family, Qwen2,
Qwen3: dequantized to float32, or to --dtype, with the config, generation config and tokenizer
written from its metadata by transformers' own GGUF code; needs `pip install gguf`). PyTorch files
are read with torch.load(mmap=True, weights_only=True) only. Memory stays bounded (64 MiB chunks;
for GGUF, one dequantized tensor) whatever the checkpoint size. The output is written to
.DST.tiered-tmp-<pid> beside DST and renamed into place only when complete: an interrupted run
leaves no partial DST (with --force: the old DST or the new one), and the next run first completes
or rolls back an install that was interrupted.

--compress writes the shards losslessly compressed (tiered's own format: each tensor of 64 KiB or
more in ~4 MiB chunks, byte planes zstd-coded, a CRC-32 per chunk; ~0.68 of the bytes for bf16
weights), indexed by model.lossless.index.json: tiered.load reads it, from_pretrained refuses it.
--decompress turns such a directory back into plain shards, bit-equal to a plain reshard.
"""
_EPILOG = """\
examples:
  tiered reshard ~/models/llama-3-8b ~/models/llama-3-8b.tiered
  tiered reshard ckpt/ out/ --max-shard-size 4GB --dtype bf16 --verify
  tiered reshard SmolLM2-135M-Instruct.Q4_1.gguf smollm2/ --dtype bf16   (then: tiered generate smollm2 --chat ...)
  tiered reshard ckpt/ ckpt.z/ --dtype bf16 --compress      (then: tiered reshard ckpt.z/ plain/ --decompress)
  python tools/reshard.py SRC DST          (the same tool, from a checkout)
exit status: 0 done, 1 error (nothing written), 2 usage error, 130 interrupted (nothing written)
"""


def _shard_size(text: str) -> str:
    """argparse ``type`` of ``--max-shard-size``: a bad size is a usage error (exit 2) naming the option.

    Returns the text itself (:func:`~tiered.reshard.reshard` parses it again), so the parsed value reads as typed.
    """
    try:
        from ..sizes import parse_size  # torch-free: checked before torch is imported

        parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", metavar="SRC",
                   help="model directory, or one .safetensors/.bin/.pt/.gguf file, to read (never modified)")
    p.add_argument("dst", metavar="DST", help="directory to create (refused if it exists, unless --force)")
    p.add_argument("--max-shard-size", default="2GB", metavar="SIZE", type=_shard_size,
                   help="largest output shard: 2GB = 2e9 bytes (decimal, as transformers), 2GiB = 2*2^30; "
                   "a unit larger than this gets a shard of its own (default: 2GB)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None,
                   help="cast floating tensors (tensor.to(dtype)) and set config.json's dtype (default: keep)")
    p.add_argument("--verify", action="store_true",
                   help="before renaming into place, re-read every tensor from disk and compare BLAKE2b hashes")
    p.add_argument("--force", action="store_true", help="replace DST if it exists (only once the new one is complete)")
    codec = p.add_mutually_exclusive_group()
    codec.add_argument("--compress", action="store_true",
                       help="write losslessly compressed shards (needs zstandard; tiered.load reads them, "
                       "from_pretrained does not)")
    codec.add_argument("--decompress", action="store_true",
                       help="SRC is a compressed checkpoint: write it back as plain safetensors (bit-equal to a plain "
                       "reshard)")
    p.add_argument("--codec", choices=["zstd", "exp3"], default=None,
                   help="with --compress: zstd (the default: byte planes, zstd, decoded on the reader threads) or "
                   "exp3 (bf16 tensors in a fixed-width exponent code, ~0.70 of their bytes: a CUDA load decodes it on the "
                   "GPU after the H2D copy, a CPU load with a C decoder built on first use; the faster code on both, "
                   "zstd the smaller; other dtypes zstd)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar and no summary; errors only")


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _check_src(parser: argparse.ArgumentParser, src: str) -> None:
    """SRC that does not exist is a usage error (exit 2) before the conversion starts; a Hugging Face Hub id says how to
    fetch it first, as ``tiered generate`` and ``tiered inspect`` do."""
    from pathlib import Path

    from ..cli_checks import _HUB_ID

    if os.path.lexists(src):
        return
    if _HUB_ID.fullmatch(src) and not src.startswith((".", "~", "/")):
        parser.error(f"SRC {src!r} is not a local path; it looks like a Hugging Face Hub id. tiered reads local "
                     f"directories and downloads nothing: fetch it first, e.g. huggingface_hub.snapshot_download("
                     f"{src!r}), and pass the directory it returns")
    parser.error(f"SRC {Path(src)}: no such file or directory; pass a local model directory or one weight file")


def _check_dst(parser: argparse.ArgumentParser, dst: str, force: bool) -> None:
    """An existing DST without ``--force`` is a usage error said before torch is imported, with the converter's own
    message — unless an interrupted run left its journal or temporaries beside it: the converter first finishes or
    undoes that install (:mod:`tiered.reshard.install`), which may change whether DST exists."""
    from pathlib import Path

    d = Path(dst)
    if force or not os.path.lexists(d):
        return
    try:
        left = any(n.startswith(f".{d.name}.tiered-") for n in os.listdir(d.parent))
    except OSError:
        return
    if not left:
        from .errors import DestinationExistsError
        from .install import _check_dst as refuse_existing  # torch-free: the converter's own check and message

        try:
            refuse_existing(d, force, [])
        except DestinationExistsError as e:
            parser.error(str(e))


def _check_not_src(parser: argparse.ArgumentParser, src: str, dst: str) -> None:
    """A DST that could modify SRC (:func:`tiered.reshard.install.overlap`: SRC itself, inside it or containing it,
    or where SRC's links point) is a usage error (exit 2), checked before DST's existence (the converter's own check,
    :func:`tiered.reshard.convert._check_paths`, raises the same with exit 1)."""
    from pathlib import Path

    from .install import overlap

    why = overlap(Path(src), Path(dst))
    if why:
        parser.error(f"{why}; SRC is never modified: choose another DST")


def _cmd_reshard(a: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    """Run ``reshard`` for parsed arguments; SIGTERM cleans up like Ctrl-C. Raises TieredError. With ``parser``: a
    missing SRC and an existing DST (without ``--force``) are usage errors (exit 2, the parser's message)."""
    if parser is not None:
        _check_src(parser, a.src)
        _check_not_src(parser, a.src, a.dst)  # before DST's existence: SRC itself exists, and --force would not help
        _check_dst(parser, a.dst, a.force)
        if getattr(a, "codec", None) and not getattr(a, "compress", False):
            parser.error("--codec chooses the code of --compress: pass --compress too")
        if getattr(a, "codec", None) == "exp3" and (getattr(a, "dtype", None) or "bf16").lower() not in ("bf16", "bfloat16"):
            parser.error(f"--codec exp3 codes bf16 tensors, and --dtype {a.dtype} leaves none: pass --dtype bf16, or "
                         "--codec zstd (the default) for fp16/fp32")
    compress = (getattr(a, "codec", None) or True) if getattr(a, "compress", False) else False
    old = None
    if threading.current_thread() is threading.main_thread():
        old = signal.signal(signal.SIGTERM, _interrupt)
    try:
        from .convert import reshard
        from .errors import DestinationExistsError

        try:
            summary = reshard(a.src, a.dst, max_shard_size=a.max_shard_size, dtype=a.dtype, verify=a.verify,
                              force=a.force, quiet=a.quiet, compress=compress,
                              decompress=getattr(a, "decompress", False))
        except DestinationExistsError as e:
            if parser is None:
                raise
            parser.error(str(e))  # DST exists: a usage error, as the help says (exit 2)
    except KeyboardInterrupt:
        print("reshard: interrupted; the partial output was removed", file=sys.stderr)
        return 130
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)
    if not a.quiet:
        print(summary)
    return 0


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``reshard`` on an ``argparse`` subparsers object (``tiered reshard ...``); returns the parser.

    The parser's ``fn`` default runs the command and returns an exit status; it raises
    :class:`~tiered.errors.TieredError` for the caller to print.
    """
    p = subparsers.add_parser("reshard", help="rewrite a checkpoint in stream order (bounded memory, atomic)",
                              description=_DESCRIPTION, epilog=_EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(p)
    p.set_defaults(fn=_cmd_reshard, cli_parser=p)
    return p


def main(argv: list[str] | None = None) -> int:
    """``python tools/reshard.py SRC DST ...``: the same command as ``tiered reshard``."""
    p = argparse.ArgumentParser(prog="reshard", description=_DESCRIPTION, epilog=_EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(p)
    a = p.parse_args(argv)
    try:
        return _cmd_reshard(a, p)
    except TieredError as e:
        print(f"reshard: error: {e}", file=sys.stderr)
        return 1
