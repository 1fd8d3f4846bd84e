"""``actnn_zoo.compile``: one ``torch.compile`` graph that saves its activations compressed.

A plain ``torch.compile`` of a converted model has no break either: its Q-layers save through
their traced forms (:meth:`~actnn_zoo.nn._base.QModule.graph_saves`), but nothing else is
compressed (attention, the loss, layers without a traced form). This path also traces conv
and linear as their torch forwards (:func:`_compile.inline_compiling`) and puts the
compression of every saved tensor into the graph itself: AOTAutograd inlines saved-tensor
hooks given as ``torch.fx.GraphModule`` s into the forward graph's end (pack) and the backward
graph's start (unpack). It applies them to the tensors the graph saves that it also frees -- intermediates,
never the model's inputs, parameters or buffers. What each saved tensor becomes:

* floating point with at least ``min_numel`` values (default 1024), and not a
  statistic (a secondary output of a multi-output op: a norm's mean and inverse deviation,
  attention's log-sum-exp, which the backward reads exactly): ``actnn_zoo::quantize_uniform``
  codes at ``bits`` per value, stochastic rounding seeded from torch's CPU generator by the
  operator itself (new every call), in the tensor's memory order, so the backward gets back
  its strides (a view with gaps, such as q, k or v sliced from one projection, is copied
  first and comes back as a copy with the same strides);
* bool with at least ``min_numel`` values (dropout's mask): 1 bit per value;
* anything else (indices, statistics, small or sparse tensors, tensors made from no
  floating input, such as an additive attention mask of zeros and ``finfo.min``, whose zeros
  rounding would move, and casts of a graph input, such as autocast's bfloat16 copy of a
  weight, which the input gradient reads): kept as it is.

The layers with a traced form other than conv and linear keep their own saving: ReLU a mask
packed by the operator (:class:`~actnn_zoo.functional.activation.BoolMaskReLU`; its rounded
output would move values across zero), BatchNorm and LayerNorm codes of their normalized input
(:class:`~actnn_zoo.functional.norm.NormalizedBatchNorm`, ``NormalizedLayerNorm``), MaxPool2d
each maximum's window position (:class:`~actnn_zoo.functional.pool.WindowCodeMaxPool2d`),
smooth activations codes of their derivative
(:class:`~actnn_zoo.functional.activation.TracedDerivativeActivation`), dropout its packed
mask. What this path does not do: the
precision strategies' per-layer and per-sample widths (every tensor gets ``bits``; their
hooks step aside while it traces) and tier 2's routing (attention and the loss are whatever the
traced ops save) (docs/design.md, "torch.compile").
"""
from __future__ import annotations

import functools
from typing import Any, Dict, Optional, Tuple

import torch
from torch import Tensor, nn

from ._compile import INLINE_ATTR, InlineSwitch, inline_switch
from ._session import dense_order, inverse_order
from ._torch_private import (compiled_saved_from_float_input, compiled_saved_hooks_supported,
                             compiled_saved_input_cast, compiled_saved_output_index,
                             tracing_compiled_saves)
from .nn._base import QModule
from .quant import check_bits, check_group_size
from .quant import ops

__all__ = ["compile", "CompressedCompile"]

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_RAW, _MASK, _CODES = 0, 1, 2


def _statistic(x: Tensor) -> bool:
    """Whether a saved float ``x`` is a statistic a backward reads exactly rather than an
    activation: a secondary output of a multi-output op (a norm's mean and inverse deviation,
    attention's log-sum-exp), as the graph tells, or shaped like one (1-d, or a trailing
    size-1 dim: per-channel and per-row statistics)."""
    index = compiled_saved_output_index()
    return (index is not None and index != 0) or x.dim() < 2 or x.shape[-1] == 1


def pack(x: Tensor, bits: int, group_size: int, min_numel: int) -> tuple:
    """What the forward graph keeps of a saved tensor ``x`` (see the module docstring).

    Only while AOTAutograd traces it into a graph. Called eagerly -- dynamo ran the model
    without a graph (its recompile limit reached, a frame it skips) -- it keeps ``x`` as it
    is: the Q-layers then run their own Functions, which compress, and every other save
    (parameters included) reaches this hook with none of the graph's facts about it."""
    if not tracing_compiled_saves() or x.numel() < min_numel \
            or x.layout != torch.strided \
            or not (x.dtype == torch.bool or x.dtype in _FLOATS) \
            or (x.dtype != torch.bool and _statistic(x)) \
            or compiled_saved_from_float_input() is False or compiled_saved_input_cast():
        return (_RAW, x)
    perm = dense_order(x)
    strides = None
    if perm is None:  # a view with gaps (a slice of a fused projection): its values, in order
        strides = ([int(s) for s in x.stride()], int(x.storage_offset()))
        perm = tuple(range(x.dim()))
        x = x.contiguous()
    xp = x.permute(perm)  # contiguous: the memory order
    shape = [int(s) for s in xp.shape]
    if x.dtype == torch.bool:
        return (_MASK, ops.pack_mask(xp), shape, tuple(perm), strides)
    data, lo, step = ops.quantize_uniform(xp, None, bits, group_size, True)
    return (_CODES, data, lo, step, shape, x.dtype, bits, group_size, tuple(perm), strides)


def unpack(packed: tuple) -> Tensor:
    """The tensor :func:`pack` kept, decoded, with the shape, strides and dtype the graph
    saved (a view with gaps comes back as a copy laid out with the same strides)."""
    kind = packed[0]
    if kind == _RAW:
        return packed[1]
    if kind == _MASK:
        _, data, shape, perm, strides = packed
        out = ops.unpack_mask(data, shape).permute(inverse_order(perm))
    else:
        _, data, lo, step, shape, dtype, bits, group_size, perm, strides = packed
        out = ops.dequantize_uniform(data, lo, step, shape, bits, group_size,
                                     dtype).permute(inverse_order(perm))
    if strides is not None:  # the same strides and storage offset as the view saved
        stride, offset = strides
        extent = 1 + sum((n - 1) * st for n, st in zip(out.shape, stride))
        buf = torch.empty(offset + extent, dtype=out.dtype, device=out.device)
        out = buf.as_strided(out.shape, stride, offset).copy_(out)
    return out


def _graph_module(fn: Any, *consts: Any) -> torch.fx.GraphModule:
    """``x -> fn(x, *consts)`` as a GraphModule (the form AOTAutograd inlines)."""
    g = torch.fx.Graph()
    g.output(g.call_function(fn, (g.placeholder("x"),) + consts))
    return torch.fx.GraphModule(nn.Module(), g)


@functools.lru_cache(maxsize=None)
def _hooks(bits: int, group_size: int, min_numel: int) -> Tuple[torch.fx.GraphModule, ...]:
    """The (pack, unpack) GraphModules for one setting, made once per process and shared.
    Why shared: dynamo guards on the identity of the saved-tensor hooks, so hooks made per
    compiled model recompiled every model of one class, and past dynamo's recompile limit
    (8) the model silently ran eagerly. Stateless functions of their arguments, like the
    kernels :func:`~actnn_zoo.quant.backend.kernels` caches."""
    return _graph_module(pack, bits, group_size, min_numel), _graph_module(unpack)


def _settings(model: nn.Module) -> Tuple[int, int]:
    """(bits, group size) of the model's conversion: the width most of its Q-layers were
    given (the budget), else its capture width, else the defaults (2, 256)."""
    widths: Dict[Tuple[int, int], int] = {}
    for m in model.modules():
        if isinstance(m, QModule) and isinstance(m.qconfig.bits, int):
            key = (m.qconfig.bits, m.qconfig.group_size)
            widths[key] = widths.get(key, 0) + 1
    if widths:
        return max(widths, key=widths.__getitem__)
    capture = getattr(model, "actnn_zoo_capture", None)
    if capture is not None:
        return int(capture.qconfig.bits), int(capture.qconfig.group_size)
    return 2, 256


class CompressedCompile(nn.Module):
    """A model compiled by :func:`compile`: calls the compiled model with the graph's
    compression switched on. ``module`` is the model itself (its parameters, state_dict keys
    under ``module.``, train/eval mode)."""

    def __init__(self, module: nn.Module, bits: int, group_size: int, min_numel: int,
                 compile_kwargs: dict) -> None:
        super().__init__()
        self.module = module
        self.bits, self.group_size, self.min_numel = bits, group_size, min_numel
        switch = inline_switch(module)
        if switch is None:
            switch = InlineSwitch(bits, group_size)
            for m in module.modules():
                object.__setattr__(m, INLINE_ATTR, switch)
        elif (switch.bits, switch.group_size) != (bits, group_size):
            raise ValueError(f"this model was compiled by actnn_zoo.compile with bits="
                             f"{switch.bits}, group_size={switch.group_size}; compiling it "
                             f"again with other widths is not supported")
        # kept out of the module tree: one copy of the model in parameters() and state_dict()
        object.__setattr__(self, "_switch", switch)
        pack_gm, unpack_gm = _hooks(bits, group_size, min_numel)
        object.__setattr__(self, "_pack", pack_gm)
        object.__setattr__(self, "_unpack", unpack_gm)
        object.__setattr__(self, "_compiled", torch.compile(module, **compile_kwargs))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        switch = self._switch
        before = switch.on
        switch.on = True
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                return self._compiled(*args, **kwargs)
        finally:
            switch.on = before

    def extra_repr(self) -> str:
        return f"bits={self.bits}, group_size={self.group_size}, min_numel={self.min_numel}"


def compile(model: nn.Module, *, bits: Optional[int] = None, group_size: Optional[int] = None,
            min_numel: int = 1024, **compile_kwargs: Any) -> CompressedCompile:
    """``torch.compile(model, **compile_kwargs)`` with the saved activations compressed inside
    the graph, and no graph break of the library's own.

    ``model``: usually a converted model (``bits`` and ``group_size`` then default to its
    configuration's); a plain model works too (2 bits, groups of 256). Every floating saved
    intermediate of at least ``min_numel`` values is kept at ``bits`` per value, bool ones at
    1 bit. Train through the returned module (``compiled(x)``); ``model`` itself still runs
    eagerly as converted. Widths are uniform here: the precision strategies do not allocate
    per layer inside a compiled graph.

    Needs a torch whose AOTAutograd compiles saved-tensor hooks into the graph (2.11 and 2.13
    do, 2.6 does not): elsewhere it raises rather than compile a graph that compresses
    nothing; ``torch.compile(convert_model(model))`` (the Q-layers' traced forms) works there.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"actnn_zoo.compile expects an nn.Module, got {type(model).__name__}")
    default_bits, default_group = _settings(model)
    bits = check_bits(default_bits if bits is None else bits)
    group_size = check_group_size(default_group if group_size is None else group_size)
    if isinstance(min_numel, bool) or not isinstance(min_numel, int) or min_numel < 1:
        raise ValueError(f"min_numel must be a positive int, got {min_numel!r}")
    if not compiled_saved_hooks_supported():
        raise RuntimeError(
            f"actnn_zoo.compile needs a torch whose AOTAutograd compiles saved-tensor hooks "
            f"into the graph (2.11 and 2.13 do); torch {torch.__version__} does not, so the "
            f"graph would keep every activation uncompressed. Use "
            f"torch.compile(actnn_zoo.convert_model(model)) instead: its Q-layers save "
            f"through their traced forms.")
    return CompressedCompile(model, bits, group_size, min_numel, dict(compile_kwargs))
