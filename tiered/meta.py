"""The model, built on ``meta``: what ``from_pretrained`` would build, without weight memory.

Construction follows ``PreTrainedModel.from_pretrained`` (transformers 5): the class is built under
``torch.device("meta")`` with transformers' own init context (``local_torch_dtype`` for the dtype,
``meta_device_safe_creation_ops``); then non-persistent buffers (rotary ``inv_freq``, GPT-J's
``embed_positions``) are given real CPU memory and computed by ``initialize_weights()``, as
``_move_missing_keys_from_meta_to_device`` + ``_initialize_missing_keys`` do after loading;
finally the **dtype plan** (``_keep_in_fp32_modules`` under fp16, ``_keep_in_fp32_modules_strict``
under fp16/bf16, from ``model._get_dtype_plan``) turns the matching parameters' meta tensors to
float32, which is the dtype the plan then casts them to.

No process-wide state is patched by tiered. transformers' own init context sets the default dtype
and wraps ``torch.linspace`` for the duration of construction (as ``from_pretrained`` does); a
process-wide lock keeps two tiered loads in two threads from interleaving those.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import torch
from torch import nn

from .errors import ConfigError
from .format import check_model_dir

__all__ = ["build_meta_model", "meta_model_from_dir", "materialize_meta_buffers", "parse_dtype", "apply_dtype_plan",
           "DTYPE_NAMES"]

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
    model_dir: str | os.PathLike[str], *, dtype: torch.dtype | str | None = None, model_class: type | str | None = None
) -> nn.Module:
    """The ``transformers`` model ``model_dir/config.json`` describes, built on ``meta`` (no weight memory).

    The class is ``config.architectures[0]`` unless ``model_class`` (a class or its name) overrides it;
    the dtype is ``dtype`` or else the config's (as ``from_pretrained`` picks it), else float32.

    Raises:
        ShardNotFoundError: ``model_dir`` is missing, a file, or a Hub id (see :func:`~tiered.format.check_model_dir`).
        ConfigError: no ``config.json``, one ``transformers`` cannot read, or an unknown architecture.
    """
    import transformers

    root = check_model_dir(model_dir)
    if not (root / "config.json").is_file():
        raise ConfigError(f"{root}: no config.json; pass a Hugging Face model directory")
    try:
        config = transformers.AutoConfig.from_pretrained(root)
    except (ValueError, KeyError, OSError) as e:
        raise ConfigError(f"{root / 'config.json'}: transformers cannot read it: {e}") from e
    cls = model_class
    if cls is None:
        archs = getattr(config, "architectures", None) or []
        if not archs:
            raise ConfigError(f"{root / 'config.json'} has no 'architectures'; pass model_class=...")
        cls = archs[0]
    if isinstance(cls, str):
        name = cls
        cls = getattr(transformers, name, None)
        if cls is None:
            raise ConfigError(f"{root / 'config.json'}: architecture {name!r} is not in transformers "
                              f"{transformers.__version__}; pass model_class=...")
    dt = parse_dtype(dtype)
    if dt is None:
        dt = parse_dtype(getattr(config, "dtype", None) or torch.float32)
    return build_meta_model(cls, config, dt)
