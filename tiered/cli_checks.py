"""The ``tiered`` command's argument checks: option ranges, ``--device``'s form, the model directory and its
``config.json``, the tokenizer and chat template, the prompt. Every one runs before any weight is read; nothing here
imports torch or transformers at import time (the tokenizer checks import transformers when they run).
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path
from typing import Any, NoReturn

from .inspection import flags_for_options

#: Names ``tiered.load`` accepts for ``dtype`` (tiered.meta.parse_dtype, which needs torch to import).
_DTYPES = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "half": "fp16",
           "fp32": "fp32", "float32": "fp32", "float": "fp32"}
_DEVICE = re.compile(r"cpu|cuda(:\d+)?")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # as tiered.format.check_model_dir recognises one
#: Files one of which a tokenizer needs (AutoTokenizer reads tokenizer_config.json or builds from the others).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                    "spiece.model", "sentencepiece.bpe.model")
#: Where a chat template can be: tokenizer_config.json's "chat_template", or a file of its own.
_CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


def _number(kind: type, *, low: float | None = None, low_open: bool = False, high: float | None = None,
            unit: str = "") -> Any:
    """An argparse ``type`` parsing ``kind`` within [low, high] (``low_open``: low excluded); argparse names the flag."""
    def parse(text: str) -> int | float:
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if not math.isfinite(v):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
        if low is not None and (v <= low if low_open else v < low):
            raise argparse.ArgumentTypeError(f"must be {'>' if low_open else '>='} {kind(low)}{unit}, got {text}")
        if high is not None and v > high:
            raise argparse.ArgumentTypeError(f"must be <= {kind(high)}{unit}, got {text}")
        return v

    return parse


def _device(text: str) -> str:
    if not _DEVICE.fullmatch(text.strip()):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device: use cpu, cuda or cuda:N")
    return text.strip()


def _dtype(text: str) -> str:
    name = text.strip().lower().removeprefix("torch.")
    if name not in _DTYPES:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of bf16, fp16, fp32 (or bfloat16, float16, float32)")
    return _DTYPES[name]


def _check_model_dir(parser: argparse.ArgumentParser, path: str) -> Path:
    """MODEL_DIR is a directory with a config.json, else a usage error saying what it is instead (the
    checks of tiered.format.check_model_dir, without importing torch)."""
    d = Path(path)
    if not d.is_dir():
        if d.exists():
            hint = (f" (for a lone weight file, put it in a directory with its config.json: pass {str(d.parent)!r})"
                    if d.suffix in (".safetensors", ".bin", ".pt") else "")
            if d.suffix == ".gguf":
                hint = (f" (a GGUF file: convert it once into a model directory, then pass that: tiered reshard {d} "
                        f"{d.with_suffix('')}-tiered --dtype bf16)")
            parser.error(f"MODEL_DIR {d} is a file, not a directory; pass the directory that holds config.json and "
                         f"the weights{hint}")
        if _HUB_ID.fullmatch(path) and not path.startswith((".", "~")):
            parser.error(f"MODEL_DIR {path!r} is not a local directory; it looks like a Hugging Face Hub id. tiered "
                         "reads local directories and downloads nothing: fetch it first, e.g. "
                         f"huggingface_hub.snapshot_download({path!r}), and pass the directory it returns")
        parser.error(f"MODEL_DIR {d}: no such directory; pass a local Hugging Face model directory")
    if not (d / "config.json").is_file():
        parser.error(f"MODEL_DIR {d} has no config.json; pass a Hugging Face model directory "
                     "(config.json + *.safetensors)")
    return d




class _option_errors_as_usage:
    """Inside: a ConfigError / RingTooSmallError / HostMemoryError that names an option becomes a usage error
    (exit 2) in flag names; any other TieredError is re-raised with option names translated."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser

    def __enter__(self) -> None:
        return None

    def __exit__(self, et: type | None, e: BaseException | None, tb: object) -> bool:
        from .errors import ConfigError, HostMemoryError, RingTooSmallError, TieredError

        if e is None or not isinstance(e, TieredError):
            return False
        msg = str(e)
        said = flags_for_options(msg)
        named = getattr(e, "option", None) is not None or said != msg  # Options' errors carry the field's name
        if named and isinstance(e, (ConfigError, RingTooSmallError, HostMemoryError)):
            self.parser.error(said)
        return False  # main() prints it, in flag names too


def _read_config(parser: argparse.ArgumentParser, d: Path) -> dict:
    try:
        cfg = json.loads((d / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        parser.error(f"MODEL_DIR {d}: config.json cannot be read as JSON ({e})")
    if not isinstance(cfg, dict):
        parser.error(f"MODEL_DIR {d}: config.json is not a JSON object")
    return cfg


def _check_shards(d: Path) -> None:
    """Every weight file ``tiered.load`` would open (:func:`tiered.checkpoint.weight_files`) has a valid safetensors
    header and all its data (:func:`tiered.header.check_shard`) — torch-free, so a bad or truncated shard is reported
    before torch and transformers load (the same error the load would raise, exit 1).

    Raises:
        ShardNotFoundError / HeaderError / TruncatedShardError / ConfigError: as ``tiered.load``.
    """
    import warnings

    from .checkpoint import weight_files
    from .header import check_shard

    with warnings.catch_warnings():  # the load says it again, once
        warnings.simplefilter("ignore")
        paths = weight_files(d).paths
    for p in paths:
        check_shard(p)


def _vocab_size(cfg: dict) -> int | None:
    for c in (cfg, cfg.get("text_config") or {}, cfg.get("decoder") or {}):
        v = c.get("vocab_size") if isinstance(c, dict) else None
        if isinstance(v, int) and v > 0:
            return v
    return None


def _check_length(a: argparse.Namespace, parser: argparse.ArgumentParser, cfg: dict, n_prompt: int) -> None:
    """Models with a learned table of absolute positions (GPT-2's ``n_positions``) cannot go past it: the
    embedding lookup fails. (RoPE models can, so ``max_position_embeddings`` alone is not a limit.)"""
    limit = cfg.get("n_positions") if isinstance(cfg.get("n_positions"), int) else None
    if limit is not None and n_prompt + a.max_new_tokens > limit:
        _fail(parser, f"--prompt ({n_prompt} tokens) plus --max-new-tokens ({a.max_new_tokens}) is more than the "
                      f"{limit} positions this model has (config.json's n_positions); shorten the prompt or lower "
                      "--max-new-tokens")


def _has_chat_template_file(d: Path) -> bool:
    if any((d / f).is_file() for f in _CHAT_TEMPLATE_FILES):
        return True
    try:
        return bool(json.loads((d / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return False


def _fail(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    parser.error(message)


def _check_generate_args(a: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Cross-option checks (argparse has checked each value's form and range)."""
    if not a.do_sample:
        given = [f for f, v in (("--temperature", a.temperature), ("--top-p", a.top_p), ("--top-k", a.top_k),
                                ("--seed", a.seed)) if v is not None]
        if given:
            verb = "apply" if len(given) > 1 else "applies"
            _fail(parser, f"{', '.join(given)} {verb} only when sampling: add --do-sample (the default is greedy)")
    if a.chat and a.ids:
        _fail(parser, "--chat formats text with the tokenizer's chat template; it cannot be used with --ids")
    if getattr(a, "system", None) is not None and not a.chat:
        _fail(parser, "--system is the system message of a chat: add --chat (it needs the tokenizer's chat template)")
    if a.gpu_gb is not None and a.device == "cpu":
        _fail(parser, "--gpu-gb is a GPU budget; it does not apply with --device cpu")


def _prompt_inputs(a: argparse.Namespace, parser: argparse.ArgumentParser, d: Path, cfg: dict,
                   before_load: Any = None) -> tuple[Any, Any]:
    """(tokenizer or None, {"input_ids": [[...]], ...} as lists or tensors) — everything checked, no weight read.
    ``before_load()`` runs, for a text prompt, after the checks that need no import and before transformers loads the
    tokenizer (the shards' headers: :func:`_check_shards`): the usage errors found without the tokenizer come first,
    a bad shard before the seconds the imports take. (``--ids``: the caller checks the shards after the prompt.)"""
    if a.ids:
        try:
            ids = [int(x) for x in a.prompt.replace(",", " ").split()]
        except ValueError:
            _fail(parser, f"--ids: --prompt must be token ids such as '1 2 3', got {a.prompt!r}")
        vocab = _vocab_size(cfg)
        if not ids:
            _fail(parser, "--ids: --prompt has no token ids; pass some, e.g. --prompt '1 2 3'")
        bad = [i for i in ids if i < 0 or (vocab is not None and i >= vocab)]
        if bad:
            want = f"in [0, {vocab}) (config.json's vocab_size)" if vocab is not None else ">= 0"
            _fail(parser, f"--ids: token ids must be {want}, got {bad[:5]}")
        return None, {"input_ids": [ids]}
    if not any((d / f).is_file() for f in _TOKENIZER_FILES):
        _fail(parser, f"MODEL_DIR {d} has no tokenizer (no {', '.join(_TOKENIZER_FILES[:2])}), so --prompt cannot be "
                      "text; pass --ids with token ids, e.g. --ids --prompt '1 2 3'")
    if a.chat and not _has_chat_template_file(d):
        _fail(parser, f"--chat: the tokenizer in {d} has no chat template (no chat_template in tokenizer_config.json, "
                      "no chat_template.jinja); drop --chat to continue the prompt as plain text")
    if before_load is not None:
        before_load()
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(d, trust_remote_code=bool(getattr(a, "trust_remote_code", False)))
    except Exception as e:  # noqa: BLE001 - any failure to build it is the same advice
        _fail(parser, f"MODEL_DIR {d}: its tokenizer does not load ({type(e).__name__}: {e}); pass --ids with token "
                      "ids instead, e.g. --ids --prompt '1 2 3'")
    if a.chat:
        if not getattr(tok, "chat_template", None):
            _fail(parser, f"--chat: the tokenizer in {d} has no chat template; drop --chat to continue the prompt as "
                          "plain text")
        try:
            system = getattr(a, "system", None)
            msgs = ([{"role": "system", "content": system}] if system is not None else []) + [
                {"role": "user", "content": a.prompt}]
            enc = tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=True)
        except Exception as e:  # noqa: BLE001 - a template that fails to render is the template's problem
            _fail(parser, f"--chat: the chat template of {d} fails on this prompt ({type(e).__name__}: {e})")
    else:
        enc = tok(a.prompt)
    enc = {k: [list(v)] for k, v in dict(enc).items() if k in ("input_ids", "attention_mask")}
    if not enc.get("input_ids") or not enc["input_ids"][0]:
        _fail(parser, f"--prompt {a.prompt!r} encodes to no tokens; pass some text")
    return tok, enc


