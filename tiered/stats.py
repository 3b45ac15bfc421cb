"""Counters users can read: bytes and GB/s per stage, stalls, ring high-water mark, peak RSS.

Units (one convention everywhere tiered prints a figure: ``Stats.__str__``, ``tiered generate``):

* **bytes moved** (read from disk, streamed per pass or per token, copied to the GPU) are decimal
  **GB** (1e9 bytes), and **rates** are decimal **GB/s** (1e9 bytes/s), as disk and PCIe bandwidths
  are quoted;
* **memory sizes** (the ring, its high-water mark, the model, RSS) are binary **GiB** (2**30 bytes),
  as ``ring_gb`` and ``gpu_gb`` are given and as ``free``/``top`` count memory.

Every printed figure carries its unit, and no figure is computed from the two (a rate is GB over
seconds, never GiB over seconds). Figures are printed with three significant digits (:func:`gb`,
:func:`gib`), so a small model reads "0.000362 GB", not "0.00 GB". :meth:`Stats.snapshot` is in bytes
and seconds.

Bytes read are accounted by *use* (see :class:`Stats`): ``read_bytes`` is everything read from the
checkpoint; ``streamed_bytes`` only what a forward pass used, counted when the pass binds the unit, so
the lookahead a pass issues for the next pass's first units (read while the model is idle) is never
counted to the pass that issued it: until a pass uses it, it is ``prefetch_idle_bytes``.

RSS figures come from ``/proc/self/status`` (``VmRSS``, ``VmHWM`` = peak RSS, ``RssAnon``,
``RssFile``; Linux).
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["Stats", "proc_status", "page_cache_room", "GB", "GiB", "gb", "size", "gib", "gbps", "sig3", "plural",
           "compression_ratios"]

GB = 10**9  #: bytes moved and rates
GiB = 1 << 30  #: memory sizes


def sig3(x: float) -> str:
    """``x`` with three significant digits and no exponent: 2.05, 17.7, 362, 0.000362, 0."""
    if not math.isfinite(x):
        return str(x)
    if x == 0:
        return "0"
    decimals = min(12, max(0, 2 - math.floor(math.log10(abs(x)))))
    return f"{x:.{decimals}f}"


def plural(n: int, noun: str, nouns: str | None = None) -> str:
    """A count and its noun, singular for 1: ``plural(1, "unit") == "1 unit"``, ``plural(2, "unit") == "2 units"``
    (``nouns``: the plural where it is not ``noun + "s"``)."""
    return f"{n} {noun if n == 1 else nouns or noun + 's'}"


def compression_ratios(stored: int, plain: int, coded_stored: int, coded_plain: int) -> str:
    """A losslessly compressed checkpoint's stored bytes over its plain bytes, as ``tiered reshard --compress`` and
    ``tiered inspect`` both print them: over all tensors (``stored``/``plain``: a tensor written plain counts its
    bytes in both) and over the coded tensors only (``coded_stored``/``coded_plain``)."""
    def r(a: int, b: int) -> str:
        return f"{a / b:.3f}" if b else "n/a"

    return f"stored/plain bytes: all tensors {r(stored, plain)}, coded tensors {r(coded_stored, coded_plain)}"


def gb(nbytes: float) -> str:
    """Bytes moved, in decimal GB: ``"17.7 GB"``."""
    return f"{sig3(nbytes / GB)} GB"


def size(nbytes: float) -> str:
    """A count of bytes moved that may be small, in the largest decimal unit it reaches: ``"17.7 GB"``, ``"56.6 MB"``,
    ``"9.22 kB"``, ``"512 B"`` (where :func:`gb` would print ``"0.00000922 GB"``)."""
    for unit, scale in (("GB", GB), ("MB", 1e6), ("kB", 1e3)):
        if abs(nbytes) >= scale:
            return f"{sig3(nbytes / scale)} {unit}"
    return f"{sig3(nbytes)} B"


def gib(nbytes: float) -> str:
    """A memory size, in binary GiB: ``"2.05 GiB"``."""
    return f"{sig3(nbytes / GiB)} GiB"


def gbps(nbytes: float, seconds: float) -> str:
    """A rate in decimal GB/s (``"3.14 GB/s"``); ``"n/a GB/s"`` when no time was measured."""
    return f"{sig3(nbytes / seconds / GB)} GB/s" if seconds > 0 else "n/a GB/s"


def proc_status() -> dict[str, int]:
    """``VmRSS``, ``VmHWM``, ``RssAnon``, ``RssFile`` of this process in bytes (empty off Linux)."""
    out: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                    out[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


def page_cache_room(*, proc: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> tuple[int | None, str]:
    """Bytes the page cache can grow by before it must evict: min(MemAvailable, cgroup v2 memory.max -
    memory.current), and where the figure came from. (None, reason) when it cannot be read (not Linux).

    On a host whose memory controller is on a cgroup v1 hierarchy (``N:memory:/path`` in ``/proc/self/cgroup``;
    older Docker hosts), the limit is the group's ``hierarchical_memory_limit`` (``memory.stat``: the smallest
    ``memory.limit_in_bytes`` of it and its ancestors) less ``memory.usage_in_bytes``, read under
    ``{cgroup_root}/memory{path}`` (or ``{cgroup_root}/memory`` itself, as a container sees its own group).

    A cgroup charges the page cache of the files its processes read (``Documentation/admin-guide/cgroup-v2.rst``;
    v1: ``cgroup-v1/memory.rst``), so a model larger than this room is re-read from disk on every pass through
    ``mmap``, and ``io="direct"`` (no page cache) serves it better.
    """
    room: int | None = None
    where = "unknown"
    try:
        with open(f"{proc}/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    room, where = int(line.split()[1]) * 1024, "MemAvailable"
    except OSError:
        pass
    try:
        with open(f"{proc}/self/cgroup") as f:
            path = next((ln.strip()[3:] for ln in f if ln.startswith("0::")), None)
        if path is not None:
            base = f"{cgroup_root}{path.rstrip('/')}"
            with open(f"{base}/memory.max") as f:
                mx = f.read().strip()
            if mx != "max":
                with open(f"{base}/memory.current") as f:
                    cur = int(f.read().strip())
                left = max(0, int(mx) - cur)
                if room is None or left < room:
                    room, where = left, f"cgroup {path} memory.max={int(mx)}"
    except (OSError, ValueError):
        pass
    v1 = _cgroup1_room(proc, cgroup_root)
    if v1 is not None and (room is None or v1[0] < room):
        room, where = v1
    return room, where


def _cgroup1_room(proc: str, cgroup_root: str) -> tuple[int, str] | None:
    """cgroup v1 memory controller: (limit - usage, where), or None (no v1 memory group, or no limit)."""
    from .hostmem import cgroup1_memory

    g = cgroup1_memory(proc=proc, cgroup_root=cgroup_root)
    if g is None:
        return None
    return max(0, g["limit"] - g["usage"]), f"cgroup v1 {g['path']} memory.limit_in_bytes={g['limit']}"


@dataclass
class Stats:
    """Live counters of one loaded model (updated by the caller, loader and retire threads).

    read_*: disk -> ring: every byte read from the shards (``read_bytes``, the checkpoint's own bytes,
        before any dtype cast) and the seconds the loader spent reading them. Of ``read_bytes``:

        * ``load_bytes``: resident units, read once by ``tiered.load``;
        * ``streamed_bytes``: streamed units *used* by forward passes, counted when a pass binds the unit
          (``units_streamed`` counts them), so one pass adds exactly the bytes of the units it ran;
        * the rest, ``snapshot()["prefetch_idle_bytes"]``: read ahead but not used by any pass (yet) — the
          lookahead a pass issues for the next pass's first units, read while the model is idle, or a
          wrong guess given back unused.

    h2d_*: ring -> GPU (bytes copied, seconds measured with CUDA events on the copy stream; every copy
        that was made, read-ahead ones included).
    stall_s: seconds the caller waited for a unit that was not ready yet.
    passes, pass_s: the model's outermost calls (forward passes, each ``generate`` step one) and their wall seconds
        (``time.perf_counter`` around ``model(...)``, on the caller's thread; an encoder-decoder's ``generate`` calls
        its encoder directly, outside them). ``snapshot()["disk_busy"]`` is ``(read_s - load_read_s) / pass_s`` (``read_s`` is
        the union of the reads' intervals, :meth:`add_read`: the time a read was in flight after load; read-ahead
        between passes can take it above 1), ``snapshot()["pass_read_gbps"]`` the bytes read after load per second of pass:
        what a cold pass gets from the disk, to hold against the disk's ceiling (``benchmarks/ceilings.py``). Both 0
        where they mean nothing (no pass yet; CPU zero copy, whose reads are page faults inside the compute, and
        routed experts, read on the model's thread: untimed). ``load_read_s``: the seconds of the reads at load.
    embedding_bytes: bytes of embedding rows read on demand (``tiered/rows.py``: a streamed embedding
        reads only the rows its ids look up); also counted in ``read_bytes`` and ``streamed_bytes``.
        ``row_units``: embeddings streamed that way (not in the ring, not counted in ``units_streamed``).
    expert_bytes, experts_read, expert_calls, expert_modules: routed experts (``tiered/experts.py``): a
        streamed MoE block reads only the experts its router picked, each call. ``expert_bytes`` (also in
        ``read_bytes`` and ``streamed_bytes``) are their checkpoint bytes, ``experts_read`` how many experts
        were read over ``expert_calls`` calls of the ``expert_modules`` routed experts modules.
    expert_cache_slots, expert_cache_bytes, expert_cache_hits, expert_cache_misses: the expert cache
        (``tiered/expert_cache.py``): experts it holds at most, its device bytes, and how many of the experts the
        calls picked were found in it (not read: not in ``experts_read``) or not. ``snapshot()["expert_cache_hit_rate"]``
        is hits / (hits + misses).
        ``snapshot()["dense_bytes"]`` is ``streamed_bytes`` less expert and embedding bytes.
    mapped_units: CPU zero copy: streamed units that compute on views of the checkpoint's file mapping (no
        ring copy; their bytes still count in ``read_bytes`` and ``streamed_bytes`` when a pass uses them).
    page_cache_units, page_cache_bytes: ``io="auto"`` on the CPU when it picked O_DIRECT: streamed units (of
        ``mapped_units``) kept computing on the file mapping so that their pages stay in the page cache room the
        limit leaves (``tiered.api._choose_page_cache_tier``); the rest is read O_DIRECT.
    mapped_unreserved: CPU, mapped units beside units copied into the ring: how often one ran without the ring room a
        mapped unit holds (``tiered.sources.MappedSource``) because units held at once filled the ring (an outer
        module's unit held around inner ones, with a ring of about the largest unit): it found no room, or a copy
        took its room; each such run may take RSS past ``ring_gb`` by its mapped pages, as before the room was held.
    piece_units: CUDA: units larger than the ring, read through it in pieces into one full-size device buffer.
    host_units, host_bytes, host_used_bytes: the host tier (``host_gb``): units read once at load into host
        memory (pinned on CUDA; ``host_bytes``, page-rounded, also in ``load_bytes``) and copied to the GPU from there
        on every pass, or on the CPU computed in place (``host_used_bytes``: their bytes the passes used; not disk
        reads, so not in ``streamed_bytes``).
        ``host_expert_modules``: routed experts modules whose every expert is in the host tier too (in
        ``host_bytes``); a call copies its ``experts_from_host`` experts (``host_expert_bytes``, also in
        ``host_used_bytes``) to the GPU from there instead of reading them (not in ``experts_read``).
        ``host_pieces``: CUDA, pieces of units larger than the ring that the host tier holds (their first pieces; in
        ``host_bytes``); the rest of such a unit streams through the ring.
    model_bytes: the model's distinct weights in its dtype (``Plan.weight_bytes``: a tied head counted once, routed
        experts included).
    io: the reader backend the model uses (``io="auto"`` resolved; when it resolved to O_DIRECT, the reader compares
        it with buffered reads while streaming and ``io`` becomes the faster, then O_DIRECT's read shapes:
        ``io_choice`` has the rates measured, the request size and depth chosen, and how often it measured again).
    decoded_bytes: a quantized checkpoint (``tiered/quant.py``): bytes of the model dtype the reader threads decoded
        from stored codes (their stored bytes, codes and scales, are in ``read_bytes``).
    slot_direct_bytes: ``io="direct"``: bytes read with ``O_DIRECT`` straight into ring slots, with no copy through
        the reader's staging buffer (:data:`tiered.reader.SLOT_DIRECT`; the rest of ``read_bytes`` was staged: partial
        pages, casts, decodes, tensors not at their file offset modulo the page).
    world_size, rank, gathered_bytes: distributed (``tiered/dist.py``): processes sharing the model, and bytes of
        units that came from the other ranks by all-gather. Each rank's ``read_bytes``, ``streamed_bytes``
        and ``h2d_bytes`` count only its own 1/N chunk of each unit.
    """

    read_bytes: int = 0
    decoded_bytes: int = 0
    slot_direct_bytes: int = 0
    read_s: float = 0.0
    load_read_s: float = 0.0
    pass_s: float = 0.0
    passes: int = 0
    load_bytes: int = 0
    streamed_bytes: int = 0
    h2d_bytes: int = 0
    h2d_s: float = 0.0
    stall_s: float = 0.0
    hits: int = 0
    misses: int = 0
    units_streamed: int = 0
    embedding_bytes: int = 0
    row_units: int = 0
    expert_bytes: int = 0
    experts_read: int = 0
    expert_calls: int = 0
    expert_cache_slots: int = 0
    expert_cache_bytes: int = 0
    expert_cache_hits: int = 0
    expert_cache_misses: int = 0
    # expert_prefetch was removed (issue 21): kept at 0 so that code reading them still runs
    expert_prefetch_bytes: int = 0
    experts_prefetched: int = 0
    expert_prefetch_hits: int = 0
    expert_modules: int = 0
    mapped_units: int = 0
    page_cache_units: int = 0
    page_cache_bytes: int = 0
    mapped_unreserved: int = 0
    piece_units: int = 0
    ring_bytes: int = 0
    ring_high_water: int = 0
    device_buffer_bytes: int = 0
    resident_bytes: int = 0
    model_bytes: int = 0
    units: int = 0
    resident_units: int = 0
    rss_before_load: int = 0
    world_size: int = 1
    rank: int = 0
    gathered_bytes: int = 0
    io: str = ""  # the reader backend in use: "mmap", "pread" or "direct" ("auto" resolved)
    io_choice: dict | None = None  # io="auto" on O_DIRECT: what the reader measured and chose (tiered/reader.py)
    host_units: int = 0
    host_pieces: int = 0
    host_bytes: int = 0
    host_used_bytes: int = 0
    host_expert_modules: int = 0
    host_expert_bytes: int = 0
    experts_from_host: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _read_until: float = field(default=0.0, repr=False, compare=False)  # add_read: the end of the reads counted
    _placement: Any = field(default=None, repr=False, compare=False)  # the Placement the load built

    @property
    def placement(self) -> Any:
        """The :class:`~tiered.placement.Placement` the load built (where each unit lives, every budget): the value
        ``tiered inspect`` prints for the same options and machine. None once the model is gone (held weakly: it
        names the model's experts modules)."""
        return self._placement() if self._placement is not None else None

    def add_read(self, nbytes: int, seconds: float, *, resident: bool = False) -> None:
        """A read of ``nbytes`` of the checkpoint that ended now and took ``seconds`` (``resident``: a unit loaded
        once, at load). ``read_s`` counts the union of such reads' intervals, not their sum: reads made at once by
        two threads (the loader's and a head read in pieces by the model's thread,
        :class:`tiered.linear_pieces.RingLinearPieces`) count their overlap once. The union is kept as the time up to
        which a read was in flight, so a read reported after a later-starting one undercounts the part before that
        one's start."""
        with self._lock:
            now = time.perf_counter()
            counted = max(0.0, now - max(now - seconds, self._read_until))
            self._read_until = max(self._read_until, now)
            self.read_bytes += nbytes
            self.read_s += counted
            if resident:
                self.load_bytes += nbytes
                self.load_read_s += counted

    def add_decoded(self, nbytes: int) -> None:
        """A reader thread decoded ``nbytes`` of the model dtype from stored codes (tiered/quant.py)."""
        with self._lock:
            self.decoded_bytes += nbytes

    def add_slot_direct(self, nbytes: int) -> None:
        """A reader thread read ``nbytes`` with ``O_DIRECT`` straight into a ring slot (no staging copy; in
        ``read_bytes`` too)."""
        with self._lock:
            self.slot_direct_bytes += nbytes

    def add_pass(self, seconds: float) -> None:
        """One outermost call of the model took ``seconds`` (the caller's thread)."""
        with self._lock:
            self.passes += 1
            self.pass_s += seconds

    def add_streamed(self, nbytes: int) -> None:
        """A forward pass bound a streamed unit read from ``nbytes`` of the checkpoint."""
        with self._lock:
            self.streamed_bytes += nbytes
            self.units_streamed += 1

    def add_rows(self, nbytes: int) -> None:
        """A forward pass read ``nbytes`` of embedding rows (read and used at once)."""
        with self._lock:
            self.read_bytes += nbytes
            self.streamed_bytes += nbytes
            self.embedding_bytes += nbytes

    def add_expert_cache(self, hits: int, misses: int) -> None:
        """One call of a routed experts module found ``hits`` of its experts in the GPU expert cache."""
        with self._lock:
            self.expert_cache_hits += hits
            self.expert_cache_misses += misses

    def add_experts(self, nbytes: int, n: int) -> None:
        """A forward pass read ``n`` routed experts, ``nbytes`` of the checkpoint (read and used at once)."""
        with self._lock:
            self.read_bytes += nbytes
            self.streamed_bytes += nbytes
            self.expert_bytes += nbytes
            self.experts_read += n
            self.expert_calls += 1

    def add_host_experts(self, nbytes: int, n: int) -> None:
        """A forward pass copied ``n`` routed experts (``nbytes``) to the GPU from the host tier (not read)."""
        with self._lock:
            self.host_used_bytes += nbytes
            self.host_expert_bytes += nbytes
            self.experts_from_host += n
            self.expert_calls += 1

    def add_host_experts_loaded(self, nbytes: int) -> None:
        """One experts module's experts were placed in the host tier at load (``nbytes`` pinned)."""
        with self._lock:
            self.host_bytes += nbytes
            self.host_expert_modules += 1

    def set_io_choice(self, choice: dict) -> None:
        """io="auto" that picked O_DIRECT: the reader measured O_DIRECT and buffered reads while streaming and chose
        (``{"direct_gbps", "pread_gbps", "chosen", "reprobes"}``, then O_DIRECT's read shape: ``"shapes"``,
        ``"request"``, ``"depth"``; :attr:`tiered.reader.Reader.choice`); ``io`` becomes the chosen backend. Called
        on a reader thread each time the choice changes."""
        with self._lock:
            self.io_choice = dict(choice)
            self.io = choice["chosen"]

    def add_host_used(self, nbytes: int) -> None:
        """A forward pass bound a host-tier unit of ``nbytes`` (not a read: not in ``streamed_bytes`` or
        ``units_streamed``)."""
        with self._lock:
            self.host_used_bytes += nbytes

    def add_gathered(self, nbytes: int) -> None:
        """Distributed: ``nbytes`` of a unit arrived from the other ranks (all-gather), not from this rank's disk."""
        with self._lock:
            self.gathered_bytes += nbytes

    def add_h2d(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.h2d_bytes += nbytes
            self.h2d_s += seconds

    def snapshot(self) -> dict[str, float | int]:
        """A plain dict of every counter plus derived figures (bytes, seconds, GB/s) and current/peak RSS (bytes)."""
        with self._lock:
            d: dict[str, float | int] = {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}
        d["prefetch_idle_bytes"] = d["read_bytes"] - d["load_bytes"] - d["streamed_bytes"]
        d["dense_bytes"] = d["streamed_bytes"] - d["expert_bytes"] - d["embedding_bytes"]
        looked = d["expert_cache_hits"] + d["expert_cache_misses"]
        d["expert_cache_hit_rate"] = d["expert_cache_hits"] / looked if looked else 0.0
        d["expert_prefetch_accuracy"] = 0.0  # expert_prefetch was removed
        d["read_gbps"] = d["read_bytes"] / d["read_s"] / GB if d["read_s"] else 0.0
        d["h2d_gbps"] = d["h2d_bytes"] / d["h2d_s"] / GB if d["h2d_s"] else 0.0
        timed = d["pass_s"] and not d["mapped_units"] and not d["expert_modules"]
        d["disk_busy"] = (d["read_s"] - d["load_read_s"]) / d["pass_s"] if timed else 0.0
        d["pass_read_gbps"] = (d["read_bytes"] - d["load_bytes"]) / d["pass_s"] / GB if timed else 0.0
        st = proc_status()
        d["rss"] = st.get("VmRSS", 0)
        d["peak_rss"] = st.get("VmHWM", 0)
        d["rss_file"] = st.get("RssFile", 0)
        d["rss_anon"] = st.get("RssAnon", 0)
        return d

    def brief(self) -> str:
        """A short line for people: the model's size, what stays and what streams (embeddings read by rows counted
        apart), bytes used per forward pass and the process's peak RSS (``VmHWM``: everything since the process
        started, not only tiered's; ``str(stats)`` has every figure). Bytes in GB (1e9), memory in GiB (2**30)."""
        s = self.snapshot()
        passes = max(1, s["passes"])
        rows = s["row_units"]  # embeddings that read their rows: neither resident nor streamed whole
        where = (f"all {s['units']} units resident" if s["units"] and s["resident_units"] == s["units"]
                 else f"{s['units'] - s['resident_units'] - rows} of {s['units']} units streamed"
                      + (f" ({plural(rows, 'embedding')} read by rows)" if rows else "")
                      + f", {gb(s['streamed_bytes'] / passes)} per forward pass")
        return (f"tiered: model {gib(s['model_bytes'])}, {where}; ring {gib(s['ring_bytes'])}; "
                f"process peak RSS {gib(s['peak_rss'])} (VmHWM, since the process started)")

    def __str__(self) -> str:
        """One line; bytes moved in GB and GB/s, memory sizes in GiB (see the module docstring)."""
        s = self.snapshot()
        via = f", io={s['io']}" if s["io"] else ""
        if s["io_choice"]:  # io="auto" measured both cold-read backends while streaming
            from .reader import PROBE_MARGIN, SHAPE_MARGIN, shape_name

            c = s["io_choice"]
            via += f" chosen over {'pread' if c['chosen'] == 'direct' else 'direct'}: direct {c['direct_gbps']:.3g} " \
                   f"vs pread {c['pread_gbps']:.3g} GB/s (pread is kept only when {PROBE_MARGIN - 1:.0%} faster)"
            if c.get("shapes"):  # and then O_DIRECT's request size and depth (tiered.reader.read_shapes)
                rates = ", ".join(f"{k} {g:.3g}" for k, g in c["shapes"].items())
                via += (f"; {shape_name(c['request'], c['depth'])} chosen of {len(c['shapes'])} read shapes "
                        f"({rates} GB/s; another than the first is kept only when {SHAPE_MARGIN - 1:.0%} faster)")
            if c.get("reprobes"):
                via += f"; measured again {plural(c['reprobes'], 'time')} (the chosen way slowed)"
        if s["mapped_units"]:  # their bytes are faulted in by the compute itself: no copy, no read time of their own
            n = s["mapped_units"]
            read = (f"read {gb(s['read_bytes'])} (checkpoint{via}; {plural(n, 'unit')} {'computes' if n == 1 else 'compute'} "
                    "on the file mapping, zero copy: no ring copy)")
        else:
            if s["slot_direct_bytes"] and s["read_bytes"]:  # O_DIRECT requests that landed in the slot, no staging
                via += f", {min(1.0, s['slot_direct_bytes'] / s['read_bytes']):.0%} straight into the ring"
            read = f"read {gb(s['read_bytes'])} at {gbps(s['read_bytes'], s['read_s'])} (disk->ring{via})"
        if s["world_size"] > 1:  # every rank prints one of these: say whose, and that it is a share
            read = f"rank {s['rank']}/{s['world_size']}, this rank's 1/{s['world_size']} of each unit: " + read
        cache = (f"; expert cache {s['expert_cache_slots']} experts ({gib(s['expert_cache_bytes'])}), hit rate "
                 f"{s['expert_cache_hit_rate']:.1%}") if s["expert_cache_slots"] else ""
        if s["units"] and s["resident_units"] == s["units"]:
            read += f": all {s['units']} units resident, read once at load; " + (
                f"routed experts: {gb(s['expert_bytes'])} in {s['experts_read']} experts over {s['expert_calls']} calls"
                + cache if s["expert_modules"] else "nothing streams")
        else:
            read += ": " + (f"{gb(s['load_bytes'])} at load, " if s["load_bytes"] else "")
            # units loaded, summed over the passes (a unit each pass streams counts once a pass): not distinct units
            read += f"{gb(s['streamed_bytes'])} used by passes ({plural(s['units_streamed'], 'unit')} loaded"
            read += f", {size(s['embedding_bytes'])} of embedding rows" if s["row_units"] else ""
            if s["expert_modules"]:
                per = s["experts_read"] / s["expert_calls"] if s["expert_calls"] else 0.0
                read += (f", {gb(s['expert_bytes'])} of routed experts: {s['experts_read']} read in "
                         f"{s['expert_calls']} calls, {per:.3g} per call") + cache
            read += ")"
            if s["prefetch_idle_bytes"]:
                read += f", {gb(s['prefetch_idle_bytes'])} read ahead and not used (yet)"
        parts = [read]
        if s["h2d_bytes"]:
            parts.append(f"H2D {gb(s['h2d_bytes'])} at {gbps(s['h2d_bytes'], s['h2d_s'])} (ring->GPU)")
        if s["host_units"] or s["host_expert_modules"] or s["host_pieces"]:
            held = f"{s['host_units']} units" + (f" + {s['host_pieces']} pieces of others" if s["host_pieces"] else "") \
                + (f" + the experts of {s['host_expert_modules']} MoE blocks" if s["host_expert_modules"] else "")
            parts.append(f"host tier {held}, {gib(s['host_bytes'])}{' pinned' if s['h2d_bytes'] else ''}, "
                         f"{gb(s['host_used_bytes'])} used by passes")
        if s["world_size"] > 1:
            parts.append(f"{s['world_size']} ranks: {gb(s['gathered_bytes'])} all-gathered from the others")
        if s["disk_busy"] and s["streamed_bytes"]:
            rate = gbps(s["read_bytes"] - s["load_bytes"], s["pass_s"])
            parts.append(f"passes {s['passes']} in {s['pass_s']:.2f} s: read {rate} per pass-second, a read in "
                         f"flight {s['disk_busy']:.0%} of the time")
        parts += [
            f"stalls {s['stall_s']:.2f} s",
            f"hits/misses {s['hits']}/{s['misses']}",
            f"ring high-water {sig3(s['ring_high_water'] / GiB)} of {gib(s['ring_bytes'])}",
            f"resident {s['resident_units']}/{s['units']} units",
            f"peak RSS {gib(s['peak_rss'])} (model {gib(s['model_bytes'])})",
        ]
        return "; ".join(parts)
