"""What model code sees of a streamed tensor between passes: a :class:`Placeholder` that looks like stock's.

Between two passes a streamed unit's parameters and persistent buffers hold no memory. Stock ``transformers``
code reads them anyway outside their module's forward: Llama-4's text model runs
``embed_tokens(input_ids.to(self.embed_tokens.weight.device))``; Idefics3 calls ``.to(self.device)`` on its inner
model, whose ``device`` (``PreTrainedModel.device``) is its first parameter's; ``generate`` asks ``model.dtype``.
A ``meta`` tensor answers those with ``meta`` and makes the next copy fail — or, worse, yields garbage silently.

So each streamed tensor is replaced, at load, by a :class:`Placeholder`: a tensor subclass without storage
(``torch.Tensor._make_wrapper_subclass``) whose ``device``, ``dtype``, ``shape``, ``requires_grad`` and
``isinstance(p, nn.Parameter)`` are what stock's tensor has. Metadata and view operations work (a view of a
placeholder is a placeholder), and so do ``weight.new_zeros(...)`` / ``torch.zeros_like(weight)``, which read no
value (a real tensor, as stock's); an operation that reads or writes its values raises :class:`StreamedTensorError`
naming the tensor, the module whose forward binds it, and what to do — never garbage, never a silent no-op
(an in-place edit such as a LoRA merge's ``w.add_(delta)`` would be lost at the next pass).

The streamer swaps the real tensor in for the length of the unit's forward (:mod:`tiered.binding`) and the
placeholder back afterwards; the bound tensor takes the placeholder's ``requires_grad`` (stock's parameters
require grad; ``model.requires_grad_(False)`` is followed at the next pass).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from .errors import StreamedTensorError

__all__ = ["Placeholder", "StreamedTensorError", "make_placeholder", "is_placeholder", "install_placeholders"]


def _advice(func: Any) -> str:
    name = func.name() if hasattr(func, "name") else str(func)
    op = name.split("::")[-1].split(".")[0]
    if op in ("_to_copy", "to", "_copy_from", "_copy_from_and_resize"):
        return ("tiered binds the checkpoint's bytes at the dtype and device the model was loaded with: to run in "
                "another dtype or on another device, load it again with tiered.load(..., dtype=..., device=...)")
    if op.endswith("_") or op in ("copy_", "set_", "resize_"):
        return ("an in-place change would be lost at the next pass (a LoRA merge, a weight edit): apply it to the "
                "checkpoint files and load those, or run the unit resident (a larger ring_gb / gpu_gb)")
    return ("its values exist only while that module runs: read them inside its forward, open the checkpoint with "
            "safetensors.safe_open, or load with a ring_gb / gpu_gb large enough to keep the unit resident")


class Placeholder(torch.Tensor):
    """A streamed tensor between passes: stock's metadata, no storage (see the module docstring).

    Attributes:
        tiered_key: the tensor's ``state_dict`` key (``model.layers.3.mlp.up_proj.weight``).
        tiered_unit: the module whose forward binds it (its unit's name).
    """

    tiered_key: str
    tiered_unit: str

    @staticmethod
    def __new__(cls, shape: torch.Size | tuple[int, ...], dtype: torch.dtype, device: torch.device, key: str,
                unit: str, requires_grad: bool = False) -> Placeholder:
        t = torch.Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=dtype, device=device,
                                                requires_grad=requires_grad)
        t.tiered_key, t.tiered_unit = key, unit
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl  # straight to __torch_dispatch__

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return (f"Placeholder({self.tiered_key!r}, shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device}, "
                f"streamed by tiered: bound while {self.tiered_unit!r} runs)")

    def _refuse(self, what: str) -> StreamedTensorError:
        return StreamedTensorError(f"tiered: {what} of {self.tiered_key!r}, a streamed tensor, outside the forward of "
                                   f"{self.tiered_unit!r}, which binds it; {_advice('read')}")

    def tolist(self) -> Any:
        raise self._refuse(".tolist()")

    def numpy(self, *args: Any, **kwargs: Any) -> Any:
        raise self._refuse(".numpy()")

    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        raise self._refuse("numpy.asarray()")

    def __reduce_ex__(self, proto: Any) -> Any:
        raise StreamedTensorError(f"tiered: {self.tiered_key!r} is streamed and cannot be pickled or saved; "
                                  + _advice("save"))

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        first = next((a for a in (*args, *kwargs.values()) if isinstance(a, Placeholder)), None)
        assert first is not None
        op = func.name().split("::")[-1].split(".")[0]
        if op in _NEW or op in _LIKE:
            # a new tensor shaped, typed and placed like it (weight.new_zeros(...), torch.zeros_like(weight)): reads
            # no value, so it is made as stock makes it, from a real stand-in of the placeholder's metadata
            def real(x: Any) -> Any:
                if not isinstance(x, Placeholder):
                    return x
                if op in _NEW:
                    return torch.empty(0, dtype=x.dtype, device=x.device)
                return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)

            return func(*tree_map(real, args), **tree_map(real, kwargs))
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default) or _is_view(func):
            # metadata only: compute the result's shape on meta and hand back a placeholder of it
            out = func(*tree_map(_to_meta, args), **tree_map(_to_meta, kwargs))
            return tree_map(lambda o: Placeholder(o.shape, o.dtype, first.device, first.tiered_key, first.tiered_unit)
                            if isinstance(o, torch.Tensor) else o, out)
        raise StreamedTensorError(
            f"tiered: {func} on {first.tiered_key!r}, a streamed tensor, outside the forward of {first.tiered_unit!r}, "
            f"which binds it; {_advice(func)}")


#: Operations that make a new tensor from another's metadata only (``Tensor.new_*``, ``torch.*_like``).
_NEW = {"new_empty", "new_empty_strided", "new_zeros", "new_ones", "new_full"}
_LIKE = {"empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like", "randint_like"}


def _is_view(func: Any) -> bool:
    return any(a.alias_info is not None and not a.alias_info.is_write for a in func._schema.returns)


def _to_meta(x: Any) -> Any:
    if isinstance(x, Placeholder):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    return x


def is_placeholder(t: object) -> bool:
    """True for a :class:`Placeholder` (also one wrapped as an ``nn.Parameter``) or a ``meta`` tensor."""
    return isinstance(t, Placeholder) or (isinstance(t, torch.Tensor) and t.device.type == "meta")


def make_placeholder(ref: torch.Tensor, device: torch.device, key: str, unit: str, *, param: bool,
                     loaded_flags: bool = False) -> torch.Tensor:
    """A :class:`Placeholder` for ``ref`` (the ``meta`` tensor the model was built with: its shape, dtype and
    ``requires_grad``) on ``device``; an ``nn.Parameter`` (``isinstance`` holds) when ``param``. ``loaded_flags``:
    ``requires_grad`` as ``from_pretrained`` sets it on every parameter it loads (floating point -> True:
    ``transformers.core_model_loading.set_param_for_module``), not the module's own (Marian's frozen positions)."""
    ph = Placeholder(ref.shape, ref.dtype, device, key, unit)
    if param:
        return nn.Parameter(ph, requires_grad=ref.dtype.is_floating_point if loaded_flags else ref.requires_grad)
    return ph


def install_placeholders(module: nn.Module, units: list, specs: list, device: torch.device, *,
                         loaded_flags: bool = False) -> int:
    """Replace every tensor that ``units`` (:class:`~tiered.plan.Unit`) and ``specs`` (routed experts,
    :class:`~tiered.expert_spec.ExpertSpec`) bind — on ``meta``, or real where the model's own code allocated it
    outside the meta device context — with a :class:`Placeholder` on ``device``, wherever in ``module`` it is
    referenced (a tied parameter stays one object). Run before the streamer records its placeholders. Returns
    how many tensors were replaced. ``loaded_flags``: a ``transformers`` model's (:func:`make_placeholder`)."""
    owner: dict[int, tuple[str, str]] = {}
    for u in units:
        for t in u.targets:
            owner.setdefault(id(_current(t)), (t.key, u.name))
    for sp in specs:
        for q in sp.parts:
            owner.setdefault(id(_current(q.target)), (q.target.key, sp.name))
    done: dict[int, torch.Tensor] = {}
    for _, m in module.named_modules(remove_duplicate=True):
        for store, param in ((m._parameters, True), (m._buffers, False)):
            for attr, cur in list(store.items()):
                # a target the model built with real memory (DiffLlama's lambda_q1..k2: torch.normal(size=...) is
                # not a factory the meta device context catches) takes a placeholder too: the checkpoint fills it
                if cur is None or id(cur) not in owner or isinstance(cur, Placeholder):
                    continue
                if id(cur) not in done:
                    key, unit = owner[id(cur)]
                    done[id(cur)] = make_placeholder(cur, device, key, unit, param=param, loaded_flags=loaded_flags)
                store[attr] = done[id(cur)]
    return len(done)


def _current(t: Any) -> torch.Tensor | None:
    return (t.module._parameters if t.is_param else t.module._buffers).get(t.attr)
