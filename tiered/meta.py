"""The model, built on ``meta``: what ``from_pretrained`` would build, without weight memory.

Construction follows ``PreTrainedModel.from_pretrained`` (transformers 5): the class is built under
``torch.device("meta")`` with transformers' own init context (``local_torch_dtype`` for the dtype,
``meta_device_safe_creation_ops``); then non-persistent buffers (rotary ``inv_freq``, GPT-J's
``embed_positions``) are given real CPU memory and computed by ``initialize_weights()``, as
``_move_missing_keys_from_meta_to_device`` + ``_initialize_missing_keys`` do after loading;
finally the **dtype plan** (``_keep_in_fp32_modules`` under fp16, ``_keep_in_fp32_modules_strict``
under fp16/bf16, from ``model._get_dtype_plan``) turns the matching parameters' meta tensors to
float32, which is the dtype the plan then casts them to.

What is built is what ``from_pretrained(model_dir)`` builds with no arguments (transformers 5.17): the config
(:func:`read_config`), the class (:func:`model_class_for`: ``architectures[0]``, or the directory's own code
through ``auto_map`` with ``trust_remote_code``), the dtype (:func:`default_dtype`: ``dtype="auto"``) and the
generation config (:func:`load_generation_config`).

No process-wide state is patched by tiered. transformers' own init context sets the default dtype
and wraps ``torch.linspace`` for the duration of construction (as ``from_pretrained`` does); a
process-wide lock keeps two tiered loads in two threads from interleaving those.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .errors import ConfigError
from .format import check_model_dir, checkpoint_dtype

__all__ = ["build_meta_model", "meta_model_from_dir", "materialize_meta_buffers", "regenerate_param", "parse_dtype",
           "apply_dtype_plan",
           "DTYPE_NAMES", "read_config", "model_class_for", "default_dtype", "load_generation_config"]

_BUILD_LOCK = threading.Lock()

#: Names of floating-point dtypes, wherever a user names one (``tiered.load(dtype="bf16")``, ``tiered reshard
#: --dtype fp16``, ``inspect --dtype``) -> torch dtype. The one table: :func:`parse_dtype` reads it.
DTYPE_NAMES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
               "half": torch.float16, "fp32": torch.float32, "float32": torch.float32, "float": torch.float32}


def parse_dtype(d: torch.dtype | str | None) -> torch.dtype | None:
    """A floating-point torch dtype from a dtype or a name (``"bf16"``, ``"float16"``, ``"torch.float32"``...).

    Raises:
        ConfigError: not a floating-point dtype or an unknown name.
    """
    if d is None:
        return d
    if isinstance(d, torch.dtype):
        if not d.is_floating_point:
            raise ConfigError(f"dtype {d} is not a floating-point dtype; use torch.bfloat16, torch.float16 or torch.float32")
        return d
    name = str(d).removeprefix("torch.")
    if name not in DTYPE_NAMES:
        raise ConfigError(f"dtype {d!r} is not one of {sorted(DTYPE_NAMES)}")
    return DTYPE_NAMES[name]


def apply_dtype_plan(model: nn.Module, dtype: torch.dtype) -> list[str]:
    """Set to float32 the meta parameters and persistent buffers transformers keeps in float32 at
    ``dtype`` (its ``_get_dtype_plan`` matched with its own glob alternation, as in
    ``core_model_loading.convert_and_load_state_dict_in_model``). Returns the keys changed."""
    get_plan = getattr(model, "_get_dtype_plan", None)
    if not callable(get_plan):
        return []
    plan = get_plan(dtype)
    if not plan:
        return []
    from transformers.core_model_loading import build_glob_alternation

    alt, by_group, _ = build_glob_alternation(list(plan))
    changed = []
    for key, ref in model.state_dict(keep_vars=True).items():
        m = alt.search(key)
        if m is None or ref.device.type != "meta":
            continue
        want = plan[by_group[m.lastgroup]]
        if ref.dtype == want or not ref.is_floating_point():
            continue
        mod_name, _, attr = key.rpartition(".")
        mod = model.get_submodule(mod_name) if mod_name else model
        if attr in mod._parameters:
            mod._parameters[attr] = nn.Parameter(torch.empty_like(ref, dtype=want), requires_grad=ref.requires_grad)
        else:
            mod._buffers[attr] = torch.empty_like(ref, dtype=want)
        changed.append(key)
    return changed


def materialize_meta_buffers(module: nn.Module, skip: set[str] = frozenset()) -> None:  # type: ignore[assignment]
    """Give every buffer left on ``meta`` (except the keys in ``skip``: bound from the checkpoint) real
    CPU memory and compute it the way ``from_pretrained`` computes it (``initialize_weights``).

    Raises:
        ConfigError: a module that is not a ``transformers`` model has such a buffer (its value is unknowable).
    """
    missing = [
        (f"{name}.{b}" if name else b, m, b)
        for name, m in module.named_modules()
        for b, v in m._buffers.items()
        if v is not None and v.device.type == "meta" and (f"{name}.{b}" if name else b) not in skip
    ]
    if not missing:
        return
    init = getattr(module, "initialize_weights", None)
    if not callable(init):
        raise ConfigError(
            f"buffer {missing[0][0]!r} is on meta and not in the checkpoint; build the module with real buffers "
            "(e.g. construct it on the CPU, then move its parameters to meta) or save the buffer in the checkpoint"
        )
    for _, m, b in missing:
        m._buffers[b] = torch.empty_like(m._buffers[b], device="cpu")
        m._is_hf_initialized = False  # post_init marked it done; from_pretrained redoes it
    init()


def regenerate_param(model: nn.Module, key: str, owner: nn.Module, attr: str) -> bool:
    """A parameter the checkpoint does not hold, computed as ``from_pretrained`` computes it, when that is exact.

    ``from_pretrained`` initializes missing keys with the model's ``_init_weights``; a model lists the ones it never
    saves and always recomputes in ``_keys_to_ignore_on_save`` / ``_keys_to_ignore_on_load_missing`` (regexes, as
    transformers matches them): Marian's sinusoidal position tables, for example. For such a ``key`` (the parameter
    ``attr`` of ``owner``, on ``meta``), ``model._init_weights(owner)`` runs twice into real CPU memory of the
    parameter's dtype; when both runs give the same bits it is deterministic, and the parameter keeps that value
    (``requires_grad`` as ``from_pretrained`` sets it on a missing key: floating point; moved to the device with the
    buffers). Returns False, leaving it on ``meta``, for any
    other key, for a model without ``_init_weights``, or for a random init (the caller then reports it missing).
    """
    import re

    pats = [*(getattr(model, "_keys_to_ignore_on_save", None) or []),
            *(getattr(model, "_keys_to_ignore_on_load_missing", None) or [])]
    prefix = getattr(model, "base_model_prefix", "") or ""
    names = [key, f"{prefix}.{key}"] if prefix else [key]  # MarianModel: its class's patterns name "model.encoder..."
    init = getattr(model, "_init_weights", None)
    ph = owner._parameters.get(attr)
    if ph is None or not callable(init) or not any(re.search(p, k) for p in pats for k in names):
        return False
    runs = []
    for fill in (0.0, 1.0):  # two runs from two different starting contents: the init must write every element
        # requires_grad as from_pretrained gives a missing key (_load_parameter_into_model: floating point -> True)
        owner._parameters[attr] = nn.Parameter(torch.full(ph.shape, fill, dtype=ph.dtype),
                                               requires_grad=ph.dtype.is_floating_point)
        # the check run draws from a forked generator: the global one advances once, as from_pretrained's init does
        # (Marian's init draws normal_ before it writes the table: a seeded sample after load then matches stock's)
        with torch.random.fork_rng(devices=[]) if fill else contextlib.nullcontext():
            try:
                with torch.no_grad():
                    init(owner)
            except Exception:  # noqa: BLE001 - an init that cannot run here: reported missing, as before
                owner._parameters[attr] = ph
                return False
        runs.append(owner._parameters[attr].detach().clone())
    if not torch.equal(runs[0], runs[1]):
        owner._parameters[attr] = ph
        return False
    return True


def build_meta_model(cls: type, config: Any, dtype: torch.dtype) -> nn.Module:
    """``cls`` built from ``config`` as ``from_pretrained`` builds it at ``dtype``: parameters and
    persistent buffers on ``meta`` (float32 where the dtype plan says so), non-persistent buffers real
    and computed (under the default dtype, float32, as ``from_pretrained`` computes them). Eval mode."""
    from transformers import initialization as hf_init

    with _BUILD_LOCK, torch.device("meta"), hf_init.meta_device_safe_creation_ops():
        model = cls._from_config(config, dtype=dtype)
    apply_dtype_plan(model, dtype)
    nonpersistent = getattr(model, "named_non_persistent_buffers", None)
    if callable(nonpersistent):
        keys = {k for k, _ in nonpersistent()}
        persistent = {k for k, _ in model.named_buffers()} - keys
        materialize_meta_buffers(model, skip=persistent)
    return model.eval()


def meta_model_from_dir(
    model_dir: str | os.PathLike[str], *, dtype: torch.dtype | str | None = None, model_class: type | str | None = None,
    trust_remote_code: bool = False,
) -> nn.Module:
    """The ``transformers`` model ``model_dir/config.json`` describes, built on ``meta`` (no weight memory).

    The class is ``config.architectures[0]`` unless ``model_class`` (a class or its name) overrides it; with
    ``trust_remote_code``, a class of the directory's own code where ``config.json``'s ``auto_map`` names one
    (:func:`model_class_for`). The dtype is ``dtype``, else what ``from_pretrained``'s default takes
    (:func:`default_dtype`: the config's, else the checkpoint's).

    Raises:
        ShardNotFoundError: ``model_dir`` is missing, a file, or a Hub id (see :func:`~tiered.format.check_model_dir`).
        ConfigError: no ``config.json``, one ``transformers`` cannot read, an unknown architecture, or custom code
            (``auto_map``) without ``trust_remote_code=True``.
    """
    root = check_model_dir(model_dir)
    config = read_config(root, trust_remote_code=trust_remote_code)
    cls = model_class_for(root, config, model_class, trust_remote_code=trust_remote_code)
    dt = parse_dtype(dtype)
    return build_meta_model(cls, config, dt if dt is not None else default_dtype(root, config))


def _trust_advice(root: Path) -> str | None:
    """What to do about ``config.json``'s ``auto_map`` (custom code in the directory), or None without one."""
    try:
        doc = json.loads((root / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    auto_map = doc.get("auto_map") if isinstance(doc, dict) else None
    if not auto_map:
        return None
    files = sorted({str(v).split("--")[-1].rpartition(".")[0] + ".py" for v in auto_map.values() if isinstance(v, str)})
    return (f"{root / 'config.json'}: the model's code is the directory's own ({', '.join(files)}: auto_map), not "
            f"transformers'; it runs only if you trust it: read it, then pass tiered.load({str(root)!r}, "
            "trust_remote_code=True) (the tiered command: --trust-remote-code)")


def read_config(root: Path, *, trust_remote_code: bool = False) -> Any:
    """``AutoConfig.from_pretrained(root, trust_remote_code=...)``, its failures as :class:`ConfigError`: without
    ``trust_remote_code`` a config of custom code (``auto_map``) is refused with the advice that works."""
    import transformers

    if not (root / "config.json").is_file():
        raise ConfigError(f"{root}: no config.json; pass a Hugging Face model directory")
    try:
        return transformers.AutoConfig.from_pretrained(root, trust_remote_code=trust_remote_code)
    except (ValueError, KeyError, OSError, ImportError) as e:
        advice = None if trust_remote_code else _trust_advice(root)
        if advice is not None:
            raise ConfigError(advice) from e
        raise ConfigError(f"{root / 'config.json'}: transformers cannot read it: {e}") from e


def _auto_map_entry(auto_map: dict[str, Any], name: str | None, explicit: bool) -> str | None:
    """The ``auto_map`` class reference for ``name``: an auto class name (``"AutoModelForCausalLM"``), or the model
    class ``config.architectures[0]`` names; else (no ``model_class`` given) AutoModelForCausalLM's, then
    AutoModel's."""
    models = {k: v for k, v in auto_map.items() if k.startswith("AutoModel") and isinstance(v, str)}
    if name in models:
        return models[name]
    for ref in models.values():
        if name is not None and ref.split("--")[-1].rpartition(".")[2] == name:
            return ref
    if explicit:
        return None
    return models.get("AutoModelForCausalLM") or models.get("AutoModel")


def _remote_class(root: Path, ref: str) -> type:
    """Class ``ref`` (``"modeling_x.XForCausalLM"``) of ``root``'s own code, imported as ``AutoModel*`` imports it
    (``dynamic_module_utils.get_class_from_dynamic_module``, then ``add_generation_mixin_to_remote_model``)."""
    from transformers.dynamic_module_utils import get_class_from_dynamic_module
    from transformers.models.auto.auto_factory import add_generation_mixin_to_remote_model

    try:
        cls = get_class_from_dynamic_module(ref, str(root), local_files_only=True)
    except (OSError, ImportError, AttributeError, ValueError) as e:
        where = f"repository {ref.split('--')[0]!r} on the Hub: download its code into {root}" if "--" in ref else \
            f"{root}: check that the file is there and imports"
        raise ConfigError(f"{root / 'config.json'}: auto_map's {ref!r} cannot be imported ({e}); it is in {where}") from e
    return add_generation_mixin_to_remote_model(cls)


def model_class_for(root: Path, config: Any, model_class: type | str | None, *, trust_remote_code: bool = False) -> type:
    """The class ``from_pretrained`` builds: ``model_class`` (a class, a ``transformers`` class name, or with
    ``trust_remote_code`` an ``auto_map`` key or class name), else ``config.architectures[0]``.

    With ``trust_remote_code`` and an ``auto_map`` in ``config.json``, the class is the directory's own code, as
    ``AutoModelForCausalLM.from_pretrained(..., trust_remote_code=True)`` takes it (transformers 5.17
    ``models/auto/auto_factory.py``: ``config.auto_map[<auto class>]`` through ``get_class_from_dynamic_module``):
    the entry whose class ``architectures[0]`` names (the class that saved the checkpoint), else
    ``AutoModelForCausalLM``'s, else ``AutoModel``'s. Without an entry, ``transformers``' own class.

    Raises:
        ConfigError: no architecture, one ``transformers`` does not have, custom code without ``trust_remote_code``,
            or custom code that does not import.
    """
    import transformers

    if model_class is not None and not isinstance(model_class, str):
        return model_class
    archs = getattr(config, "architectures", None) or []
    name = model_class if model_class is not None else (archs[0] if archs else None)
    auto_map = getattr(config, "auto_map", None) or {}
    if trust_remote_code and isinstance(auto_map, dict):
        ref = _auto_map_entry(auto_map, name, explicit=model_class is not None)
        if ref is not None:
            return _remote_class(root, ref)
    if name is None:
        raise ConfigError(f"{root / 'config.json'} has no 'architectures'; pass model_class=...")
    cls = getattr(transformers, name, None)
    if cls is None:
        advice = None if trust_remote_code else _trust_advice(root)
        raise ConfigError(advice or f"{root / 'config.json'}: architecture {name!r} is not in transformers "
                          f"{transformers.__version__}; pass model_class=...")
    return cls


def default_dtype(root: Path, config: Any) -> torch.dtype:
    """The dtype ``from_pretrained(root)`` builds the model at when given none: its default ``dtype="auto"``
    (transformers 5.17 ``modeling_utils.PreTrainedModel.from_pretrained`` and ``_get_dtype``): the top-level
    config's ``dtype`` (``torch_dtype``) if set — a sub-config's (``text_config.dtype``) is not read — else the
    checkpoint's (:func:`tiered.format.checkpoint_dtype`: the index's metadata, else the first floating-point tensor
    of the first weight file).

    Raises:
        ConfigError: not a floating-point dtype. And what :func:`~tiered.format.checkpoint_dtype` raises.
    """
    dt = getattr(config, "dtype", None)
    if dt is not None:
        return parse_dtype(dt)  # type: ignore[return-value]
    return checkpoint_dtype(root)


def load_generation_config(model: nn.Module, root: Path) -> None:
    """Set ``model.generation_config`` as ``from_pretrained(root)`` sets it (transformers 5.17
    ``GenerationMixin.adjust_generation_fn``), for a model that can generate: ``generation_config.json``, else
    (none, or one ``GenerationConfig.from_pretrained`` cannot read) the generation parameters of ``config.json``
    (``GenerationConfig.from_pretrained(root, config_file_name="config.json", _from_model_config=True)``: legacy
    ``max_length``, ``repetition_penalty``... kept). An unreadable ``generation_config.json`` is warned about.

    Raises:
        ConfigError: a generation config ``transformers`` refuses (a bad value), naming its file.
    """
    can_generate = getattr(model, "can_generate", None)
    if not callable(can_generate) or not can_generate():
        return
    from transformers import GenerationConfig

    gen = root / "generation_config.json"
    where = gen
    try:
        try:
            model.generation_config = GenerationConfig.from_pretrained(root)
            return
        except OSError as e:
            if gen.exists():
                warnings.warn(f"{gen}: transformers cannot read it ({e}); the generation parameters of config.json "
                              "are used instead, as from_pretrained uses them; fix or delete the file",
                              UserWarning, stacklevel=3)
        where = root / "config.json"
        model.generation_config = GenerationConfig.from_pretrained(root, config_file_name="config.json",
                                                                   _from_model_config=True)
    except (ValueError, TypeError, OSError) as e:
        raise ConfigError(f"{where}: transformers refuses its generation parameters: {e}; fix them") from e
