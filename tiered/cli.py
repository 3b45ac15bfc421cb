"""The ``tiered`` command: ``generate``, ``chat``, ``serve`` (:mod:`tiered.serve`), ``inspect`` and ``reshard``
(:mod:`tiered.reshard`).

Every argument is checked before any weight is read, and before torch or transformers is imported
where the check does not need them (this module imports neither at import time; building the parser
and the option checks are pure Python): option ranges, ``--device``'s form, the model directory and
its ``config.json``, then the tokenizer and chat template (which need transformers), then the load.

Exit status: 0 done; 1 a runtime error (a :class:`~tiered.errors.TieredError`: a bad shard, ...),
printed as ``tiered: error: ...``; 2 a usage error (a bad option value, a missing model directory or
tokenizer), printed by argparse as ``tiered <command>: error: ...`` and naming the flag (``--ring-gb``,
never ``ring_gb``: errors ``tiered.load`` raises about its options are translated); 130 interrupted.

Figures: bytes moved in GB (1e9), rates in GB/s, memory sizes in GiB (2**30) (see :mod:`tiered.stats`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from .cli_checks import (
    _check_generate_args,
    _check_length,
    _check_model_dir,
    _check_shards,
    _device,
    _dtype,
    _fail,
    _number,
    _option_errors_as_usage,
    _prompt_inputs,
    _read_config,
)
from .inspection import (  # noqa: F401 - re-exported
    _plan_for,
    flags_for_options,
    inspect_dir,
    inspect_headers,
    print_headers,
    print_inspect,
)
from .stats import gb, gbps, gib, plural, proc_status, sig3, size

__all__ = ["main", "inspect_dir", "build_parser"]


def _cmd_inspect(a: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    d = _check_model_dir(parser, a.model_dir)
    _read_config(parser, d)
    asks_placement = a.ring_gb is not None or a.gpu_gb is not None or a.host_gb is not None or a.io is not None
    if not (a.units or a.all or a.dtype is not None or a.trust_remote_code or asks_placement):
        # what the headers say, torch-free (a fraction of a second); the rest needs the model built (--units)
        info = inspect_headers(d, device=a.device)
        if a.json:
            print(json.dumps(info, indent=2))
        else:
            print_headers(info)
        return 0
    _check_shards(d)  # a bad or truncated shard: said before torch and transformers load
    placement = None
    if asks_placement:
        from .placement import GBPS

        gbps = {k: v for k, v in (("disk", a.disk_gbps), ("page_cache", a.cache_gbps), ("h2d", a.h2d_gbps))
                if v is not None}
        placement = {"ring_gb": a.ring_gb, "gpu_gb": a.gpu_gb,
                     "host_gb": a.host_gb, "prefetch": a.prefetch, "io": a.io or "auto", "gbps": {**GBPS, **gbps}}
    with _option_errors_as_usage(parser):
        info = inspect_dir(a.model_dir, dtype=a.dtype, device=a.device, placement=placement,
                           trust_remote_code=a.trust_remote_code)
    if a.json:
        print(json.dumps(info, indent=2))
        return 0
    print_inspect(info, a, placement)
    return 0


# ---------------------------------------------------------------------------------------------- generate


class _IdStreamer:
    """A ``generate()`` streamer (transformers' ``BaseStreamer`` interface: ``put``, ``end``) that prints each new token
    id on stdout as soon as it is generated, space-separated, then a newline: ``--ids`` output streams like text does.
    The first ``put`` is the prompt (skipped)."""

    def __init__(self) -> None:
        self.prompt_seen = False
        self.first = True

    def put(self, value: Any) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        for i in value.reshape(-1).tolist():
            print(("" if self.first else " ") + str(i), end="", flush=True)
            self.first = False

    def end(self) -> None:
        print(flush=True)


def _cmd_generate(a: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if a.prompt == "-":  # the prompt from standard input, as `cat prompt.txt | tiered generate DIR --prompt -`
        a.prompt = sys.stdin.read()
        if not a.prompt.strip():
            _fail(parser, "--prompt -: standard input was empty; pipe the prompt in (echo 'Hi' | tiered generate DIR "
                          "--prompt -) or pass --prompt TEXT")
    _check_generate_args(a, parser)
    d = _check_model_dir(parser, a.model_dir)
    cfg = _read_config(parser, d)
    tok, enc = _prompt_inputs(a, parser, d, cfg, before_load=lambda: _check_shards(d))
    _check_length(a, parser, cfg, len(enc["input_ids"][0]))
    if a.ids:  # (a text prompt's shards were checked before its tokenizer loaded)
        _check_shards(d)

    import torch
    import transformers

    # transformers imports lazily: pull in what load() uses (its config and model classes) before the clock starts
    # and before load() measures "before load" RSS, whether or not a tokenizer was loaded already
    archs = cfg.get("architectures")
    for name in ("AutoConfig", *(archs[:1] if isinstance(archs, list) else [])):
        if isinstance(name, str):
            getattr(transformers, name, None)

    from .api import stats

    t0 = time.perf_counter()
    model = _load_for_cli(a, parser, d)
    load_s = time.perf_counter() - t0
    with model:
        if not callable(getattr(model, "generate", None)) or not model.can_generate():
            _fail(parser, f"MODEL_DIR {d}: {type(model).__name__} cannot generate text (not a causal LM); use the "
                          "Python API (tiered.load) for its forward")
        inputs = {k: torch.tensor(v, device=model.device) for k, v in enc.items()}
        n_in = inputs["input_ids"].shape[1]
        kw: dict[str, Any] = {"max_new_tokens": a.max_new_tokens, "do_sample": a.do_sample}
        for k in ("temperature", "top_p", "top_k"):
            if getattr(a, k) is not None:
                kw[k] = getattr(a, k)
        if tok is not None:
            from transformers import TextStreamer

            kw["streamer"] = TextStreamer(tok, skip_prompt=True, skip_special_tokens=True)
        else:  # --ids: each new id printed as it is generated
            kw["streamer"] = _IdStreamer()
        if a.seed is not None:
            from transformers import set_seed

            set_seed(a.seed)
        before = stats(model).snapshot()
        t1 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(**inputs, **kw)
        gen_s = time.perf_counter() - t1
        new = out[0, n_in:].tolist()
        sys.stdout.flush()
        after = stats(model).snapshot()
        for line in _summary(d, model, before, after, n_new=len(new), load_s=load_s, gen_s=gen_s):
            print(f"[tiered] {line}", file=sys.stderr)
        print(f"[tiered] {stats(model)}", file=sys.stderr)
    return 0


def _summary(d: Path, model: Any, before: dict, after: dict, *, n_new: int, load_s: float, gen_s: float) -> list[str]:
    """What ``tiered generate`` says after the text: GB and GB/s for bytes moved, GiB for memory."""
    plan = model._tiered.plan
    n_units, n_res = after["units"], after["resident_units"]
    where = "the GPU" if model.device.type == "cuda" else "the ring"
    ring = f"ring {gib(after['ring_bytes'])}"
    asked = model._tiered.opts.ring_gb
    given = model._tiered.placement.ring_why.startswith("given")  # not tiered's own choice (ring_gb=None)
    if given and asked * 2**30 > after["ring_bytes"] + 4096:  # tiered.load caps the ring at the (page-aligned) model
        what = "the units that go through it fit" if after["expert_modules"] else "the whole model fits"
        ring += f" (--ring-gb {asked:.3g} capped: {what} in less)"
    lines = [f"{d}: {type(model).__name__}, {n_units} units, model {gib(after['model_bytes'])}, "
             f"{ring}, device {model.device}; loaded in {load_s:.2f} s"]
    n = max(1, n_new)
    rate = f"{n_new} tokens in {gen_s:.2f} s: {sig3(n_new / gen_s) if gen_s > 0 else 'n/a'} tokens/s " \
           f"({sig3(gen_s / n)} s/token)"
    streamed = after["streamed_bytes"] - before["streamed_bytes"]
    if n_res == n_units and not after["expert_modules"]:
        lines.append(f"{rate}; all {plural(n_units, 'unit')} resident in {where} (read once, at load: "
                     f"{gb(after['load_bytes'])}); nothing streamed per token")
    else:
        st = model._tiered.streamer
        ring_units = [i for i in st.streamed if i not in st.host_ids]  # read each pass (row-read embeddings apart)
        n_ring = len(ring_units)
        src = sum(plan.units[i].src_bytes for i in ring_units)
        # every count below names its own noun (no "of them" that could mean the embeddings or the host tier)
        part = (f"the {plural(n_ring, 'streamed unit')} {'is' if n_ring == 1 else 'are'} {gb(src)}" if ring_units
                else "no unit streams whole")
        if st.host_ids:
            part += (f" ({len(st.host_ids)} more in the host tier: {gib(after['host_bytes'])}, read once at load, "
                     f"{gb(after['host_used_bytes'] - before['host_used_bytes'])} used by the passes)")
        on_map = len(set(ring_units) & set(model._tiered.placement.mapped))  # (a row-read embedding is mapped too)
        if on_map:
            who = ("it computes" if n_ring == 1 else f"all {n_ring} compute" if on_map == n_ring else
                   f"{on_map} of the {n_ring} {'computes' if on_map == 1 else 'compute'}")
            part += f"; {who} on the file mapping (zero copy)"
        lp = model._tiered.placement.linear_pieces  # larger than the ring: computed in pieces of rows on the mapping
        if lp:
            lp_bytes = sum(plan.units[i].src_bytes for i in lp)
            part += (f"; plus {plural(len(lp), 'linear unit')} larger than the ring ({gb(lp_bytes)}) computed in "
                     "pieces of rows on the file mapping")
        if after["page_cache_units"]:
            part += (f", {after['page_cache_units']} of those ({gb(after['page_cache_bytes'])}) "
                     f"kept in the page cache between tokens (io=auto: the room the memory limit leaves; the rest "
                     "read O_DIRECT)")
        if after["row_units"]:
            rows = after["embedding_bytes"] - before["embedding_bytes"]
            part += (f"; plus {size(rows)} of embedding rows in all ({plural(after['row_units'], 'embedding')} "
                     "read by row)")
        if after["expert_modules"]:
            ex = after["expert_bytes"] - before["expert_bytes"]
            blocks = after["expert_modules"]
            part += (f"; plus {gb(ex)} of routed experts ({plural(blocks, 'MoE block')} "
                     f"{'reads' if blocks == 1 else 'read'} only the experts {'its' if blocks == 1 else 'their'} "
                     "router picked")
            if after["expert_cache_slots"]:
                hits = after["expert_cache_hits"] - before["expert_cache_hits"]
                looked = hits + after["expert_cache_misses"] - before["expert_cache_misses"]
                part += (f"; the expert cache holds {plural(after['expert_cache_slots'], 'expert')}, "
                         f"{hits / max(1, looked):.0%} of picks found there")
            part += ")"
        if n_res:
            part += f"; {plural(n_res, 'unit')} resident in {where}"
        lines.append(f"{rate}; streamed {gb(streamed)} ({gb(streamed / n)}/token; {part}) at "
                     f"{gbps(streamed, gen_s)} end to end; stalls {after['stall_s'] - before['stall_s']:.2f} s")
    st = proc_status()
    if st.get("VmHWM"):
        lines.append(f"peak RSS {gib(st['VmHWM'])} ({gib(after['rss_before_load'])} before load); "
                     f"ring {gib(after['ring_bytes'])}, model {gib(after['model_bytes'])}")
    return lines


# ---------------------------------------------------------------------------------------------- parser

_GENERATE_DESCRIPTION = """\
Generate text from a local Hugging Face model directory whose weights stream from its safetensors
shards through a fixed host ring (peak RSS ~ --ring-gb + the runtime, whatever the model size).

--prompt is encoded with the model's own tokenizer (--chat first applies its chat template) and the
new text is printed to stdout as it is generated; greedy unless --do-sample. Timing, bytes streamed
and peak RSS go to stderr afterwards, so stdout is only the text. --ids takes and prints raw token ids
instead (for a model directory without a tokenizer). Every option is checked before a weight is read."""

_GENERATE_EPILOG = """\
examples:
  tiered generate ~/models/TinyLlama-1.1B-Chat --prompt "The capital of France is" --max-new-tokens 20
  tiered generate ~/models/TinyLlama-1.1B-Chat --chat --prompt "Write a haiku about disks" --ring-gb 1
  tiered generate ~/models/TinyLlama-1.1B-Chat --chat --system "Answer in one line" --prompt "What is a page cache?"
  tiered generate ~/models/llama --do-sample --temperature 0.7 --top-p 0.9 --seed 0 --prompt "Once upon a time"
  tiered generate ~/models/llama --ids --prompt "1 15043 29892"      (token ids in, token ids out)
  tiered generate ~/models/llama --prompt "Hello" 2>/dev/null        (only the text)

units: --ring-gb, --gpu-gb and --host-gb in GiB (2**30 bytes); bytes streamed in GB (1e9 bytes), rates in GB/s.
exit status: 0 done, 1 runtime error (a bad shard...), 2 usage error (a bad option, no tokenizer...), 130 interrupted
"""

_INSPECT_DESCRIPTION = """\
Show what streaming a model directory involves, reading only config.json and the safetensors headers
(no weight). By default, in a fraction of a second and without importing torch or transformers: its
shards, tensors, dtypes and bytes, its quantization_config, how its layers lie on disk, and the ring
tiered.load takes here when --ring-gb is not given. With --units (implied by --all, --dtype,
--trust-remote-code and the placement options), the model is built on the meta device (seconds) to
add its units (one per decoder layer, one per other module) in execution order with their sizes, the
ring size they need (--ring-gb), the default host tier, MoE experts, and whether the layout on disk
streams each unit as one span (else `tiered reshard` writes one that does)."""

_INSPECT_EPILOG = """\
examples:
  tiered inspect ~/models/llama-3-8b
  tiered inspect ~/models/llama-3-8b --units
  tiered inspect ~/models/llama-3-8b --dtype bf16 --device cuda --all
  tiered inspect ~/models/llama-3-8b --units --json | jq .ring_min_gb
  tiered inspect ~/models/llama-3-8b --device cuda --ring-gb 1 --gpu-gb 8 --host-gb 4

sizes in GiB (2**30 bytes) and MiB (2**20 bytes).
exit status: 0 done, 1 runtime error (a bad shard...), 2 usage error
"""


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tiered")
    except PackageNotFoundError:  # run from a source tree that is not installed
        return "unknown (not installed)"


class _LazyVersion(argparse.Action):
    """``--version``, as argparse's ``action="version"`` prints it, with the version looked up only when asked
    (``importlib.metadata`` takes tens of milliseconds of every command's start otherwise)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kw: Any) -> None:
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0,
                         help="show program's version number and exit")

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        print(f"tiered {_version()}")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    """The ``tiered`` argument parser (imports neither torch nor transformers)."""
    p = argparse.ArgumentParser(
        prog="tiered",
        description="Run Hugging Face models whose weights are larger than host RAM: weights stream from\n"
        "safetensors shards through a fixed host ring (RSS ~ ring size), to the GPU when there is one.",
        epilog="examples:\n  tiered inspect ~/models/llama\n  tiered generate ~/models/llama --prompt \"Hello\" "
        "--ring-gb 1\n  tiered reshard ~/models/llama ~/models/llama.tiered\n\n"
        "`tiered COMMAND --help` describes each command.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action=_LazyVersion)
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    _add_generate_parser(sub)
    _add_chat_parser(sub)
    _add_serve_parser(sub)
    _add_inspect_parser(sub)
    from .reshard import add_parser as add_reshard_parser

    add_reshard_parser(sub)
    return p


_TRUST_HELP = ("run MODEL_DIR's own model code (config.json's auto_map), as transformers' trust_remote_code=True; "
               "only for code you have read")


def _add_generate_parser(sub: Any) -> None:
    """``tiered generate``'s arguments."""
    g = sub.add_parser("generate", help="generate text from a model directory, streaming its weights",
                       description=_GENERATE_DESCRIPTION, epilog=_GENERATE_EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    g.add_argument("model_dir", metavar="MODEL_DIR",
                   help="local Hugging Face model directory: config.json, *.safetensors (and a tokenizer for text)")
    g.add_argument("--trust-remote-code", action="store_true", help=_TRUST_HELP)
    t = g.add_argument_group("prompt")
    t.add_argument("--prompt", default="Hello", metavar="TEXT",
                   help="the prompt, encoded with MODEL_DIR's tokenizer; '-' reads it from standard input "
                   "(default: %(default)r)")
    t.add_argument("--chat", action="store_true",
                   help="wrap --prompt as a user message in the tokenizer's chat template (with the assistant's "
                   "generation prompt)")
    t.add_argument("--system", default=None, metavar="TEXT",
                   help="with --chat: a system message before the user's (as llama.cpp's and vLLM's chat clients send)")
    t.add_argument("--ids", action="store_true",
                   help="--prompt is token ids ('1 2 3'), and token ids are printed; needs no tokenizer")
    _add_sampling_args(g, 20, "tokens to generate, at most")
    _add_streaming_args(g)
    g.set_defaults(fn=_cmd_generate, cli_parser=g)


def _compute_threads(s: str) -> str | int:
    """``--compute-threads``: 'auto' or an integer >= 1."""
    if s == "auto":
        return s
    try:
        n = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be 'auto' or an integer >= 1, got {s!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be 'auto' or an integer >= 1, got {n}")
    return n


def _add_sampling_args(g: argparse.ArgumentParser, max_new: int, what: str) -> None:
    """The generation options of ``generate`` and ``chat`` (``--max-new-tokens`` defaults to ``max_new``)."""
    s = g.add_argument_group("generation (greedy unless --do-sample)")
    s.add_argument("--max-new-tokens", type=_number(int, low=1), default=max_new, metavar="N",
                   help=f"{what} (default %(default)s)")
    s.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    s.add_argument("--temperature", type=_number(float, low=0, low_open=True), default=None, metavar="T",
                   help="sampling temperature > 0 (default: the model's generation_config, else 1.0)")
    s.add_argument("--top-p", type=_number(float, low=0, low_open=True, high=1), default=None, metavar="P",
                   help="nucleus sampling: keep the smallest set of tokens with probability >= P, 0 < P <= 1")
    s.add_argument("--top-k", type=_number(int, low=0), default=None, metavar="K",
                   help="keep the K most likely tokens (0: no limit)")
    s.add_argument("--seed", type=_number(int, low=0, high=2**32 - 1), default=None, metavar="S",
                   help="seed the random generators, for a reproducible sample")


def _add_streaming_args(g: argparse.ArgumentParser) -> None:
    """The options a load takes (``generate``, ``serve``), as ``tiered.load``'s keywords."""
    r = g.add_argument_group("streaming")
    r.add_argument("--ring-gb", type=_number(float, low=0, low_open=True, unit=" GiB"), default=None, metavar="GiB",
                   help="host ring size in GiB; peak RSS ~ ring + runtime (default: 4, or what the host's memory and "
                   "cgroup limit leave; `tiered inspect` says the least that works)")
    r.add_argument("--device", type=_device, default=None, help="cpu, cuda or cuda:N (default: cuda if available)")
    r.add_argument("--dtype", type=_dtype, default=None, metavar="{bf16,fp16,fp32}",
                   help="compute dtype, cast while streaming (default: as from_pretrained's: config.json's, "
                   "else the checkpoint's)")
    r.add_argument("--gpu-gb", type=_number(float, low=0, unit=" GiB"), default=None, metavar="GiB",
                   help="GiB of GPU memory for units kept resident plus the running unit's buffer, as accelerate's "
                   "max_memory counts; the prefetch buffers come on top (default: free memory - 4 GiB, all inside)")
    r.add_argument("--host-gb", type=_number(float, low=0, unit=" GiB"), default=None, metavar="GiB",
                   help="GiB of host memory holding streamed units, read once and kept: on CUDA pinned and copied to "
                   "the GPU every token (then routed MoE blocks' experts too), on the CPU computed in place (as "
                   "accelerate's max_memory['cpu']); no disk read for them after load; host RSS grows by it "
                   "(default: with --ring-gb not given either, what the host's memory and cgroup limit leave beside "
                   "the ring when the model does not stay whole; otherwise 0)")
    r.add_argument("--expert-cache-gb", type=_number(float, low=0, unit=" GiB"), default=None, metavar="GiB",
                   help="MoE models: GiB of routed experts kept on the device between tokens (default: on CUDA what "
                   "--gpu-gb leaves; 0: none)")
    r.add_argument("--prefetch", type=_number(int, low=0), default=2, metavar="N",
                   help="units loaded ahead of the one running (default %(default)s)")
    r.add_argument("--threads", type=_number(int, low=1), default=None, metavar="N",
                   help="reader threads (default: 4, more for a losslessly compressed checkpoint, whose chunks the "
                   "readers decode)")
    r.add_argument("--compute-threads", type=_compute_threads, default="auto", metavar="N",
                   help="torch's CPU compute threads (llama.cpp's -t), or 'auto' (default): where units stream on the "
                   "CPU, the cores less those the reader threads take (min(--threads, cores / 2)), so the two do not "
                   "oversubscribe the cores")
    r.add_argument("--io", choices=["mmap", "pread", "direct", "auto"], default="auto",
                   help="mmap: through the page cache; pread: the page cache copied by read(2), "
                   "nothing mapped; direct: O_DIRECT, bypasses the page cache; "
                   "auto (default): direct when the model does not fit in the page cache (RAM or cgroup memory.max), "
                   "else mmap")


def _load_for_cli(a: argparse.Namespace, parser: argparse.ArgumentParser, d: Path) -> Any:
    """``tiered.load`` with the streaming options of ``a`` (their errors as usage errors naming the flag)."""
    import torch

    from .api import load

    if a.device is not None and a.device.startswith("cuda:"):  # (no CUDA at all: tiered.load says so)
        n_dev, index = torch.cuda.device_count(), int(a.device.partition(":")[2])
        if 0 < n_dev <= index:
            _fail(parser, f"--device {a.device}: this machine has {n_dev} CUDA device(s), cuda:0 to cuda:{n_dev - 1}")
    with _option_errors_as_usage(parser):
        return load(d, ring_gb=a.ring_gb, device=a.device, dtype=a.dtype, prefetch=a.prefetch, gpu_gb=a.gpu_gb,
                    threads=a.threads, io=a.io, host_gb=a.host_gb, expert_cache_gb=a.expert_cache_gb,
                    compute_threads=a.compute_threads, trust_remote_code=a.trust_remote_code)


def _add_serve_parser(sub: Any) -> None:
    """``tiered serve``'s arguments."""
    g = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions)",
                       description="Serve MODEL_DIR over OpenAI's HTTP API (/v1/models, /v1/chat/completions, "
                       "/v1/completions; streaming with server-sent events), one generation at a time, its weights "
                       "streamed as `tiered generate` streams them. Needs the serve extra: pip install 'tiered[serve]'.",
                       epilog="example:\n  tiered serve ~/models/smollm2 --port 8000\n  curl localhost:8000/v1/chat/"
                       "completions -H 'Content-Type: application/json' \\\n    -d '{\"messages\": [{\"role\": \"user\", "
                       "\"content\": \"Hi\"}]}'", formatter_class=argparse.RawDescriptionHelpFormatter)
    g.add_argument("model_dir", metavar="MODEL_DIR",
                   help="local Hugging Face model directory: config.json, *.safetensors and a tokenizer")
    g.add_argument("--trust-remote-code", action="store_true", help=_TRUST_HELP)
    h = g.add_argument_group("server")
    h.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s; 0.0.0.0: all)")
    h.add_argument("--port", type=_number(int, low=0, high=65535), default=8000, help="port (default %(default)s)")
    h.add_argument("--model-name", default=None, metavar="NAME",
                   help="the model's name in the API (default: MODEL_DIR's directory name)")
    _add_streaming_args(g)
    g.set_defaults(fn=_cmd_serve, cli_parser=g)


def _cmd_serve(a: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import importlib.util

    missing = [m for m in ("fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        _fail(parser, f"tiered serve needs {' and '.join(missing)}: pip install 'tiered[serve]' "
                      "(or pip install fastapi uvicorn)")
    d = _check_model_dir(parser, a.model_dir)
    _read_config(parser, d)
    _check_shards(d)
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(d, trust_remote_code=a.trust_remote_code)
    except (OSError, ValueError) as e:
        _fail(parser, f"MODEL_DIR {d}: no tokenizer could be loaded ({e}); tiered serve needs one")
    model = _load_for_cli(a, parser, d)
    with model:
        if not callable(getattr(model, "generate", None)) or not model.can_generate():
            _fail(parser, f"MODEL_DIR {d}: {type(model).__name__} cannot generate text (not a causal LM)")
        from .serve import Server, run

        print(f"[tiered] serving {d} as {a.model_name or d.name!r} on http://{a.host}:{a.port}/v1 "
              f"({model._tiered.stats})", file=sys.stderr, flush=True)
        run(Server(model, tok, a.model_name or d.name), a.host, a.port)
    return 0


def _add_chat_parser(sub: Any) -> None:
    """``tiered chat``'s arguments."""
    g = sub.add_parser("chat", help="an interactive chat with a model's chat template and history",
                       description="Chat with MODEL_DIR in the terminal: each line you type is a user turn, put "
                       "through the tokenizer's chat template with the turns before it; the answer streams as it is "
                       "generated. Ctrl-C stops an answer (the chat goes on); Ctrl-D (end of input) or /bye leaves; "
                       "/reset forgets the history. With standard input not a terminal, each line is a turn.",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    g.add_argument("model_dir", metavar="MODEL_DIR",
                   help="local Hugging Face model directory with a tokenizer that has a chat template")
    g.add_argument("--trust-remote-code", action="store_true", help=_TRUST_HELP)
    g.add_argument("--system", default=None, metavar="TEXT", help="a system message before the first turn")
    _add_sampling_args(g, 256, "most tokens per answer")
    _add_streaming_args(g)
    g.set_defaults(fn=_cmd_chat, cli_parser=g)


def _cmd_chat(a: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import signal
    import threading

    given = [f for f, v in (("--temperature", a.temperature), ("--top-p", a.top_p), ("--top-k", a.top_k),
                            ("--seed", a.seed)) if v is not None]
    if given and not a.do_sample:
        _fail(parser, f"{', '.join(given)} {'apply' if len(given) > 1 else 'applies'} only when sampling: add "
                      "--do-sample (the default is greedy)")
    if a.gpu_gb is not None and a.device == "cpu":
        _fail(parser, "--gpu-gb is a GPU budget; it does not apply with --device cpu")
    d = _check_model_dir(parser, a.model_dir)
    cfg = _read_config(parser, d)
    limit = cfg.get("n_positions") if isinstance(cfg.get("n_positions"), int) else None  # learned positions: a limit
    probe = argparse.Namespace(ids=False, chat=True, prompt="Hi", system=a.system,
                               trust_remote_code=a.trust_remote_code)
    # the tokenizer and its chat template, then the shards' headers: all checked before the load
    tok, _ = _prompt_inputs(probe, parser, d, {}, before_load=lambda: _check_shards(d))
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList, TextStreamer

    model = _load_for_cli(a, parser, d)
    stop = threading.Event()

    class _Stop(StoppingCriteria):
        def __call__(self, input_ids: Any, scores: Any, **kw: Any) -> Any:
            return torch.full((input_ids.shape[0],), stop.is_set(), dtype=torch.bool, device=input_ids.device)

    tty = sys.stdin.isatty()
    history: list[dict[str, str]] = []
    with model:
        if not callable(getattr(model, "generate", None)) or not model.can_generate():
            _fail(parser, f"MODEL_DIR {d}: {type(model).__name__} cannot generate text (not a causal LM)")
        if tty:
            print(f"[tiered] chatting with {d.name}: Ctrl-C stops an answer, Ctrl-D or /bye leaves, /reset forgets",
                  file=sys.stderr)
        while True:
            try:
                line = input(">>> " if tty else "")
            except EOFError:
                if tty:
                    print(file=sys.stderr)
                return 0
            except KeyboardInterrupt:
                print("\n[tiered] Ctrl-D or /bye leaves", file=sys.stderr)
                continue
            text = line.strip()
            if not text:
                continue
            if text in ("/bye", "/exit", "/quit"):
                return 0
            if text == "/reset":
                history.clear()
                continue
            stop.clear()
            old = signal.signal(signal.SIGINT, lambda *_: stop.set())  # Ctrl-C from here on: this answer stops
            try:
                turn = [*history, {"role": "user", "content": text}]
                msgs = ([{"role": "system", "content": a.system}] if a.system is not None else []) + turn
                enc = tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=True, return_tensors="pt")
                ids = enc["input_ids"].to(model.device)
                if limit is not None and ids.shape[1] + a.max_new_tokens > limit:
                    print(f"[tiered] this turn ({ids.shape[1]} tokens with the history) plus --max-new-tokens "
                          f"({a.max_new_tokens}) is more than the {limit} positions this model has (config.json's "
                          "n_positions): not asked; /reset forgets the history", file=sys.stderr)
                    continue
                kw: dict[str, Any] = {"max_new_tokens": a.max_new_tokens, "do_sample": a.do_sample,
                                      "attention_mask": torch.ones_like(ids),
                                      "streamer": TextStreamer(tok, skip_prompt=True, skip_special_tokens=True),
                                      "stopping_criteria": StoppingCriteriaList([_Stop()])}
                for k in ("temperature", "top_p", "top_k"):
                    if getattr(a, k) is not None:
                        kw[k] = getattr(a, k)
                if a.seed is not None:
                    from transformers import set_seed

                    set_seed(a.seed)
                if not stop.is_set():  # (a Ctrl-C while the turn was prepared: no answer at all)
                    with torch.no_grad():
                        out = model.generate(ids, **kw)
                else:
                    out = None
            finally:
                signal.signal(signal.SIGINT, old)
            if out is None:
                print("[tiered] (answer stopped before it began)", file=sys.stderr)
                continue
            history[:] = turn
            answer = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
            if stop.is_set():
                print("\n[tiered] (answer stopped)", file=sys.stderr)
            sys.stdout.flush()
            history.append({"role": "assistant", "content": answer})


def _add_inspect_parser(sub: Any) -> None:
    """``tiered inspect``'s arguments."""
    i = sub.add_parser("inspect", help="shards, bytes, dtypes and layout from the headers; --units: units and the ring "
                       "size a model needs",
                       description=_INSPECT_DESCRIPTION, epilog=_INSPECT_EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    i.add_argument("model_dir", metavar="MODEL_DIR", help="local Hugging Face model directory (config.json + "
                   "*.safetensors)")
    i.add_argument("--dtype", type=_dtype, default=None, metavar="{bf16,fp16,fp32}",
                   help="plan for this compute dtype (default: config.json's; implies --units)")
    i.add_argument("--trust-remote-code", action="store_true", help=_TRUST_HELP + " (implies --units)")
    i.add_argument("--device", type=_device, default="cpu",
                   help="plan alignment for this device (cuda: 512 B, cpu: 64 B) and the runtime's share of host "
                   "memory beside the default ring (default %(default)s)")
    i.add_argument("--units", action="store_true",
                   help="also build the model on the meta device (imports torch and transformers: seconds) for its "
                   "units, the ring they need, the default host tier, MoE experts, decoded bytes and unused tensors "
                   "(implied by --all, --dtype, --trust-remote-code and the placement options)")
    i.add_argument("--all", action="store_true", help="list every unit (default: the first 5 and the last 4; implies "
                   "--units)")
    pg = i.add_argument_group("placement", "with any of --ring-gb, --gpu-gb, --host-gb, --io (each implies --units): "
                              "where tiered.load puts each unit with those options, and (--device cuda) the decode "
                              "time that predicts")
    pg.add_argument("--ring-gb", type=_number(float, low=0, low_open=True, unit=" GiB"), default=None, metavar="GiB",
                    help="host ring, GiB (default: tiered.load's, 4 or what this host's memory leaves)")
    pg.add_argument("--gpu-gb", type=_number(float, low=0, unit=" GiB"), default=None, metavar="GiB",
                    help="GPU budget, GiB (default: the free memory of this machine's GPU - 4 GiB)")
    pg.add_argument("--host-gb", type=_number(float, low=0, unit=" GiB"), default=None, metavar="GiB",
                    help="host tier, GiB (pinned on CUDA; default: tiered.load's, what this host's memory leaves "
                    "beside the ring when --ring-gb is not given either, else 0)")
    pg.add_argument("--prefetch", type=_number(int, low=0), default=2, metavar="N", help="units of lookahead (default 2)")
    pg.add_argument("--io", choices=["mmap", "pread", "direct", "auto"], default=None,
                    help="the reader backend, as tiered generate's --io (default auto, tiered.load's, resolved "
                    "against this machine's page cache). On the CPU only mmap lets streamed units compute "
                    "on the file mapping (no ring copy; auto: units larger than the ring and its page-cache tier); "
                    "on CUDA direct bypasses the page cache, so the warm prediction is the disk's")
    pg.add_argument("--disk-gbps", type=_number(float, low=0, low_open=True), default=None, metavar="GB/s",
                    help="cold disk read rate (default 1.5: O_DIRECT on the project's H200 machine)")
    pg.add_argument("--cache-gbps", type=_number(float, low=0, low_open=True), default=None, metavar="GB/s",
                    help="page cache -> pinned ring copy rate (default 30, measured there)")
    pg.add_argument("--h2d-gbps", type=_number(float, low=0, low_open=True), default=None, metavar="GB/s",
                    help="pinned host -> GPU copy rate (default 55, measured there)")
    i.add_argument("--json", action="store_true", help="print JSON (bytes exact; *_gb in GiB): the header report, "
                   "or with --units tiered.inspection.inspect_dir's")
    i.set_defaults(fn=_cmd_inspect, cli_parser=i)


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    from .errors import TieredError

    try:
        if getattr(a, "cli_parser", None) is not None:
            return a.fn(a, a.cli_parser)
        return a.fn(a)
    except TieredError as e:
        print(f"tiered: error: {flags_for_options(str(e))}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ntiered: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `tiered ... | head`: the reader left; say nothing more on the closed pipe
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a shell reports it


if __name__ == "__main__":
    sys.exit(main())
