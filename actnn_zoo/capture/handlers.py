"""Tier 2: which functional calls go to which of the zoo's autograd Functions.

A handler receives the call as torch made it (``func, args, kwargs``) while a converted
model's training forward runs, checks that the zoo can do better than what the op itself would
save, and either runs the zoo's Function or calls ``func`` unchanged. The table is an immutable
value (no registry is mutated at import); a capture session reads it.

Routed, and why (what the op itself would save, and what the zoo saves instead):

* softmax: its output, compressed by tier 3 as well -- routed only so the report names it;
  log_softmax: its output, which backward exponentiates (compressed log-probabilities would be
  badly biased) -> the probabilities, compressed (backward linear in them);
* relu / relu6 / leaky_relu / hardtanh: the output or input in full -> a 1-bit mask, exact;
* gelu / silu / sigmoid / tanh / elu / softplus: the input (f' of a compressed input is
  biased) -> the compressed derivative (unbiased);
* layer_norm / group_norm / batch_norm (training): the input and per-row statistics (tier 3
  would compress both) -> compressed input, exact statistics;
* dropout: a full float mask on CPU -> a 1-bit mask;
* cross_entropy (class-index targets): the fp32 log-softmax, [tokens, classes] -> the
  compressed softmax with the target's entry removed, plus exact per-row coefficients
  (``functional/loss.py``);
* scaled_dot_product_attention: torch's fused kernels save q, k, v, the output and the
  per-row log-sum-exp (the math path, taken on CPU with dropout, saves the L x S
  probabilities) -> compressed q, k, v only, the probabilities recomputed and renormalized
  in backward (``functional/attention.py``). Compressing the log-sum-exp, as tier 3 would, is
  biased (``exp`` of rounding noise). Attention gets at least :data:`ATTENTION_MIN_BITS`:
  measured there, 2-bit q, k carry twice the gradient's norm of noise per pass. A learned
  float mask (T5's relative position bias, ALiBi slopes) gets its gradient there too, saving
  nothing more (the mask is the caller's tensor, held by reference).

Not routed on purpose: linear / addmm / matmul / bmm / mul save exactly their operands, and
their backward is linear in each saved operand, so tier 3 compressing those operands (once,
through the store) is the same saving, unbiased, with no extra code.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..functional import activation, attention, dropout, loss, norm, softmax

__all__ = ["ATTENTION_MIN_BITS", "HANDLERS", "Handler"]

# The fewest bits routed attention saves q, k, v with (docs/design.md, "Capture"): the
# softmax of compressed scores is biased, ~0.2 of the gradient at 2 bits, < 0.01 at 4.
ATTENTION_MIN_BITS = 4

Handler = Callable[[Any, Callable, Tuple, Dict[str, Any]], Any]
_COMPRESSIBLE = (torch.float32, torch.float16, torch.bfloat16)
_MISSING = object()


def _arg(args: Tuple, kwargs: Dict[str, Any], i: int, name: str, default: Any = _MISSING) -> Any:
    if len(args) > i:
        return args[i]
    return kwargs.get(name, default)


def _only(args: Tuple, kwargs: Dict[str, Any], names: Tuple[str, ...]) -> bool:
    """True when the call uses no argument beyond ``names`` (positional or keyword)."""
    return len(args) <= len(names) and all(k in names for k in kwargs)


def _saves(x: Any) -> bool:
    """Whether autograd will save something of ``x`` that the zoo can compress."""
    return (type(x) is Tensor and x.requires_grad and x.dtype in _COMPRESSIBLE
            and x.layout == torch.strided and not x.is_nested and x.numel() > 0)


# -- softmax family -------------------------------------------------------------------------
def _softmax_like(fn_name: str):
    def handler(session: Any, func: Callable, args: Tuple, kwargs: Dict[str, Any]) -> Any:
        x = args[0] if args else kwargs.get("input", kwargs.get("self"))
        dim = _arg(args, kwargs, 1, "dim", None)
        dtype = kwargs.get("dtype")
        extra = set(kwargs) - {"input", "self", "dim", "dtype", "_stacklevel"}
        if extra or len(args) > 2 or not _saves(x) or not isinstance(dim, (int, type(None))):
            return func(*args, **kwargs)
        if dtype is not None:
            x = x.to(dtype)
            if not _saves(x):
                return func(*args, **kwargs)
        fn = softmax.SoftmaxFunction if fn_name == "softmax" else softmax.LogSoftmaxFunction
        session.stats.route(fn_name)
        return fn.apply(x, dim, session.qconfig, None)
    return handler


# -- activations ----------------------------------------------------------------------------
def _mask_act(op: str, inplace_default: bool = False):
    """relu / leaky_relu / hardtanh / relu6 (and their in-place forms)."""
    def handler(session: Any, func: Callable, args: Tuple, kwargs: Dict[str, Any]) -> Any:
        x = args[0] if args else kwargs.get("input", kwargs.get("self"))
        if not _saves(x):
            return func(*args, **kwargs)
        if op == "relu":
            if not _only(args, kwargs, ("input", "inplace")):
                return func(*args, **kwargs)
            inplace = bool(_arg(args, kwargs, 1, "inplace", inplace_default))
            out = activation.relu(x, inplace, session.relu_slot(x))
        elif op == "leaky_relu":
            slope = float(_arg(args, kwargs, 1, "negative_slope", 0.01))
            inplace = bool(_arg(args, kwargs, 2, "inplace", inplace_default))
            out = activation.MaskActivationFunction.apply(x, "leaky_relu", slope, 0.0, inplace)
        elif op == "relu6":
            inplace = bool(_arg(args, kwargs, 1, "inplace", inplace_default))
            out = activation.MaskActivationFunction.apply(x, "hardtanh", 0.0, 6.0, inplace)
        else:  # hardtanh
            lo = float(_arg(args, kwargs, 1, "min_val", -1.0))
            hi = float(_arg(args, kwargs, 2, "max_val", 1.0))
            inplace = bool(_arg(args, kwargs, 3, "inplace", inplace_default))
            if lo > hi:
                return func(*args, **kwargs)  # torch's own error
            out = activation.MaskActivationFunction.apply(x, "hardtanh", lo, hi, inplace)
        session.stats.route(op)
        return out
    return handler


def _deriv_act(op: str):
    """gelu / silu / sigmoid / tanh / elu / softplus: save the compressed derivative."""
    def handler(session: Any, func: Callable, args: Tuple, kwargs: Dict[str, Any]) -> Any:
        x = args[0] if args else kwargs.get("input", kwargs.get("self"))
        if not _saves(x):
            return func(*args, **kwargs)
        inplace = False
        if op == "gelu":
            params: Tuple = (_arg(args, kwargs, 1, "approximate", "none"),)
            if params[0] not in ("none", "tanh"):
                return func(*args, **kwargs)
        elif op == "silu":
            params, inplace = (), bool(_arg(args, kwargs, 1, "inplace", False))
        elif op == "elu":
            params = (float(_arg(args, kwargs, 1, "alpha", 1.0)),)
            inplace = bool(_arg(args, kwargs, 2, "inplace", False))
        elif op == "softplus":
            params = (float(_arg(args, kwargs, 1, "beta", 1.0)),
                      float(_arg(args, kwargs, 2, "threshold", 20.0)))
        else:  # sigmoid, tanh
            if not _only(args, kwargs, ("input",)):
                return func(*args, **kwargs)
            params = ()
        session.stats.route(op)
        return activation.DerivativeActivationFunction.apply(x, op, params, session.qconfig,
                                                             None, inplace)
    return handler


# -- norms ----------------------------------------------------------------------------------
def _layer_norm(session: Any, func: Callable, args: Tuple, kwargs: Dict[str, Any]) -> Any:
    x = _arg(args, kwargs, 0, "input")
    shape = _arg(args, kwargs, 1, "normalized_shape")
    w = _arg(args, kwargs, 2, "weight", None)
    b = _arg(args, kwargs, 3, "bias", None)
    eps = _arg(args, kwargs, 4, "eps", 1e-5)
    if not _saves(x):
        return func(*args, **kwargs)
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    session.stats.route("layer_norm")
    return norm.layer_norm_train(x, shape, w, b, float(eps), session.qconfig,
                                 session.qconfig.bits)


def _group_norm(session: Any, func: Callable, args: Tuple, kwargs: Dict[str, Any]) -> Any:
    x = _arg(args, kwargs, 0, "input")
    groups = _arg(args, kwargs, 1, "num_groups")
    w = _arg(args, kwargs, 2, "weight", None)
    b = _arg(args, kwargs, 3, "bias", None)
    eps = _arg(args, kwargs, 4, "eps", 1e-5)
    if not _saves(x) or x.dim() < 2 or x.shape[1] % int(groups):
        return func(*args, **kwargs)  # torch raises its own error for a bad group count
    session.stats.route("group_norm")
    return norm.group_norm_train(x, int(groups), w, b, float(eps), session.qconfig,
                                 session.qconfig.bits)


def _batch_norm(session: Any, func: Callable, args: Tuple, kwargs: Dict[str, Any]) -> Any:
    x = _arg(args, kwargs, 0, "input")
    rm = _arg(args, kwargs, 1, "running_mean")
    rv = _arg(args, kwargs, 2, "running_var")
    w = _arg(args, kwargs, 3, "weight", None)
    b = _arg(args, kwargs, 4, "bias", None)
    training = _arg(args, kwargs, 5, "training", False)
    momentum = _arg(args, kwargs, 6, "momentum", 0.1)
    eps = _arg(args, kwargs, 7, "eps", 1e-5)
    if (not training or not _saves(x) or x.dim() < 2 or momentum is None
            or x.numel() // x.shape[1] <= 1):
        return func(*args, **kwargs)  # eval, nothing saved, or torch's own batch-size error
    session.stats.route("batch_norm")
    return norm.batch_norm_train(x, w, b, rm, rv, float(momentum), float(eps), session.qconfig,
                                 session.qconfig.bits)


# -- dropout --------------------------------------------------------------------------------
def _dropout(session: Any, func: Callable, args: Tuple, kwargs: Dict[str, Any]) -> Any:
    x = _arg(args, kwargs, 0, "input")
    p = _arg(args, kwargs, 1, "p", 0.5)
    training = _arg(args, kwargs, 2, "training", True)
    inplace = _arg(args, kwargs, 3, "inplace", False)
    if not training or not _saves(x) or not isinstance(p, (int, float)) or not 0.0 < p < 1.0:
        return func(*args, **kwargs)
    session.stats.route("dropout")
    return dropout.dropout(x, float(p), bool(inplace))


# -- loss and attention ---------------------------------------------------------------------
def _cross_entropy(session: Any, func: Callable, args: Tuple, kwargs: Dict[str, Any]) -> Any:
    names = ("input", "target", "weight", "size_average", "ignore_index", "reduce",
             "reduction", "label_smoothing")
    x = _arg(args, kwargs, 0, "input")
    target = _arg(args, kwargs, 1, "target")
    legacy = (_arg(args, kwargs, 3, "size_average", None) is not None
              or _arg(args, kwargs, 5, "reduce", None) is not None)
    if (legacy or not _only(args, kwargs, names) or not _saves(x) or type(target) is not Tensor
            or target.dtype.is_floating_point):
        return func(*args, **kwargs)
    session.stats.route("cross_entropy")
    return loss.cross_entropy(x, target, _arg(args, kwargs, 2, "weight", None),
                              ignore_index=int(_arg(args, kwargs, 4, "ignore_index", -100)),
                              reduction=_arg(args, kwargs, 6, "reduction", "mean"),
                              label_smoothing=float(_arg(args, kwargs, 7, "label_smoothing",
                                                         0.0)),
                              qconfig=session.qconfig)


# F.scaled_dot_product_attention's arguments: their positions and defaults (None where torch
# requires the argument: a call without it is handed to torch, which raises); the first six
# may be positional, scale and enable_gqa are keyword-only
_SDPA_POSITIONAL = 6
_SDPA_DEFAULTS = (None, None, None, None, 0.0, False, None, False)
_SDPA_INDEX = {name: i for i, name in enumerate(
    ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"))}


def _bind(args: Tuple, kwargs: Dict[str, Any], index: Mapping[str, int],
          defaults: Tuple[Any, ...], positional: int) -> Optional[List[Any]]:
    """The call's arguments in signature order, defaults filled in; None when it passes one
    the signature lacks, more than ``positional`` positionally, or one twice (torch then
    raises its own error). One pass where ``_arg`` per argument costs a call each."""
    n = len(args)
    if n > positional:
        return None
    bound = list(args) + list(defaults[n:])
    for name, value in kwargs.items():
        i = index.get(name)
        if i is None or i < n:
            return None
        bound[i] = value
    return bound


def _attention(session: Any, func: Callable, args: Tuple, kwargs: Dict[str, Any]) -> Any:
    bound = _bind(args, kwargs, _SDPA_INDEX, _SDPA_DEFAULTS, _SDPA_POSITIONAL)
    if bound is None:
        return func(*args, **kwargs)
    q, k, v, mask, p, causal, scale, gqa = bound
    if not (_saves(q) or _saves(k) or _saves(v) or _saves(mask)):
        return func(*args, **kwargs)
    if not all(type(t) is Tensor and t.dtype in _COMPRESSIBLE for t in (q, k, v)):
        return func(*args, **kwargs)
    session.stats.route("scaled_dot_product_attention")
    return attention.scaled_dot_product_attention(
        q, k, v, mask, float(p), bool(causal), scale, bool(gqa),
        qconfig=session.qconfig, bits=max(int(session.qconfig.bits), ATTENTION_MIN_BITS))


def _table() -> Mapping[Callable, Handler]:
    t: Dict[Callable, Handler] = {}
    for fn in (F.softmax, torch.softmax, Tensor.softmax):
        t[fn] = _softmax_like("softmax")
    for fn in (F.log_softmax, torch.log_softmax, Tensor.log_softmax):
        t[fn] = _softmax_like("log_softmax")
    for fn in (F.relu, torch.relu, Tensor.relu):
        t[fn] = _mask_act("relu")
    for fn in (F.relu_, torch.relu_, Tensor.relu_):
        t[fn] = _mask_act("relu", inplace_default=True)
    t[F.leaky_relu] = _mask_act("leaky_relu")
    t[F.hardtanh] = _mask_act("hardtanh")
    t[F.relu6] = _mask_act("relu6")
    t[F.gelu] = _deriv_act("gelu")
    t[F.silu] = _deriv_act("silu")
    t[F.elu] = _deriv_act("elu")
    t[F.softplus] = _deriv_act("softplus")
    for fn in (torch.sigmoid, Tensor.sigmoid, F.sigmoid):
        t[fn] = _deriv_act("sigmoid")
    for fn in (torch.tanh, Tensor.tanh, F.tanh):
        t[fn] = _deriv_act("tanh")
    t[F.layer_norm] = _layer_norm
    t[F.group_norm] = _group_norm
    t[F.batch_norm] = _batch_norm
    t[F.dropout] = _dropout
    t[F.cross_entropy] = _cross_entropy
    t[F.scaled_dot_product_attention] = _attention
    return MappingProxyType(t)


HANDLERS: Mapping[Callable, Handler] = _table()
