"""Hostile tests of three changes: the reaper thread that closes dropped models (``tiered/api.py``: ``_on_drop``,
``_reap``, ``_close_all``), the host tier's routed experts (``tiered/experts.py``: ``HostExperts``) and the host
tier spread over the execution order (``tiered/api.py``: ``_choose_host``; ``tiered/placement.py``: ``place``).

Bad inputs, threads, interrupts and interpreter exit. Outputs are compared with stock ``transformers`` bit for bit;
crashes (SIGBUS) and interpreter exit are provoked in a child process so that they fail the test instead of killing
pytest. CPU only: ``HostExperts`` is built by hand (unpinned) as ``tests/test_experts.py`` does, and CUDA
placements are computed with an explicit ``gpu_gb``.
"""

from __future__ import annotations

import gc
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers

import tiered
import tiered.lifecycle as api
import tiered.policy as policy
from tests import models
from tiered.cli import _plan_for
from tiered.errors import ConfigError, ShardChangedError, TruncatedShardError
from tiered.experts import HostExperts
from tiered.hostmem import PAGE_SIZE, page_up
from tiered.placement import place_here

ROOT = Path(__file__).resolve().parents[1]
GiB = 1 << 30


# ---------------------------------------------------------------------------------------------- fixtures, helpers


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile_reaper_host")
    return {
        "llama": models.llama(root / "llama"),  # bf16
        "mixtral": models.mixtral(root / "mixtral"),  # bf16, 4 experts, top-2
        "mixtral32": models.mixtral(root / "mixtral32", dtype=torch.float32),
    }


def _in_a_fresh_process(request) -> bool:
    """Run this test alone in a new interpreter (True: it ran there and passed). For the Ctrl-C tests: once anything
    was compiled in this process (tests/test_compile.py runs earlier), ``torch._dynamo`` tags every module created
    afterwards in a weak dictionary whose *Python* weakref callbacks (``ExactWeakKeyDictionary._remove_id``) run
    when those modules are collected — a SIGINT landing in one is printed as 'Exception ignored' and lost, whatever
    tiered does. In a fresh interpreter only tiered's own code is under test."""
    if os.environ.get("TIERED_TEST_FRESH") == "1":
        return False
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", request.node.nodeid],
                       cwd=ROOT, env={**os.environ, "TIERED_TEST_FRESH": "1"}, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    return True


def _ids(seed=0, shape=(2, 7)):
    return torch.randint(0, models.VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def _ref(path, **kw):
    return transformers.AutoModelForCausalLM.from_pretrained(path, experts_implementation="grouped_mm", **kw).eval()


@pytest.fixture(scope="module")
def llama_ref(dirs):
    d = dirs["llama"]
    with torch.no_grad():
        return d, transformers.AutoModelForCausalLM.from_pretrained(d).eval()(_ids()).logits


def _ring_below_layer(path) -> float:
    """A ring smaller than the largest MoE layer (its experts cannot stream whole) that holds every layer without
    its routed experts (as tests/test_experts.py computes it)."""
    ref = _ref(path)
    layer = max(sum(p.numel() * p.element_size() for p in lay.parameters()) for lay in ref.model.layers)
    dense = max(sum(-(-p.numel() * p.element_size() // 64) * 64 for n, p in lay.named_parameters()
                    if ".experts." not in f".{n}" or "shared" in n) for lay in ref.model.layers)
    ring = max(layer * 0.6, -(-dense // 4096) * 4096 + 4096)
    assert ring < layer
    return ring / GiB


def _wait(pred, timeout=30.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


def _parts(m):
    """What a dropped model's finaliser must give back: the loader thread, the reader (its threads and shards)
    and the ring."""
    h = m._tiered
    return h.streamer.loader, h.reader, h.ring


def _released(loader, reader, ring) -> bool:
    return (not loader._thread.is_alive() and reader.pool._shutdown and not reader.maps
            and "buf" not in ring.__dict__)


def _drop(m) -> None:
    """Put ``m`` in a reference cycle (only the collector frees it); the caller deletes its own reference."""
    m.__dict__["_hostile_cycle"] = m


def _run_child(code: str, *args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=timeout, env={**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"})


def _restart_reaper_and_drain() -> None:
    """Leave a live reaper with an empty queue for the tests that follow (starts one if needed)."""
    api._start_reaper()
    _wait(lambda: api._REAP.empty(), 30)


# ---------------------------------------------------------------------------------------------- 1. the reaper


def test_many_models_dropped_from_several_threads_are_all_closed_by_the_reaper(llama_ref):
    """Three threads each load two models, check their output, drop them in reference cycles and collect at the
    same time: every model's loader, reader and ring are released, on the reaper thread, and every output before
    the drop is stock's."""
    d, want = llama_ref
    released: list[tuple] = []
    closers: list[str] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    start = threading.Barrier(3)

    def work(seed: int) -> None:
        try:
            ms = [tiered.load(d, device="cpu", ring_gb=1.0, prefetch=1) for _ in range(2)]
            for m in ms:
                with torch.no_grad():
                    assert torch.equal(m(_ids()).logits, want)
                loader = m._tiered.streamer.loader
                orig = loader.close

                def spy(*a, _orig=orig, **k):
                    with lock:
                        closers.append(threading.current_thread().name)
                    return _orig(*a, **k)

                loader.close = spy
                with lock:
                    released.append(_parts(m))
                _drop(m)
            del m, ms
            start.wait(30)
            gc.collect()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert len(released) == 6
    gc.collect()
    assert _wait(lambda: all(_released(*p) for p in released), 30), \
        [(p[0]._thread.is_alive(), p[1].pool._shutdown, len(p[1].maps)) for p in released]
    assert len(closers) == 6 and set(closers) == {"tiered-reaper"}, closers


def test_model_dropped_while_another_thread_runs_forward_leaves_it_stock(llama_ref):
    """A thread runs forward passes on one model while the main thread loads, drops and collects others (their
    closes run on the reaper meanwhile): every pass of the live model is stock's, and the dropped ones are closed."""
    d, want = llama_ref
    live = tiered.load(d, device="cpu", ring_gb=0.00025, prefetch=1)  # streamed: its loader is busy every pass
    stop = threading.Event()
    results: list[bool] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            while not stop.is_set() or len(results) < 3:
                with torch.no_grad():
                    results.append(torch.equal(live(_ids()).logits, want))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    dropped = []
    try:
        for _ in range(4):
            m = tiered.load(d, device="cpu", ring_gb=1.0, prefetch=1)
            with torch.no_grad():
                m(_ids(1))
            dropped.append(_parts(m))
            _drop(m)
            del m
            gc.collect()
    finally:
        stop.set()
        t.join(60)
    try:
        assert not errors, errors
        assert results and all(results), results
        assert _wait(lambda: all(_released(*p) for p in dropped), 30)
        with torch.no_grad():
            assert torch.equal(live(_ids()).logits, want)  # the live model is untouched by the reaps
    finally:
        live.close()


EXIT_CHILD = """
import gc, json, sys, threading, time
import torch, tiered
from safetensors import safe_open
d = sys.argv[1]
ids = torch.randint(0, 256, (1, 5))

def load(**kw):
    m = tiered.load(d, device="cpu", ring_gb=kw.pop("ring_gb", 1.0), **kw)
    with torch.no_grad():
        m(ids)
    return m

# a resident weight kept from a dropped model: still the checkpoint's bytes after its reap (the ring is not
# unmapped under it)
m = load()
w = m.model.layers[0].mlp.down_proj.weight
ring, loader = m._tiered.ring, m._tiered.streamer.loader
m.__dict__["_c"] = m
del m
gc.collect()
end = time.monotonic() + 30
while ("buf" in ring.__dict__ or loader._thread.is_alive()) and time.monotonic() < end:
    time.sleep(0.02)
assert "buf" not in ring.__dict__, "the dropped model's ring was not closed by the reaper"
key = "model.layers.0.mlp.down_proj.weight"
shard = json.load(open(f"{d}/model.safetensors.index.json"))["weight_map"][key]
with safe_open(f"{d}/{shard}", "pt") as f:
    want = f.get_tensor(key)
assert want.abs().sum() > 0
assert torch.equal(w, want), "a weight kept from a dropped model changed after its reap"

# dropped in cycles, never collected before exit
for _ in range(2):
    m = load(prefetch=2)
    m.__dict__["_c"] = m
# dropped and collected: pending on the reaper at exit
for _ in range(3):
    m = load(ring_gb=0.00025, prefetch=2)
    m.__dict__["_c"] = m
del m
gc.collect()
# dropped on another thread right before exit
def drop():
    mm = load(ring_gb=0.00025)
    mm.__dict__["_c"] = mm
    del mm
    gc.collect()
t = threading.Thread(target=drop)
t.start()
t.join()
# alive at exit, one of them mid-forward on a daemon thread
keep = [load()]
def run():
    mm = load(ring_gb=0.00025, prefetch=1)
    keep.append(mm)
    while True:
        try:
            with torch.no_grad():
                mm(ids)
        except Exception:
            return
threading.Thread(target=run, daemon=True).start()
time.sleep(1.0)
print("CHILD-OK", flush=True)
"""


def test_interpreter_exit_with_pending_reaps_is_clean(dirs):
    """A process that drops models in reference cycles (some collected and pending on the reaper, some never
    collected, one dropped on another thread), keeps others alive (one mid-forward on a daemon thread) and exits:
    rc 0, no 'terminate called', nothing ignored or traced, no hang. A weight kept from a dropped model still
    holds the checkpoint's bytes after the reaper closed it."""
    t0 = time.monotonic()
    r = _run_child(EXIT_CHILD, str(dirs["llama"]), timeout=120)
    took = time.monotonic() - t0
    err = r.stderr
    assert r.returncode == 0, (r.returncode, r.stdout[-2000:], err[-3000:])
    assert "CHILD-OK" in r.stdout, (r.stdout[-2000:], err[-3000:])
    for bad in ("terminate called", "Exception ignored", "Traceback", "Fatal Python error", "core dumped"):
        assert bad not in err, err[-3000:]
    assert took < 100, took


def _drop_with_a_failing_loader_close(d):
    """Load ``d``, make its loader's close raise (after closing), drop the model and collect it: its parts
    (loader, reader, ring), for the caller to watch."""
    a = tiered.load(d, device="cpu", ring_gb=1.0, prefetch=1)
    loader, reader, ring = _parts(a)
    orig = loader.close

    def failing(*x, **k):
        orig(*x, **k)
        raise RuntimeError("hostile: loader close failed")

    loader.close = failing
    _drop(a)
    del a
    gc.collect()
    return loader, reader, ring


def test_reaper_survives_a_failing_close_and_closes_the_next_drop(llama_ref):
    """An exception in a dropped model's close (there is no caller to report it to) does not stop the reaper:
    the next dropped model is still closed."""
    d, _ = llama_ref
    la, _, _ = _drop_with_a_failing_loader_close(d)
    assert _wait(lambda: not la._thread.is_alive(), 30)
    b = tiered.load(d, device="cpu", ring_gb=1.0, prefetch=1)
    pb = _parts(b)
    _drop(b)
    del b
    gc.collect()
    assert _wait(lambda: _released(*pb), 30), "a drop after a failing close was not closed"


def test_a_failing_part_does_not_leave_the_rest_of_a_dropped_model_open(llama_ref):
    """One part of a dropped model failing to close (its loader here) must not leak the others: nothing will
    ever retry the close of a dropped model, so its reader threads, shard mappings and ring must still go."""
    d, _ = llama_ref
    loader, reader, ring = _drop_with_a_failing_loader_close(d)
    try:
        assert _wait(lambda: not loader._thread.is_alive(), 30)
        ok = _wait(lambda: reader.pool._shutdown and not reader.maps and "buf" not in ring.__dict__, 5)
        assert ok, (f"after the loader's close raised, the rest of the dropped model stayed open: reader threads "
                    f"shut down={reader.pool._shutdown}, shard maps open={len(reader.maps)}, "
                    f"ring mapped={'buf' in ring.__dict__}")
    finally:
        reader.close()
        ring.close()


def test_a_drop_queued_behind_a_dying_reaper_is_still_closed(llama_ref):
    """The reaper dies (a close raises a BaseException its ``except Exception`` does not catch) while another
    dropped model is already queued behind it: that model must still be closed (here: within 10 s, with no further
    drop to restart the reaper)."""
    d, _ = llama_ref
    a = tiered.load(d, device="cpu", ring_gb=1.0, prefetch=1)
    b = tiered.load(d, device="cpu", ring_gb=1.0, prefetch=1)
    la = a._tiered.streamer.loader
    pb = _parts(b)
    entered, go = threading.Event(), threading.Event()
    orig = la.close

    def dying(*x, **k):
        entered.set()
        go.wait(10)
        orig(*x, **k)
        raise SystemExit("hostile: the reaper thread ends here")

    la.close = dying
    try:
        _drop(a)
        del a
        gc.collect()
        assert entered.wait(10), "the dropped model's close never started"
        _drop(b)
        del b
        gc.collect()  # queued: the reaper is alive (inside a's close)
        go.set()
        assert _wait(lambda: _released(*pb), 10), (
            f"the drop queued behind a dying reaper was never closed (reaper alive: {api._REAPER.is_alive()}, "
            f"queued closes: {api._REAP.qsize()})")
    finally:
        go.set()
        _restart_reaper_and_drain()
        assert _wait(lambda: _released(*pb), 30)


def _frames(frame):
    while frame is not None:
        yield f"{frame.f_code.co_name}@{Path(frame.f_code.co_filename).name}:{frame.f_lineno}"
        frame = frame.f_back


def test_keyboard_interrupt_while_gc_finalises_dropped_models_propagates(llama_ref, request):
    """Ctrl-C (SIGINT to the main thread) landing while ``gc.collect()`` finalises dropped models must reach the
    caller as KeyboardInterrupt, not be swallowed as 'Exception ignored' inside a finaliser or weakref callback
    that the collector runs on the main thread; the dropped models are still closed. A heap of small objects makes
    the collector's traversal long enough for the signal to land during it."""
    if _in_a_fresh_process(request):
        return
    d, _ = llama_ref
    main = threading.get_ident()
    ran_in: list[str] = []

    def handler(signum, frame):
        ran_in.append(" <- ".join(_frames(frame)))
        raise KeyboardInterrupt

    junk = [(i, [i]) for i in range(600_000)]  # slows the collector's traversal
    old = signal.signal(signal.SIGINT, handler)
    was = gc.isenabled()
    gc.disable()  # the dropped models are freed by the gc.collect() below, not by an automatic collection
    # other libraries' gc.callbacks (torch's, once torch._dynamo is imported by an earlier test) run Python code
    # around every collection and would swallow the interrupt themselves: this test is about tiered's own
    callbacks = gc.callbacks[:]
    gc.callbacks.clear()
    lost = []
    released = []
    try:
        for it in range(3):
            ms = [tiered.load(d, device="cpu", ring_gb=1.0, prefetch=1) for _ in range(2)]
            for m in ms:
                released.append(_parts(m))
                _drop(m)
            del m, ms
            ran_in.clear()
            timer = threading.Timer(0.02, signal.pthread_kill, (main, signal.SIGINT))
            caught = False
            try:
                timer.start()
                gc.collect()
                end = time.monotonic() + 1.5
                while time.monotonic() < end:
                    time.sleep(0.01)
            except KeyboardInterrupt:
                caught = True
            timer.join()
            if not caught:
                lost.append((it, list(ran_in)))
    finally:
        signal.signal(signal.SIGINT, old)
        gc.callbacks[:] = callbacks
        if was:
            gc.enable()
        del junk
    _wait(lambda: all(_released(*p) for p in released), 20)
    closed = f"{sum(_released(*p) for p in released)} of {len(released)}"
    where = [(it, [r.split(" <- test_")[0] for r in ran]) for it, ran in lost]
    assert not lost, (f"KeyboardInterrupt swallowed during gc.collect() (dropped models closed afterwards: {closed}); "
                      f"the SIGINT handler ran in: {where}")
    assert all(_released(*p) for p in released), f"dropped models closed: {closed}"


# ---------------------------------------------------------------------------------------------- 2. HostExperts


def _host(m, specs=None):
    h = m._tiered
    specs = [eg.spec for eg in h.experts] if specs is None else specs
    return h, HostExperts(specs, torch.device("cpu"))


def _use(h, hx) -> None:
    for eg in h.experts:
        eg.host = hx.parts(eg.spec)


def _unuse(h) -> None:
    for eg in h.experts:
        eg.host = None


def _assert_parts_stock(hx, ref) -> None:
    n = 0
    for sp in hx.specs:
        for p, t in zip(sp.parts, hx.parts(sp), strict=True):
            want = ref.get_parameter(f"{sp.name}.{p.target.attr}")
            assert want.abs().sum() > 0
            assert t.dtype == want.dtype and torch.equal(t, want), f"{sp.name}.{p.target.attr}"
            n += 1
    assert n > 0


def _files(specs) -> list[Path]:
    return sorted({Path(info.file) for sp in specs for p in sp.parts for per in p.per for info, _ in per})


TRUNC_CHILD = """
import os, sys, torch, tiered
from tiered.experts import HostExperts
d, ring = sys.argv[1], float(sys.argv[2])
m = tiered.load(d, ring_gb=ring, device="cpu", io="mmap")
h = m._tiered
specs = [eg.spec for eg in h.experts]
assert specs
victim = sorted({str(i.file) for sp in specs for p in sp.parts for per in p.per for i, _ in per})[-1]
os.truncate(victim, os.path.getsize(victim) // 2)
hx = HostExperts(specs, torch.device("cpu"))
try:
    hx.fill(h.reader, h.stats)
except tiered.TieredError as e:
    print("RAISED", type(e).__name__, "NAMES-FILE" if victim in str(e) else "NO-FILE", str(e), flush=True)
else:
    print("NO-ERROR", flush=True)
"""


def test_host_experts_fill_of_a_truncated_shard_mmap_raises_naming_the_file(dirs, tmp_path):
    """io='mmap': a shard truncated between load and ``HostExperts.fill`` must raise an error naming the file
    (as ``ExpertGather.read`` and ``Reader.read_unit`` do by checking the shard first), not kill the process with
    SIGBUS reading past the file's end through the mapping. In a child process."""
    d = Path(shutil.copytree(dirs["mixtral"], tmp_path / "m"))
    r = _run_child(TRUNC_CHILD, str(d), str(_ring_below_layer(d)))
    assert r.returncode == 0, (f"the child died (rc {r.returncode}: -7 is SIGBUS) filling the host tier from a "
                               f"truncated shard; stdout={r.stdout[-1000:]!r} stderr={r.stderr[-1500:]!r}")
    assert "RAISED" in r.stdout and "NAMES-FILE" in r.stdout, r.stdout[-2000:]


def test_host_experts_fill_of_a_truncated_shard_pread_raises_naming_the_file(dirs, tmp_path):
    d = Path(shutil.copytree(dirs["mixtral"], tmp_path / "m"))
    with tiered.load(d, ring_gb=_ring_below_layer(d), device="cpu", io="pread") as m:
        h, hx = _host(m)
        victim = _files(hx.specs)[-1]
        os.truncate(victim, victim.stat().st_size // 2)
        try:
            with pytest.raises((TruncatedShardError, ShardChangedError), match=re.escape(str(victim))):
                hx.fill(h.reader, h.stats)
        finally:
            hx.close()


@pytest.mark.parametrize("io", ["mmap", "pread"])
def test_host_experts_fill_of_a_rewritten_shard_raises_naming_the_file(dirs, tmp_path, io):
    """A shard rewritten in place (same size, other bytes) between load and ``HostExperts.fill`` must raise
    ShardChangedError naming the file — as a routed read of the same experts does — instead of filling the host
    tier with weights that are not the loaded checkpoint's (it then serves them for the model's whole life)."""
    d = Path(shutil.copytree(dirs["mixtral"], tmp_path / "m"))
    ref = _ref(d)
    with tiered.load(d, ring_gb=_ring_below_layer(d), device="cpu", io=io) as m:
        h, hx = _host(m)
        victim = _files(hx.specs)[-1]
        size = victim.stat().st_size
        with open(victim, "r+b") as f:  # flip every bit of the last quarter (tensor data), same size
            f.seek(size - size // 4)
            data = f.read()
            f.seek(size - size // 4)
            f.write(bytes(b ^ 0xFF for b in data))
        try:
            try:
                hx.fill(h.reader, h.stats)
            except ShardChangedError as e:
                assert str(victim) in str(e)
                return
            same = True
            try:
                _assert_parts_stock(hx, ref)
            except AssertionError:
                same = False
            pytest.fail(f"HostExperts.fill read a shard rewritten after load without ShardChangedError "
                        f"({'and its host tier now differs from the loaded checkpoint' if not same else 'same bits'})")
        finally:
            hx.close()


def _fill_interrupted(m):
    """``HostExperts.fill`` with a SIGINT to the main thread on its first copy (slow copies): (KeyboardInterrupt
    raised?, copies still running when it was raised, the HostExperts)."""
    h, hx = _host(m)
    main = threading.get_ident()
    inflight = [0]
    lock = threading.Lock()
    sent = threading.Event()
    orig = h.reader._copy

    def copy(*a):
        with lock:
            inflight[0] += 1
        try:
            if not sent.is_set():
                sent.set()
                signal.pthread_kill(main, signal.SIGINT)
            time.sleep(0.02)
            return orig(*a)
        finally:
            with lock:
                inflight[0] -= 1

    h.reader._copy = copy
    raised, running = False, 0
    callbacks = gc.callbacks[:]  # other libraries' gc callbacks would swallow the interrupt (see above)
    gc.callbacks.clear()
    # Python's own SIGINT handler (raises KeyboardInterrupt): a process started in the background of a
    # non-interactive shell (a CI job under `cmd &`) inherits SIGINT ignored, and Python then installs none
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        hx.fill(h.reader, h.stats)
    except KeyboardInterrupt:
        with lock:
            running = inflight[0]
        raised = True
    finally:
        signal.signal(signal.SIGINT, old)
        gc.callbacks[:] = callbacks
        sent.set()
        assert _wait(lambda: inflight[0] == 0, 30)
        del h.reader._copy  # the instance attribute: the class method again
    return raised, running, hx


def test_ctrl_c_during_host_experts_fill_propagates_and_a_refill_is_stock(dirs, request):
    """Ctrl-C during ``HostExperts.fill`` reaches the caller; the reader is still usable: a second fill gives stock's
    bits, and the model then serves its routed experts from the host tier with stock's outputs and no read."""
    if _in_a_fresh_process(request):
        return
    d = dirs["mixtral"]
    ref = _ref(d)
    ids = _ids(4)
    with tiered.load(d, ring_gb=_ring_below_layer(d), device="cpu", threads=2) as m:
        raised, _, hx = _fill_interrupted(m)
        h = m._tiered
        try:
            assert raised, "KeyboardInterrupt during HostExperts.fill was swallowed"
            hx.fill(h.reader, h.stats)
            _assert_parts_stock(hx, ref)
            _use(h, hx)
            before = tiered.stats(m).snapshot()
            with torch.no_grad():
                assert torch.equal(m(ids).logits, ref(ids).logits)
            after = tiered.stats(m).snapshot()
            assert after["experts_read"] == before["experts_read"] and after["experts_from_host"] > 0
        finally:
            _unuse(h)
            hx.close()


def test_ctrl_c_during_host_experts_fill_leaves_no_copy_running(dirs, request):
    """When Ctrl-C makes ``HostExperts.fill`` raise, no reader copy may still be writing into the host tier:
    ``Reader.copy_all`` promises to return or raise 'only once every copy has finished, so the caller may free the
    destinations as soon as this returns' — a KeyboardInterrupt landing in its wait must not break that."""
    if _in_a_fresh_process(request):
        return
    d = dirs["mixtral"]
    with tiered.load(d, ring_gb=_ring_below_layer(d), device="cpu", threads=2) as m:
        raised, running, hx = _fill_interrupted(m)
        hx.close()
        assert raised
        assert running == 0, f"{running} reader copies were still writing into the host tier when fill raised"


def test_host_experts_calls_from_several_threads_equal_stock(dirs):
    d = dirs["mixtral"]
    ref = _ref(d)
    seeds = [11, 12, 13]
    with torch.no_grad():
        want = {s: ref(_ids(s)).logits for s in seeds}
    with tiered.load(d, ring_gb=_ring_below_layer(d), device="cpu") as m:
        h, hx = _host(m)
        try:
            hx.fill(h.reader, h.stats)
            _use(h, hx)
            read0 = tiered.stats(m).experts_read
            got: dict[int, list[bool]] = {s: [] for s in seeds}
            errors: list[BaseException] = []
            go = threading.Barrier(len(seeds))

            def run(s):
                try:
                    go.wait(30)
                    for _ in range(3):
                        with torch.no_grad():
                            got[s].append(torch.equal(m(_ids(s)).logits, want[s]))
                except BaseException as e:  # noqa: BLE001
                    errors.append(e)

            ts = [threading.Thread(target=run, args=(s,)) for s in seeds]
            for t in ts:
                t.start()
            for t in ts:
                t.join(120)
            assert not errors, errors
            assert all(len(v) == 3 and all(v) for v in got.values()), got
            assert tiered.stats(m).experts_read == read0  # all from the host tier
        finally:
            _unuse(h)
            hx.close()


def test_host_experts_with_an_expert_cache_equal_stock(dirs):
    """An expert cache (hits copied from it) plus host parts (misses copied from them): stock's outputs, prefill and
    generate, with cache hits, experts from the host tier, and no expert read from the checkpoint."""
    d = dirs["mixtral"]
    ref = _ref(d)
    ids = _ids(5)
    with torch.no_grad():
        want = ref(ids).logits
        want_gen = ref.generate(ids, max_new_tokens=5, do_sample=False)
    probe = tiered.load(d, ring_gb=_ring_below_layer(d), device="cpu")
    e = probe._tiered.experts[0].spec.expert_bytes
    probe.close()
    with tiered.load(d, ring_gb=_ring_below_layer(d), device="cpu", expert_cache_gb=5.5 * e / GiB) as m:
        h, hx = _host(m)
        try:
            assert h.expert_cache is not None and 0 < h.expert_cache.slots
            hx.fill(h.reader, h.stats)
            _use(h, hx)
            before = tiered.stats(m).snapshot()
            with torch.no_grad():
                assert torch.equal(m(ids).logits, want)
                assert torch.equal(m.generate(ids, max_new_tokens=5, do_sample=False), want_gen)
            s = tiered.stats(m).snapshot()
            assert s["expert_cache_hits"] > before["expert_cache_hits"]
            assert s["experts_from_host"] > before["experts_from_host"]
            assert s["experts_read"] == before["experts_read"]
        finally:
            _unuse(h)
            hx.close()


@pytest.mark.parametrize(("ckpt", "dtype"), [("mixtral32", torch.bfloat16), ("mixtral", torch.float32)])
def test_host_experts_cast_equal_stock(dirs, ckpt, dtype):
    """``tiered.load(dtype=...)`` casts the host tier's copy as stock ``from_pretrained(dtype=...)`` casts its
    parameters: fp32 checkpoint run in bf16 (outputs compared too), bf16 checkpoint run in fp32 (parts compared: an
    fp32 one-row product on the CPU may round with the weight's address, see tests/test_experts.py)."""
    d = dirs[ckpt]
    ref = _ref(d, dtype=dtype)
    ids = _ids(6)
    with tiered.load(d, ring_gb=_ring_below_layer(d), device="cpu", dtype=dtype) as m:
        h, hx = _host(m)
        try:
            hx.fill(h.reader, h.stats)
            _assert_parts_stock(hx, ref)
            if dtype == torch.bfloat16:
                _use(h, hx)
                with torch.no_grad():
                    assert torch.equal(m(ids).logits, ref(ids).logits)
        finally:
            _unuse(h)
            hx.close()


def test_host_experts_subset_and_close_twice(dirs):
    """A host tier holding one block: ``parts`` is None for the others (read as usual), outputs are stock's;
    ``close()`` twice is harmless, and the model still runs (reading) after the host tier is gone."""
    d = dirs["mixtral"]
    ref = _ref(d)
    ids = _ids(7)
    with torch.no_grad():
        want = ref(ids).logits
    with tiered.load(d, ring_gb=_ring_below_layer(d), device="cpu") as m:
        specs = [eg.spec for eg in m._tiered.experts]
        assert len(specs) >= 2
        h, hx = _host(m, [specs[1]])
        try:
            assert hx.parts(specs[0]) is None and hx.parts(specs[1]) is not None
            hx.fill(h.reader, h.stats)
            _assert_parts_stock(hx, ref)
            _use(h, hx)
            before = tiered.stats(m).snapshot()
            with torch.no_grad():
                assert torch.equal(m(ids).logits, want)
            after = tiered.stats(m).snapshot()
            assert after["experts_read"] > before["experts_read"]  # the blocks it does not hold
            assert after["experts_from_host"] > before["experts_from_host"]
        finally:
            _unuse(h)
            hx.close()
            hx.close()
        with torch.no_grad():
            assert torch.equal(m(ids).logits, want)


# ---------------------------------------------------------------------------------------------- 3. host placement


def _place(d, **kw):
    config, ckpt, plan = _plan_for(d, None, "cuda")
    kw.setdefault("ring_gb", 0.01)
    kw.setdefault("gpu_gb", 0)
    return place_here(plan, device="cuda", ckpt_bytes=ckpt.nbytes, config=config, **kw), plan


@pytest.mark.parametrize("name", ["llama", "mixtral"])
@pytest.mark.parametrize("embedding_rows", [False, True])
@pytest.mark.parametrize("gpu_frac", [0, 0.4])
def test_host_tier_invariants_at_edge_budgets(dirs, name, embedding_rows, gpu_frac):
    """For budgets 0, 1 byte, below the smallest unit, every prefix of the execution order (and one byte either
    side), the total minus one byte, the total, and far more: the host tier is a subset of the units that would
    stream, never more than the budget (page-rounded, with its experts), takes them all when they fit, takes none
    when none fits, leaves no unit out that still fits, and leaves the resident units as they were."""
    d = dirs[name]
    _, whole = _place(d, embedding_rows=embedding_rows)
    gpu_gb = gpu_frac * sum(u.nbytes for u in whole.units) / GiB  # 0.4: some units resident, the rest streamed
    p0, plan0 = _place(d, embedding_rows=embedding_rows, gpu_gb=gpu_gb)
    assert not p0.host
    cand = set(p0.streamed)
    need = {i: page_up(plan0.units[i].nbytes) for i in cand}
    assert cand and (gpu_frac == 0 or p0.resident)
    total = sum(need.values())
    order = [i for i in range(len(plan0.units)) if i in cand]
    prefixes = [sum(need[i] for i in order[:k]) for k in range(1, len(order) + 1)]
    budgets = {0, 1, min(need.values()) - 1, total - 1, total, total + 1, 64 * total}
    budgets |= {b + e for b in prefixes for e in (-1, 0, 1)}
    for b in sorted(x for x in budgets if x >= 0):
        p, plan = _place(d, embedding_rows=embedding_rows, gpu_gb=gpu_gb, host_gb=b / GiB)
        host = set(p.host)
        used = sum(need[i] for i in host)
        assert sorted([*p.resident, *p.host, *p.streamed, *p.rows]) == list(range(len(plan.units))), b
        assert p.resident == p0.resident and p.rows == p0.rows, b
        assert host <= cand, (b, host - cand)
        assert used + p.host_expert_bytes <= b, (b, used, p.host_expert_bytes)
        assert all(page_up(plan.units[i].nbytes) == need[i] for i in host)
        if b >= total:
            assert host == cand, (b, total, cand - host)
        if b < min(need.values()):
            assert not host, b
        if b == total - 1:
            assert host != cand
        left = [i for i in cand - host if used + need[i] <= b]
        assert not left, f"budget {b}: units {left} still fit beside {sorted(host)} ({b - used} bytes left)"


def test_host_tier_spread_is_even_for_equal_units():
    """N equal units, a budget of k of them: exactly k taken, and every prefix of the execution order holds its
    even share k*m/N of them to within one unit (the spread the change promises)."""
    n = 3 * PAGE_SIZE
    for N in range(1, 17):
        plan = SimpleNamespace(units=[SimpleNamespace(index=i, nbytes=n) for i in range(N)])
        for k in range(N + 1):
            host = policy.choose_host(plan, set(), set(), [n] * N, k * n / GiB)
            assert len(host) == k, (N, k, sorted(host))
            c = 0
            for m in range(1, N + 1):
                c += (m - 1) in host
                assert abs(c - k * m / N) <= 1, (N, k, sorted(host))


def _host_bytes_sweep(sizes: list[int], resident: set[int] = frozenset()) -> list[tuple[int, int]]:
    plan = SimpleNamespace(units=[SimpleNamespace(index=i, nbytes=s) for i, s in enumerate(sizes)])
    total = sum(page_up(s) for i, s in enumerate(sizes) if i not in resident)
    out = []
    for b in range(0, total + 2 * PAGE_SIZE, PAGE_SIZE):
        host = policy.choose_host(plan, set(resident), set(), sizes, b / GiB)
        assert sum(page_up(sizes[i]) for i in host) <= b
        out.append((b, sum(page_up(sizes[i]) for i in host)))
    return out


def _drops(sweep):
    return [(b0, u0, b1, u1) for (b0, u0), (b1, u1) in zip(sweep, sweep[1:], strict=False) if u1 < u0]


@pytest.mark.xfail(strict=True, reason="known limitation (2026-12-01): the host tier spread over the execution order, "
                   "and the first-fit choice it falls back to, are not monotone in bytes when unit sizes differ a lot (a "
                   "larger budget can hold fewer bytes); bytes in the host tier matter only while reads bound the pass")
def test_more_host_budget_never_puts_fewer_bytes_in_the_host_tier_huge_next_to_tiny():
    """Huge units next to tiny ones (an embedding or lm_head beside small layers): raising ``host_gb`` must never
    leave fewer bytes in the host tier (every byte there is a byte not read per pass: fewer is slower, and
    ``tiered inspect`` would predict a slower model for more memory). Budgets swept one page at a time."""
    sizes = [1846, 1_000_000, 4788, 2776, 3_000_000, 12288, 1_000_000, 3_000_000]
    drops = _drops(_host_bytes_sweep(sizes))
    worst = max(drops, key=lambda x: x[1] - x[3], default=None)
    assert not drops, (f"{len(drops)} budget steps of one page put fewer bytes in the host tier; worst: host_gb "
                       f"{worst[0]} B holds {worst[1]} B but {worst[2]} B holds {worst[3]} B")


@pytest.mark.xfail(strict=True, reason="known limitation (2026-12-01): the host tier spread over the execution order, "
                   "and the first-fit choice it falls back to, are not monotone in bytes when unit sizes differ a lot (a "
                   "larger budget can hold fewer bytes); bytes in the host tier matter only while reads bound the pass")
def test_more_host_budget_never_puts_fewer_bytes_in_the_host_tier_through_place(dirs):
    """The same through ``place`` on the MoE checkpoint (units and whole blocks of experts, page-rounded), budgets
    swept one page at a time up to the streamed units' total."""
    d = dirs["mixtral"]
    p0, plan0 = _place(d, embedding_rows=False)
    total = sum(page_up(plan0.units[i].nbytes) for i in p0.streamed)
    sweep = []
    for b in range(0, total + 2 * PAGE_SIZE, PAGE_SIZE):
        p, plan = _place(d, embedding_rows=False, host_gb=b / GiB)
        sweep.append((b, sum(page_up(plan.units[i].nbytes) for i in p.host) + p.host_expert_bytes))
        assert sweep[-1][1] <= b
    drops = _drops(sweep)
    assert not drops, f"more host_gb, fewer bytes in the host tier (budget, bytes, budget, bytes): {drops}"


@pytest.mark.parametrize("host_gb", [-1, -0.5, -1e-9, float("nan"), float("inf"), float("-inf"), "1", True, None,
                                     1e300])  # 1e300 GiB overflows a byte count: refused, not an OverflowError
def test_bad_host_gb_through_load_is_a_config_error(dirs, host_gb):
    with pytest.raises(ConfigError, match="host_gb"):
        tiered.load(dirs["llama"], device="cpu", ring_gb=1.0, host_gb=host_gb)


def test_place_with_zero_host_gb_takes_nothing_and_refuses_a_negative_one(dirs):
    for host_gb in (0, 0.0, -0.0):
        p, _ = _place(dirs["mixtral"], host_gb=host_gb)
        assert not p.host and p.host_bytes == 0 and p.host_expert_modules == 0 and p.host_expert_bytes == 0
    with pytest.raises(ConfigError, match="host_gb"):  # as tiered.load refuses it
        _place(dirs["mixtral"], host_gb=-1.0)


def test_a_budget_for_all_units_and_experts_takes_every_expert_block(dirs):
    """A host budget holding every streamed unit and every routed block's experts (page-rounded) takes all of them;
    one byte less leaves one block of experts out (units come first)."""
    d = dirs["mixtral"]
    p0, plan0 = _place(d)
    assert p0.expert_modules >= 2
    units = sum(page_up(plan0.units[i].nbytes) for i in p0.streamed)
    big, _ = _place(d, host_gb=64 * units / GiB)
    assert big.host_expert_modules == big.expert_modules
    everything = units + big.host_expert_bytes
    p, _ = _place(d, host_gb=everything / GiB)
    assert set(p.host) == set(p0.streamed) and p.host_expert_modules == p.expert_modules
    q, _ = _place(d, host_gb=(everything - 1) / GiB)
    assert set(q.host) == set(p0.streamed) and q.host_expert_modules == q.expert_modules - 1
    assert q.host_expert_bytes < p.host_expert_bytes
