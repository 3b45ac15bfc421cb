"""A loaded model's life: close(), the reaper that closes models dropped without it, interpreter exit (atexit),
Ctrl-C (KeyboardInterrupt) during a pass or a close, and calls from several threads.

No crash, hang, leak or wrong number: outputs are compared with stock ``transformers`` bit for bit; crashes and
interpreter exit are provoked in a child process so that they fail the test instead of killing pytest. Ctrl-C and
threads inside one feature's own state are tested with that feature (tests/test_guard.py, test_experts.py,
test_expert_cache.py, test_host_tier.py, test_rows.py).
"""

from __future__ import annotations

import gc
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
import transformers
from conftest import (
    STOCK,
    Checkpoints,
    in_a_fresh_process,
    load_routed,
    make_ids,
    ring_below_layer,
    run_child,
    stream,
    streaming_ring_gb,
    wait_for,
)
from torch import nn

import tiered
import tiered.lifecycle
import tiered.lifecycle as api
from tiered import faults
from tiered.errors import StreamerError, TieredError
from tiered.hostmem import PAGE_SIZE

GiB = 1 << 30
TINY_RING = 0.00025  # 256 KiB: one layer of the llama test model, not the whole model


@pytest.fixture(scope="module")
def llama_ref_2x7(ckpts: Checkpoints) -> tuple[Path, torch.Tensor]:
    """The ``llama`` checkpoint and stock's logits for ``make_ids()`` (2 x 7): the reaper tests' reference."""
    d = ckpts["llama"]
    return d, STOCK.logits(d, 0, (2, 7))


def _frames(frame):
    while frame is not None:
        yield frame
        frame = frame.f_back


def _frame_names(frame):
    while frame is not None:
        yield f"{frame.f_code.co_name}@{Path(frame.f_code.co_filename).name}:{frame.f_lineno}"
        frame = frame.f_back


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


def _restart_reaper_and_drain() -> None:
    """Leave a live reaper with an empty queue for the tests that follow (starts one if needed)."""
    api._start_reaper()
    wait_for(lambda: api._REAP.empty(), 30)


# ---------------------------------------------------------------------------------------------- close


USE_AFTER_CLOSE = """
import sys, torch, tiered
from tiered.placeholder import is_placeholder
d, ring = sys.argv[1], float(sys.argv[2])
model = tiered.load(d, device="cpu", ring_gb=ring)
captured = []
layer = model.model.layers[1]
h = layer.mlp.register_forward_hook(lambda m, a, o: captured.append(m.down_proj.weight))
with torch.no_grad():
    model(torch.tensor([[1, 2, 3]]))
param = model.lm_head.weight                      # a parameter reference
sd = model.state_dict()                           # state_dict values (meta or bound, as it is now)
with model:
    pass                                          # the with block closes it
for t in [param, captured[0], *sd.values()]:
    if not is_placeholder(t):
        float(t.float().sum())                    # reads after close: must not crash
print("ok", len(captured))
"""


@pytest.mark.parametrize("mode", ["resident", "streamed"])
def test_tensors_read_after_close_do_not_crash(mode: str, ckpts: Checkpoints) -> None:
    d = ckpts["llama"]
    ring = 1.0
    if mode == "streamed":
        with tiered.load(d, device="cpu", ring_gb=1.0) as probe:
            ring = streaming_ring_gb(probe)
    r = run_child(USE_AFTER_CLOSE, str(d), str(ring))
    assert r.returncode == 0 and "ok 1" in r.stdout, (r.returncode, r.stderr[-2000:])


def test_closed_ring_is_unmapped_when_nothing_points_into_it(ckpts: Checkpoints) -> None:
    m = tiered.load(ckpts["llama"], device="cpu", ring_gb=1.0)
    mm = m._tiered.ring._mm
    m.close()
    assert mm.closed  # nothing kept a view: the mapping went at close, not at garbage collection


def test_units_refuse_to_run_after_close(llama_ref) -> None:
    d, _ = llama_ref
    m = stream(d)
    m.close()
    x = torch.randn(1, 3, 64).to(torch.bfloat16)
    for call in (lambda: m.lm_head(x), lambda: m.model(make_ids(0, (2, 10))), lambda: m.model.layers[1].mlp(x)):
        with pytest.raises(StreamerError, match="closed"):
            call()


def test_close_from_another_thread_during_forward(llama_ref) -> None:
    d, _ = llama_ref
    m = stream(d)
    started = threading.Event()

    def slow(**info):  # slow reads keep the forward busy while another thread closes the model
        started.set()
        time.sleep(0.05)

    err: list[BaseException] = []

    def run() -> None:
        try:
            with torch.no_grad():
                for _ in range(20):
                    m(make_ids(0, (2, 10)))
        except BaseException as e:  # noqa: BLE001
            err.append(e)

    with faults.inject("read", slow):
        t = threading.Thread(target=run)
        t.start()
        assert started.wait(30)
        m.close()
        t.join(timeout=60)
    assert not t.is_alive(), "the forward hung after close()"
    assert err and isinstance(err[0], TieredError), err
    assert not m._tiered.streamer.loader.alive


KI_IN_CLOSE = """
import signal, sys, threading, time, torch, tiered
d, ring, target = sys.argv[1], float(sys.argv[2]), sys.argv[3]
base = threading.active_count()
m = tiered.load(d, device="cpu", ring_gb=ring)
with torch.no_grad():
    m(torch.tensor([[1, 2, 3]]))
main = threading.main_thread().ident
signal.signal(signal.SIGINT, signal.default_int_handler)  # inherited SIG_IGN (a background CI job) would drop it
armed = [True]
def tracer(frame, event, arg):
    if event == "call" and frame.f_code.co_name == target and armed[0]:
        armed[0] = False
        signal.pthread_kill(main, signal.SIGINT)
sys.settrace(tracer)
try:
    m.close()
except KeyboardInterrupt:
    pass
finally:
    sys.settrace(None)
m.close()  # the user retries
time.sleep(0.3)
try:
    with torch.no_grad():
        m(torch.tensor([[1, 2, 3]]))
    refused = False
except tiered.StreamerError:
    refused = True
ours = sum(t.name != "tiered-reaper" for t in threading.enumerate())  # the reaper is process-wide, not the model's
print("threads", ours - base, "mapped", not m._tiered.ring._mm.closed, "refused", refused)
"""


@pytest.mark.parametrize("target", ["stop", "close", "shutdown", "try_unmap", "_release_all"])
def test_ctrl_c_inside_close_then_close_again_finishes(target: str, ckpts: Checkpoints) -> None:
    d = ckpts["llama"]
    with tiered.load(d, device="cpu", ring_gb=1.0) as probe:
        ring = streaming_ring_gb(probe)
    r = run_child(KI_IN_CLOSE, str(d), str(ring), target, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "threads 0 mapped False refused True" in r.stdout, r.stdout + r.stderr[-1500:]


# ------------------------------------------------------------------------------------------- dropped models, the reaper


def test_dropped_model_is_closed_off_the_collecting_thread(llama_ref) -> None:
    """A model dropped without close() is closed by the reaper thread, not inside the garbage collector's
    finaliser call on whatever thread collected it: a finaliser that blocks (joining the loader) swallows a
    Ctrl-C that lands meanwhile (the cause of a lost interrupt in the full suite). The close still happens."""
    import gc

    d, _ = llama_ref
    m = tiered.load(d, device="cpu", ring_gb=1.0, prefetch=1)
    loader = m._tiered.streamer.loader
    thread = loader._thread
    m.__dict__["_cycle"] = m  # a reference cycle: only the collector frees it
    del m
    closers: list[str] = []
    orig = loader.close

    def spy(*a, **k):
        closers.append(threading.current_thread().name)
        return orig(*a, **k)

    loader.close = spy
    gc.collect()
    thread.join(30)
    assert not thread.is_alive(), "the dropped model's loader thread was not stopped"
    assert closers and all(n == "tiered-reaper" for n in closers), closers


def test_model_dropped_without_close_is_collected_and_its_threads_end(llama_ref) -> None:
    import gc

    d, _ = llama_ref
    gc.collect()
    tiered.lifecycle._start_reaper()  # process-wide, started by the first load: not one of the model's threads
    base = set(threading.enumerate())  # threads of earlier tests may end meanwhile: only new ones count

    def new() -> list[str]:
        return [t.name for t in threading.enumerate() if t not in base]

    for _ in range(3):
        m = stream(d)
        with torch.no_grad():
            m(make_ids(0, (2, 10)))  # prefetches in flight when it is dropped
        del m
        gc.collect()
    deadline = time.time() + 30
    while new() and time.time() < deadline:
        time.sleep(0.1)
    assert not new(), new()


# ---------------------------------------------------------------------------------------------- Ctrl-C during a pass


def test_keyboard_interrupt_inside_a_unit_leaks_nothing(llama_ref) -> None:
    d, want = llama_ref
    with stream(d) as m, torch.no_grad():
        layer = m.model.layers[2]

        def interrupt(mod, args):
            raise KeyboardInterrupt

        for _ in range(4):  # more interrupts than the ring has slots
            h = layer.register_forward_pre_hook(interrupt)
            with pytest.raises(KeyboardInterrupt):
                m(make_ids(0, (2, 10)))
            h.remove()
            assert not m._tiered.streamer.held  # everything the interrupted pass bound was given back
        assert torch.equal(m(make_ids(0, (2, 10))).logits, want)


def test_keyboard_interrupt_while_waiting_for_a_unit(llama_ref) -> None:
    d, want = llama_ref
    main = threading.get_ident()
    ran_in: list[str] = []  # where the SIGINT handler ran: names the swallower if the interrupt is lost

    def handler(signum, frame):
        ran_in.append(" <- ".join(f"{f.f_code.co_name}@{Path(f.f_code.co_filename).name}:{f.f_lineno}"
                                  for f in _frames(frame)))
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGINT, handler)
    try:
        with stream(d, prefetch=0) as m, torch.no_grad():
            fired = threading.Event()

            def slow(**info):  # reads are slow, and the caller is interrupted while it waits for one
                if not fired.is_set() and info["unit"] == "model.layers.1":
                    fired.set()
                    signal.pthread_kill(main, signal.SIGINT)
                    time.sleep(0.3)

            for it in range(3):
                fired.clear()
                ran_in.clear()
                with faults.inject("read", slow):
                    try:
                        m(make_ids(0, (2, 10)))
                    except KeyboardInterrupt:
                        pass
                    else:
                        pytest.fail(f"iteration {it}: no KeyboardInterrupt; fired={fired.is_set()}, "
                                    f"the handler ran in: {ran_in}")
                assert fired.is_set()
                # the interrupted load goes on in the loader (its other tensors' reads): let it finish while the
                # fault point is disarmed, or its late reads would interrupt the next iteration at a random point
                time.sleep(1.0)
            assert not m._tiered.streamer.held
            assert torch.equal(m(make_ids(0, (2, 10))).logits, want)
    finally:
        signal.signal(signal.SIGINT, old)


KI_AT = """
import gc, signal, sys, threading, time, torch, tiered
d, ring, target = sys.argv[1], float(sys.argv[2]), sys.argv[3]
torch.manual_seed(0)
ids = torch.randint(0, 256, (2, 12))
m = tiered.load(d, device="cpu", ring_gb=ring)
with torch.no_grad():
    want = m(ids).logits
main = threading.main_thread().ident
signal.signal(signal.SIGINT, signal.default_int_handler)  # inherited SIG_IGN (a background CI job) would drop it
for k in range(8):  # a real SIGINT, delivered the moment the main thread enters `target`
    armed = [True]
    def tracer(frame, event, arg):
        if event == "call" and frame.f_code.co_name == target and armed[0]:
            armed[0] = False
            signal.pthread_kill(main, signal.SIGINT)
    sys.settrace(tracer)
    try:
        with torch.no_grad():
            m(ids)
    except KeyboardInterrupt:
        pass
    finally:
        sys.settrace(None)
with torch.no_grad():
    ok = torch.equal(m(ids).logits, want)
s = m._tiered.streamer
s.stop()
for f in list(s.pending.values()):
    s.loader.discard(f)
s.pending.clear()
time.sleep(0.2)
print("equal", ok, "held", len(s.held), "ring_used", m._tiered.ring.used)
"""


@pytest.mark.parametrize("target", ["_prefetch_after", "_take", "unbind", "_wait", "wait", "release_all", "reconcile"])
def test_ctrl_c_between_any_two_steps_leaks_nothing(target: str, ckpts: Checkpoints) -> None:
    d = ckpts["llama"]
    with tiered.load(d, device="cpu", ring_gb=1.0) as probe:
        ring = streaming_ring_gb(probe)
    r = run_child(KI_AT, str(d), str(ring), target, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "equal True held 0 ring_used 0" in r.stdout, r.stdout + r.stderr[-1500:]


# ---------------------------------------------------------------------------------------------- threads


def test_two_loads_in_two_threads_leak_no_global_state(llama_ref, ckpts: Checkpoints) -> None:
    d, want = llama_ref
    errors: list[BaseException] = []
    models: list[nn.Module] = []

    def load() -> None:
        try:
            for _ in range(3):
                models.append(tiered.load(d, device="cpu", ring_gb=1.0))
                models.append(tiered.load(ckpts["gptj"], device="cpu", ring_gb=1.0))  # fp16: sets the default dtype
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=load) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    lin = nn.Linear(2, 2)
    assert lin.weight.device.type == "cpu" and lin.weight.dtype == torch.float32
    assert torch.get_default_dtype() == torch.float32
    assert nn.Module.register_parameter is nn.Module.__dict__["register_parameter"]
    with torch.no_grad():
        for m in models:
            if m.config.model_type == "llama":
                assert torch.equal(m(make_ids(0, (2, 10))).logits, want)
            m.close()


def test_one_model_driven_from_threads_is_serialised_and_correct(llama_ref) -> None:
    d, want = llama_ref
    with stream(d) as m, torch.no_grad():
        results: list[torch.Tensor] = []
        errors: list[BaseException] = []

        def run() -> None:
            try:
                for _ in range(4):
                    results.append(m(make_ids(0, (2, 10))).logits)
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=run) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "hang"
        assert not errors, errors
        assert len(results) == 12 and all(torch.equal(r, want) for r in results)


def test_generate_from_two_threads(ckpts: Checkpoints) -> None:
    d = ckpts["llama"]
    ref = transformers.AutoModelForCausalLM.from_pretrained(d).eval()
    ids = make_ids(3, (2, 10))
    want = ref.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    with stream(d) as m:
        outs: list[torch.Tensor] = []
        threads = [threading.Thread(target=lambda: outs.append(
            m.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0))) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert len(outs) == 2 and all(torch.equal(o, want) for o in outs)


def test_unit_called_in_one_thread_while_the_model_runs_in_another(llama_ref) -> None:
    d, want = llama_ref
    ref = transformers.AutoModelForCausalLM.from_pretrained(d).eval()
    h = torch.randn(256, 12, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    with torch.no_grad():
        want_head = ref.lm_head(h)
    bad: list[str] = []
    stop = threading.Event()
    with stream(d) as m, torch.no_grad():
        def full() -> None:
            while not stop.is_set():
                if not torch.equal(m(make_ids(0, (2, 10))).logits, want):
                    bad.append("full")

        def head() -> None:
            for _ in range(30):
                o = m.lm_head(h)
                if not torch.equal(o, want_head):
                    bad.append(f"head {(o.float() - want_head.float()).abs().max().item()}")
            stop.set()

        ts = [threading.Thread(target=full), threading.Thread(target=head)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
        assert not any(t.is_alive() for t in ts)
    assert not bad, bad[:5]


def test_layers_called_directly_from_threads_with_a_small_ring(ckpts: Checkpoints) -> None:
    """Three threads each drive a different layer with a ring of two layers: they wait for each other,
    no spurious RingTooSmallError (the waiting caller holds no lock another thread needs)."""
    d = ckpts["llama"]
    ref = transformers.AutoModelForCausalLM.from_pretrained(d).eval()
    with tiered.load(d, device="cpu", ring_gb=1.0) as probe:
        plan = probe._tiered.plan
    big = max(u.nbytes for u in plan.units)
    x = torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    errors: list[BaseException] = []
    with tiered.load(d, device="cpu", ring_gb=2 * (big + PAGE_SIZE) / GiB) as m, torch.no_grad():
        assert tiered.stats(m).resident_units == 0
        want = {i: ref.model.layers[i].mlp(x) for i in range(3)}

        def run(i: int) -> None:
            try:
                for _ in range(10):
                    assert torch.equal(m.model.layers[i].mlp(x), want[i])
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        ts = [threading.Thread(target=run, args=(i,)) for i in range(3)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
        assert not any(t.is_alive() for t in ts), "hang"
    assert not errors, errors[:3]


# ---------------------------------------------------------------------------------------------- hostile


class TestHostileClose:
    """close() from another thread while generate runs (routed experts; zero copy with a tiny ring)."""

    @pytest.mark.parametrize("name", ["mixtral", "llama"])
    def test_close_from_another_thread_during_generate(self, ckpts, name):
        path = ckpts["mixtral"] if name == "mixtral" else ckpts["llama"]
        m = load_routed(path) if name == "mixtral" else tiered.load(path, device="cpu", ring_gb=TINY_RING)
        out: dict = {}

        def gen():
            try:
                out["r"] = m.generate(make_ids(11, (2, 6)), attention_mask=torch.ones(2, 6, dtype=torch.long),
                                      max_new_tokens=60, min_new_tokens=60, do_sample=False)
            except BaseException as e:  # noqa: BLE001
                out["e"] = e

        t = threading.Thread(target=gen)
        t.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        m.close()
        t.join(60)
        assert not t.is_alive() and time.monotonic() - t0 < 30
        assert isinstance(out.get("e"), StreamerError) or "r" in out, out
        with pytest.raises(StreamerError):
            m(make_ids(12))
        m.close()  # idempotent


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


class TestHostileReaper:
    """The reaper thread that closes dropped models (tiered/lifecycle.py ``_on_drop``, ``_reap``, ``_close_all``):
    drops from several threads, beside a running forward, at interpreter exit, behind a failing or dying close, and
    a Ctrl-C landing while the collector finalises them."""

    def test_many_models_dropped_from_several_threads_are_all_closed_by_the_reaper(self, llama_ref_2x7):
        """Three threads each load two models, check their output, drop them in reference cycles and collect at the
        same time: every model's loader, reader and ring are released, on the reaper thread, and every output before
        the drop is stock's."""
        d, want = llama_ref_2x7
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
                        assert torch.equal(m(make_ids()).logits, want)
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
        assert wait_for(lambda: all(_released(*p) for p in released), 30), \
            [(p[0]._thread.is_alive(), p[1].pool._shutdown, len(p[1].maps)) for p in released]
        assert len(closers) == 6 and set(closers) == {"tiered-reaper"}, closers


    def test_model_dropped_while_another_thread_runs_forward_leaves_it_stock(self, llama_ref_2x7):
        """A thread runs forward passes on one model while the main thread loads, drops and collects others (their
        closes run on the reaper meanwhile): every pass of the live model is stock's, and the dropped ones are closed."""
        d, want = llama_ref_2x7
        live = tiered.load(d, device="cpu", ring_gb=0.00025, prefetch=1)  # streamed: its loader is busy every pass
        stop = threading.Event()
        results: list[bool] = []
        errors: list[BaseException] = []

        def run() -> None:
            try:
                while not stop.is_set() or len(results) < 3:
                    with torch.no_grad():
                        results.append(torch.equal(live(make_ids()).logits, want))
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        t = threading.Thread(target=run)
        t.start()
        dropped = []
        try:
            for _ in range(4):
                m = tiered.load(d, device="cpu", ring_gb=1.0, prefetch=1)
                with torch.no_grad():
                    m(make_ids(1))
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
            assert wait_for(lambda: all(_released(*p) for p in dropped), 30)
            with torch.no_grad():
                assert torch.equal(live(make_ids()).logits, want)  # the live model is untouched by the reaps
        finally:
            live.close()


    def test_interpreter_exit_with_pending_reaps_is_clean(self, ckpts):
        """A process that drops models in reference cycles (some collected and pending on the reaper, some never
        collected, one dropped on another thread), keeps others alive (one mid-forward on a daemon thread) and exits:
        rc 0, no 'terminate called', nothing ignored or traced, no hang. A weight kept from a dropped model still
        holds the checkpoint's bytes after the reaper closed it."""
        t0 = time.monotonic()
        r = run_child(EXIT_CHILD, str(ckpts["llama"]), timeout=120)
        took = time.monotonic() - t0
        err = r.stderr
        assert r.returncode == 0, (r.returncode, r.stdout[-2000:], err[-3000:])
        assert "CHILD-OK" in r.stdout, (r.stdout[-2000:], err[-3000:])
        for bad in ("terminate called", "Exception ignored", "Traceback", "Fatal Python error", "core dumped"):
            assert bad not in err, err[-3000:]
        assert took < 100, took


    def test_reaper_survives_a_failing_close_and_closes_the_next_drop(self, llama_ref_2x7):
        """An exception in a dropped model's close (there is no caller to report it to) does not stop the reaper:
        the next dropped model is still closed."""
        d, _ = llama_ref_2x7
        la, _, _ = _drop_with_a_failing_loader_close(d)
        assert wait_for(lambda: not la._thread.is_alive(), 30)
        b = tiered.load(d, device="cpu", ring_gb=1.0, prefetch=1)
        pb = _parts(b)
        _drop(b)
        del b
        gc.collect()
        assert wait_for(lambda: _released(*pb), 30), "a drop after a failing close was not closed"


    def test_a_failing_part_does_not_leave_the_rest_of_a_dropped_model_open(self, llama_ref_2x7):
        """One part of a dropped model failing to close (its loader here) must not leak the others: nothing will
        ever retry the close of a dropped model, so its reader threads, shard mappings and ring must still go."""
        d, _ = llama_ref_2x7
        loader, reader, ring = _drop_with_a_failing_loader_close(d)
        try:
            assert wait_for(lambda: not loader._thread.is_alive(), 30)
            ok = wait_for(lambda: reader.pool._shutdown and not reader.maps and "buf" not in ring.__dict__, 5)
            assert ok, (f"after the loader's close raised, the rest of the dropped model stayed open: reader threads "
                        f"shut down={reader.pool._shutdown}, shard maps open={len(reader.maps)}, "
                        f"ring mapped={'buf' in ring.__dict__}")
        finally:
            reader.close()
            ring.close()


    def test_a_drop_queued_behind_a_dying_reaper_is_still_closed(self, llama_ref_2x7):
        """The reaper dies (a close raises a BaseException its ``except Exception`` does not catch) while another
        dropped model is already queued behind it: that model must still be closed (here: within 10 s, with no further
        drop to restart the reaper)."""
        d, _ = llama_ref_2x7
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
            assert wait_for(lambda: _released(*pb), 10), (
                f"the drop queued behind a dying reaper was never closed (reaper alive: {api._REAPER.is_alive()}, "
                f"queued closes: {api._REAP.qsize()})")
        finally:
            go.set()
            _restart_reaper_and_drain()
            assert wait_for(lambda: _released(*pb), 30)


    def test_keyboard_interrupt_while_gc_finalises_dropped_models_propagates(self, llama_ref_2x7, request):
        """Ctrl-C (SIGINT to the main thread) landing while ``gc.collect()`` finalises dropped models must reach the
        caller as KeyboardInterrupt, not be swallowed as 'Exception ignored' inside a finaliser or weakref callback
        that the collector runs on the main thread; the dropped models are still closed. A heap of small objects makes
        the collector's traversal long enough for the signal to land during it."""
        if in_a_fresh_process(request):
            return
        d, _ = llama_ref_2x7
        main = threading.get_ident()
        ran_in: list[str] = []

        def handler(signum, frame):
            ran_in.append(" <- ".join(_frame_names(frame)))
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
        wait_for(lambda: all(_released(*p) for p in released), 20)
        closed = f"{sum(_released(*p) for p in released)} of {len(released)}"
        where = [(it, [r.split(" <- test_")[0] for r in ran]) for it, ran in lost]
        assert not lost, (f"KeyboardInterrupt swallowed during gc.collect() (dropped models closed afterwards: {closed}); "
                          f"the SIGINT handler ran in: {where}")
        assert all(_released(*p) for p in released), f"dropped models closed: {closed}"



def test_stats_kept_after_the_model_is_dropped_hold_no_files(ckpts) -> None:
    """A Stats kept after its model is dropped (a benchmark collecting them) holds no module: its placement, which
    names the model's experts modules, is held weakly, so the dropped model's shard fds and mappings go."""
    import os

    d = ckpts["mixtral"]
    gc.collect()
    before = len(os.listdir("/proc/self/fd"))
    m = tiered.load(d, device="cpu", ring_gb=ring_below_layer(d))
    with torch.no_grad():
        m(torch.tensor([[1, 2, 3]]))
    st = tiered.stats(m)
    assert st.placement is not None and st.placement.specs  # routed: the placement names experts modules
    del m
    gc.collect()
    deadline = time.time() + 30  # the reaper closes a dropped model just after the collector frees it
    while len(os.listdir("/proc/self/fd")) > before and time.time() < deadline:
        time.sleep(0.05)
    assert len(os.listdir("/proc/self/fd")) <= before
    assert st.placement is None and st.expert_modules > 0  # the counters stay; the placement went with the model


# ---------------------------------------------------------------------------------------------- exit mid-read


def test_a_cancelled_job_never_submitted_does_not_hold_the_wait() -> None:
    """``_wait_all`` returns once every job is finished or cancelled, also a cancelled one no reader thread ever took
    (a Ctrl-C between ``jobs.append`` and ``pool.submit`` in ``Reader._go``, or a submit refused at interpreter exit):
    ``concurrent.futures.wait`` alone waits for ever on it."""
    from concurrent.futures import Future

    from tiered.reader import _wait_all

    done, ran = Future(), Future()
    done.set_result(1)
    pending = Future()
    assert pending.cancel()  # CANCELLED, never notified: no worker will ever call set_running_or_notify_cancel
    t = threading.Thread(target=_wait_all, args=([done, pending],), daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "_wait_all waited for a cancelled job that was never submitted"
    # a job still running is waited for (the cancel above must not make every job look done)
    assert ran.set_running_or_notify_cancel()
    t = threading.Thread(target=_wait_all, args=([ran],), daemon=True)
    t.start()
    t.join(0.5)
    assert t.is_alive(), "_wait_all returned while a job was still running"
    ran.set_result(None)
    t.join(10)
    assert not t.is_alive()


def test_a_second_interrupt_while_jobs_are_cancelled_still_waits_for_the_running_copy() -> None:
    """A Ctrl-C landing while ``_wait_all`` cancels the jobs not started (the caller gave up after a first one) is
    caught by the same guarded loop: the wait goes on until the running copy has finished, and only then is the
    interrupt raised — never while a copy still writes into the slot the caller frees next (a helper's attack,
    twenty-second session: before, the second Ctrl-C escaped from the cancel loop with the copy still running)."""
    from concurrent.futures import Future, ThreadPoolExecutor

    from tiered.reader import _run_job, _wait_all

    class CtrlCOnCancel(Future):
        hit = False

        def cancel(self) -> bool:
            if not self.hit:
                self.hit = True
                raise KeyboardInterrupt("second Ctrl-C")
            return super().cancel()

    with ThreadPoolExecutor(1) as pool:
        started = threading.Event()
        copying = Future()
        pool.submit(_run_job, copying, lambda: (started.set(), time.sleep(0.5)), ())
        assert started.wait(10)
        other = CtrlCOnCancel()
        with pytest.raises(KeyboardInterrupt):
            _wait_all([copying, other], cancel=True)
        assert copying.done() and not copying.cancelled(), "the wait ended while a copy was still running"
        assert other.hit and other.cancelled()


def test_a_refused_submit_fails_the_read_instead_of_hanging(ckpts: Checkpoints) -> None:
    """A read whose reader threads are gone (their pool shut down: what interpreter exit does before ``atexit`` runs
    tiered's close) fails at once with the pool's RuntimeError: the unit's first job was already in ``jobs`` when the
    submit was refused, and it was cancelled without ever reaching a thread."""
    m = tiered.load(ckpts["llama"], device="cpu", ring_gb=1.0, io="pread")
    try:
        rd = m._tiered.streamer.loader.reader
        u = next(u for u in m._tiered.streamer.units if u.src_bytes)
        dest = torch.empty(u.buf_bytes, dtype=torch.uint8)
        rd.pool.shutdown(wait=True)
        out: dict = {}

        def read() -> None:
            try:
                rd.read_unit(u, dest)
            except BaseException as e:  # noqa: BLE001
                out["e"] = e

        t = threading.Thread(target=read, daemon=True)
        t.start()
        t.join(20)
        assert not t.is_alive(), "a read with a refused submit hung"
        assert isinstance(out.get("e"), RuntimeError) and "cannot schedule" in str(out["e"]), out
    finally:
        m.close()


EXIT_MID_READ_CHILD = """
import sys, time, torch, tiered
from tiered import faults
d = sys.argv[1]
m = tiered.load(d, device="cpu", ring_gb=float(sys.argv[2]), prefetch=2, io="pread")
# every read request sleeps: when the script ends, the next pass's units are still being read, so the reader pool is
# shut down (threading._shutdown) under a loader that goes on to submit the next unit's requests
faults.inject("read", lambda **kw: time.sleep(0.3)).__enter__()
with torch.no_grad():
    m(torch.randint(0, 256, (1, 5)))
print("EXITING", time.time(), flush=True)
"""


def test_a_script_that_ends_while_a_unit_is_read_exits_at_once(ckpts: Checkpoints) -> None:
    """A script that ends without ``close()`` while a unit is being read exits within seconds, with status 0 and
    nothing printed. Before the fix in ``_wait_all`` the loader thread waited for ever on a job the stopped pool
    refused, and the exit took 3 x ``CLOSE_WAIT_S`` (90 s: the loader's, the reader's and the reaper's waits;
    a Llama-3-8B-shaped checkpoint on the 2-core machine, found 2026-12-07)."""
    probe = tiered.load(ckpts["llama"], device="cpu")
    try:
        ring = streaming_ring_gb(probe)
    finally:
        probe.close()
    r = run_child(EXIT_MID_READ_CHILD, str(ckpts["llama"]), str(ring), timeout=200)
    end = time.time()
    assert r.returncode == 0, (r.returncode, r.stdout[-2000:], r.stderr[-3000:])
    said = [ln for ln in r.stdout.splitlines() if ln.startswith("EXITING")]
    assert said, r.stdout[-2000:]
    took = end - float(said[0].split()[1])
    for bad in ("terminate called", "Exception ignored", "Traceback", "Fatal Python error"):
        assert bad not in r.stderr, r.stderr[-3000:]
    assert took < 20, f"the process took {took:.1f} s to exit after its script ended"
