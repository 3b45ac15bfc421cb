"""Counters users can read: bytes and GB/s per stage, stalls, ring high-water mark, peak RSS.

GB/s here is decimal (1e9 bytes/s), as disk and PCIe bandwidths are quoted. RSS figures come
from ``/proc/self/status`` (``VmRSS``, ``VmHWM`` = peak RSS, ``RssAnon``, ``RssFile``; Linux).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields

__all__ = ["Stats", "proc_status", "page_cache_room"]


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

    A cgroup charges the page cache of the files its processes read (the cgroup v2 memory controller,
    ``Documentation/admin-guide/cgroup-v2.rst``), so a model larger than this room is re-read from disk
    on every pass through ``mmap``, and ``io="direct"`` (no page cache) serves it better.
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
    return room, where


@dataclass
class Stats:
    """Live counters of one loaded model (updated by the loader/retire threads).

    read_*: disk -> ring (bytes read from the shards, seconds the loader spent reading).
    h2d_*: ring -> GPU (bytes copied, seconds measured with CUDA events on the copy stream).
    stall_s: seconds the caller waited for a unit that was not ready yet.
    """

    read_bytes: int = 0
    read_s: float = 0.0
    h2d_bytes: int = 0
    h2d_s: float = 0.0
    stall_s: float = 0.0
    hits: int = 0
    misses: int = 0
    units_streamed: int = 0
    ring_bytes: int = 0
    ring_high_water: int = 0
    device_buffer_bytes: int = 0
    resident_bytes: int = 0
    model_bytes: int = 0
    units: int = 0
    resident_units: int = 0
    rss_before_load: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add_read(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.read_bytes += nbytes
            self.read_s += seconds

    def add_h2d(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.h2d_bytes += nbytes
            self.h2d_s += seconds

    def snapshot(self) -> dict[str, float | int]:
        """A plain dict of every counter plus derived GB/s and current/peak RSS (bytes)."""
        d: dict[str, float | int] = {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}
        d["read_gbps"] = self.read_bytes / self.read_s / 1e9 if self.read_s else 0.0
        d["h2d_gbps"] = self.h2d_bytes / self.h2d_s / 1e9 if self.h2d_s else 0.0
        st = proc_status()
        d["rss"] = st.get("VmRSS", 0)
        d["peak_rss"] = st.get("VmHWM", 0)
        d["rss_file"] = st.get("RssFile", 0)
        d["rss_anon"] = st.get("RssAnon", 0)
        return d

    def __str__(self) -> str:
        s = self.snapshot()
        g = 1 << 30
        parts = [
            f"read {s['read_bytes'] / 1e9:.2f} GB at {s['read_gbps']:.2f} GB/s (disk->ring)",
        ]
        if s["h2d_bytes"]:
            parts.append(f"H2D {s['h2d_bytes'] / 1e9:.2f} GB at {s['h2d_gbps']:.1f} GB/s (ring->GPU)")
        parts += [
            f"stalls {s['stall_s']:.2f} s",
            f"hits/misses {s['hits']}/{s['misses']}",
            f"ring high-water {s['ring_high_water'] / g:.3f} of {s['ring_bytes'] / g:.3f} GiB",
            f"resident {s['resident_units']}/{s['units']} units",
            f"peak RSS {s['peak_rss'] / g:.2f} GiB (model {s['model_bytes'] / g:.2f} GiB)",
        ]
        return "; ".join(parts)
