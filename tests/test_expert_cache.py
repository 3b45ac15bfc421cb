"""The expert cache (tiered/expert_cache.py): routed experts kept between calls, outputs unchanged.

The policy is checked on routing traces (its hit rate against LRU's, both computed here); the model tests run
on the CPU with ``expert_cache_gb`` (host memory there) and compare with stock ``transformers`` bit for bit.
"""

from __future__ import annotations

import random
import threading

import pytest
import torch
import transformers

import tiered
from tests import models
from tiered.errors import ConfigError
from tiered.expert_cache import ExpertCache

GiB = 1 << 30


def _hit_rate(policy: str, slots: int, trace: list[list[list[int]]]) -> float:
    """Replay ``trace`` (tokens x blocks x the experts each block picked) through a cache of ``slots``."""
    c = ExpertCache(0, slots, torch.device("cpu"), policy=policy)
    for token in trace:
        for b, picked in enumerate(token):
            got = c.lookup(b, picked)
            keep = {s for s in got if s is not None}
            for j, s in zip(picked, got, strict=True):
                if s is None and (t := c.admit(b, j, keep)) is not None:
                    keep.add(t)
                    c.commit(b, j, t)
    return c.hits / (c.hits + c.misses)


def _trace(tokens: int, blocks: int, experts: int, k: int, seed: int, skew: float = 0.0) -> list[list[list[int]]]:
    """Random top-k routing; ``skew`` > 0 weights expert j by 1 / (1 + j)^skew (a few hot experts per block)."""
    rng = random.Random(seed)
    w = [1 / (1 + j) ** skew for j in range(experts)]
    hot = [rng.sample(range(experts), experts) for _ in range(blocks)]  # each block its own hot experts
    out = []
    for _ in range(tokens):
        token = []
        for b in range(blocks):
            order = hot[b]
            picked: set[int] = set()
            while len(picked) < k:
                picked.add(order[rng.choices(range(experts), weights=w)[0]] if skew else rng.randrange(experts))
            token.append(sorted(picked))
        out.append(token)
    return out


@pytest.mark.parametrize(("blocks", "experts", "k", "slots"), [(6, 8, 2, 8), (6, 8, 2, 20), (12, 128, 8, 64)])
def test_layer_policy_beats_lru_on_uniform_routing(blocks, experts, k, slots):
    """Uniform routing (what random weights give): the layer policy reaches slots / (blocks x experts); LRU, whose
    oldest entries are the blocks about to run, falls below it when the cache is smaller than a token's experts."""
    trace = _trace(400, blocks, experts, k, seed=blocks + slots)
    layer, lru = _hit_rate("layer", slots, trace), _hit_rate("lru", slots, trace)
    ideal = slots / (blocks * experts)
    assert layer > lru
    assert layer == pytest.approx(ideal, rel=0.25)
    if slots < blocks * k:
        assert lru < 0.5 * ideal


def test_layer_policy_finds_hot_experts():
    """Skewed routing (a few hot experts per block): the policy swaps a block's cold experts for its hot ones and
    beats LRU by more."""
    trace = _trace(600, 6, 16, 2, seed=3, skew=1.5)
    layer, lru = _hit_rate("layer", 12, trace), _hit_rate("lru", 12, trace)
    assert layer > 12 / (6 * 16) * 1.5  # well above what uniform routing allows
    assert layer > lru + 0.1


def test_cache_bookkeeping():
    c = ExpertCache(64, 2, torch.device("cpu"))
    assert c.lookup(0, [1, 2]) == [None, None]
    assert c.admit(0, 1) == 0
    assert c.lookup(0, [1]) == [None]  # admitted but not committed (not filled yet): never served
    c.commit(0, 1, 0)
    assert c.admit(0, 2) == 1
    c.commit(0, 2, 1)
    assert c.admit(0, 1) is None  # already cached
    assert c.lookup(0, [1, 3]) == [0, None] and c.hits == 1 and c.misses == 4
    assert c.admit(1, 5) is None  # full: another block's expert never evicts this block's
    assert c.admit(0, 3, keep={0}) is None  # expert 2 (slot 1) was used as often as 3: not swapped
    c.lookup(0, [3])
    assert c.admit(0, 3, keep={0}) == 1 and c.where == {(0, 1): 0}  # 2 evicted; 3 not served until committed
    c.commit(0, 3, 1)
    assert c.where == {(0, 1): 0, (0, 3): 1}  # 3 is now used more than 2
    with pytest.raises(ValueError, match="policy"):
        ExpertCache(1, 1, torch.device("cpu"), policy="fifo")


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    # bf16 (see tests/test_experts.py: in fp32 a one-row product on the CPU rounds with the weight's address)
    return models.mixtral(tmp_path_factory.mktemp("cache") / "m", num_experts=8, top_k=2, max_shard_size="200KB")


def _ids(seed=0, shape=(2, 7)):
    return torch.randint(0, models.VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def _load(path, **kw):
    ref = transformers.AutoModelForCausalLM.from_pretrained(path)
    layer = max(sum(p.numel() * p.element_size() for p in lay.parameters()) for lay in ref.model.layers)
    return tiered.load(path, ring_gb=layer * 0.6 / GiB, device="cpu", **kw), ref


@pytest.mark.parametrize("policy", ["layer", "lru"])
def test_cached_experts_equal_stock_and_save_reads(mixtral, policy, monkeypatch):
    monkeypatch.setattr(tiered.expert_cache, "POLICY", policy)
    ids = _ids()
    m0, ref = _load(mixtral, expert_cache_gb=0)
    with m0:
        want = ref(ids).logits
        want_gen = ref.generate(ids, max_new_tokens=6, do_sample=False)
        assert torch.equal(m0(ids).logits, want)
        assert torch.equal(m0.generate(ids, max_new_tokens=6, do_sample=False), want_gen)
        s0 = tiered.stats(m0).snapshot()
        assert s0["expert_cache_slots"] == 0
    e = m0._tiered.experts[0].spec.expert_bytes
    total = sum(eg.spec.num_experts for eg in m0._tiered.experts)
    assert total > 10
    m, _ = _load(mixtral, expert_cache_gb=10.5 * e / GiB)  # 10 of the model's experts
    with m:
        assert torch.equal(m(ids).logits, want)
        assert torch.equal(m.generate(ids, max_new_tokens=6, do_sample=False), want_gen)
        s = tiered.stats(m).snapshot()
        assert s["expert_cache_slots"] == 10 and m._tiered.expert_cache.policy == policy
        assert s["expert_cache_hits"] > 0
        # every expert a call picked was either found in the cache or read, and nothing else changed
        assert s["expert_cache_hits"] + s["experts_read"] == s0["experts_read"]
        assert s["expert_bytes"] < s0["expert_bytes"]
        assert "hit rate" in str(tiered.stats(m))
        for eg in m._tiered.experts:  # the placeholders are back between calls
            assert all(p.device.type == "meta" for p in eg.spec.module.parameters(recurse=False))


def test_cache_larger_than_the_experts_keeps_them_all(mixtral):
    ids = _ids(1)
    m, ref = _load(mixtral, expert_cache_gb=1.0)
    with m:
        want = ref(ids).logits
        for _ in range(3):
            assert torch.equal(m(ids).logits, want)
        s = tiered.stats(m).snapshot()
        assert s["expert_cache_slots"] == sum(eg.spec.num_experts for eg in m._tiered.experts)  # capped at all of them
        read = s["experts_read"]
        assert torch.equal(m(ids).logits, want)
        assert tiered.stats(m).experts_read == read  # all hits now: nothing read


def test_cache_with_threads(mixtral):
    """Model calls from threads and direct calls of experts modules share one cache: each result equals stock."""
    m, ref = _load(mixtral, expert_cache_gb=0.0001)
    want = {s: ref(_ids(s)).logits for s in range(4)}
    errors: list = []

    def run(seed):
        try:
            for _ in range(3):
                assert torch.equal(m(_ids(seed)).logits, want[seed])
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    with m:
        assert m._tiered.expert_cache is not None
        ts = [threading.Thread(target=run, args=(s,)) for s in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
        assert not errors, errors
        assert not any(t.is_alive() for t in ts)


@pytest.mark.parametrize("bad", [-1, "2", float("nan")])
def test_bad_expert_cache_gb(mixtral, bad):
    with pytest.raises(ConfigError, match="expert_cache_gb"):
        tiered.load(mixtral, ring_gb=0.01, device="cpu", expert_cache_gb=bad)
