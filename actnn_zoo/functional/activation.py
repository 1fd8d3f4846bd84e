"""Autograd Functions for elementwise activations.

Piecewise-linear activations (ReLU, ReLU6, Hardtanh, LeakyReLU) only need to know which slope
applied at each position, so they save a 1-bit packed mask and their gradients are exact.
Smooth activations (GELU, SiLU, Sigmoid, Tanh, ELU, Softplus, Mish) and the piecewise-smooth
Hardswish / Hardsigmoid save their derivative f'(x),
compressed: ``grad_in = grad_out * f'(x)`` is linear in the saved quantity, so stochastic
rounding of f'(x) keeps the gradient unbiased (saving x instead would not: f' of an unbiased
estimate of x is biased).

Everything is saved through :func:`~actnn_zoo.functional._saving.save`, i.e.
``ctx.save_for_backward``. The forward outputs are computed by the very torch functional ops
the torch layers call, so they are bit-identical to them (also under autocast).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _session
from .._session import ZeroCodeClaim, ZeroCodeSlot, active_session, save_probe
from .._torch_private import tensor_version
from ..config import LayerQConfig
from ..quant import Bits, SampleBits, ops, pack_compare, unpack_mask
from ..quant.backend import extension
from ..quant.api import masked_grad
from ..quant.tensor import CompressedPayload
from . import _saving
from ._saving import (compress, compress_fresh, compress_produced, dequantize_rows,
                      from_memory_order, keep_saved, load, load_codes, memory_perm,
                      produce_bounds, restore, sample_chunks, save, save_codes, to_memory_order)
from ._autocast import autocast_enabled, autocast_on
from .linear import _CUDA_NODES, node_codes

OptBits = Optional[Bits]

__all__ = ["relu", "leaky_relu", "hardtanh", "relu6", "gelu", "silu", "sigmoid", "tanh", "elu",
           "softplus", "hardswish", "hardsigmoid", "mish", "MaskActivationFunction",
           "DerivativeActivationFunction", "TracedDerivativeActivation",
           "activation_derivative", "memory_perm", "to_memory_order", "from_memory_order",
           "load_mask", "BoolMaskReLU"]


# ----------------------------------------------------------------------------------------------
# Layout helpers (shared with dropout): pack masks / compress in memory order, so a
# channels_last tensor is neither copied nor permuted before packing.
# ----------------------------------------------------------------------------------------------
def load_mask(packed: Tensor, shape: torch.Size, perm: Optional[Tuple[int, ...]]) -> Tensor:
    return from_memory_order(unpack_mask(packed, shape), perm)


def masked_grad_in(grad: Tensor, packed: Tensor, shape: torch.Size,
                   perm: Optional[Tuple[int, ...]], on: Optional[float],
                   off: Optional[float]) -> Tensor:
    """``grad_in`` of a layer that saved packed mask bits in memory order, fused (``quant.masked_grad``):
    the bits are in memory order, so ``grad`` is taken in that order too (a view when it shares
    the layout, as it does after a channels_last layer) and the result is returned in it."""
    g = to_memory_order(grad, perm)
    if g.shape != shape:
        raise RuntimeError(f"gradient of shape {tuple(g.shape)} for a mask of {tuple(shape)}")
    return from_memory_order(masked_grad(g, packed, on, off), perm)


def no_double_backward(what: str) -> None:
    """Raise when backward runs with ``create_graph=True`` for a layer whose saved quantity
    cannot give second derivatives (returning a graph without them would be silently wrong)."""
    if torch.is_grad_enabled():
        raise NotImplementedError(
            f"actnn_zoo: double backward (create_graph=True) through compressed {what} is not "
            "supported: its second derivative is not saved. Use the torch layer (to_float()) "
            "or disable quantization for it (qconfig.enabled=False).")


def _autocast_state(device_type: str) -> Tuple[bool, torch.dtype]:
    """Whether autocast is on for ``device_type`` and its dtype (public API, torch >= 2.4);
    (False, float32) for device types autocast does not know (meta)."""
    if not autocast_enabled(device_type):
        return False, torch.float32
    return True, torch.get_autocast_dtype(device_type)


# ----------------------------------------------------------------------------------------------
# Piecewise-linear activations: 1-bit mask
# ----------------------------------------------------------------------------------------------
def _bound(v: float, dtype: torch.dtype, up: bool) -> float:
    """A threshold exactly representable in ``dtype`` such that comparing in ``dtype`` gives
    the same answer as torch's kernels, which compare in float32 against float32(v): for
    half types the largest (``up=False``) / smallest (``up=True``) value on the right side."""
    if dtype not in (torch.float16, torch.bfloat16):
        return v
    v32 = torch.tensor(v, dtype=torch.float32)
    r = v32.to(dtype)
    if up and r.float() < v32:
        r = torch.nextafter(r, torch.tensor(float("inf"), dtype=dtype))
    elif not up and r.float() > v32:
        r = torch.nextafter(r, torch.tensor(float("-inf"), dtype=dtype))
    return float(r)


_MASK_OPS = ("relu", "leaky_relu", "hardtanh")


def _predicate(op: str, a: float, b: float, dtype: torch.dtype
               ) -> Tuple[str, float, float, float]:
    """(pack_compare kind, lo, hi, the slope where the bit is clear) of a mask activation:
    torch's backward predicate, compared in ``dtype``."""
    if op == "relu":  # threshold_backward(grad, result, 0): result <= 0 -> 0
        return "not_le", 0.0, 0.0, 0.0
    if op == "leaky_relu":  # leaky_relu_backward: x > 0 ? grad : grad * slope
        return "gt", 0.0, 0.0, a
    if op == "hardtanh":  # hardtanh_backward: x <= min || x >= max -> 0
        # At NaN torch's vectorised loop gives 0 and its scalar tail the gradient; we give 0.
        return "between", _bound(a, dtype, up=False), _bound(b, dtype, up=True), 0.0
    raise ValueError(f"unknown mask activation {op!r}; expected one of {_MASK_OPS}")


class MaskActivationFunction(torch.autograd.Function):
    """``f`` with slope 1 where the mask is set and slope ``a`` (LeakyReLU) or 0 elsewhere.

    The mask is computed from the input before any in-place update, with the exact predicate
    of torch's backward kernel, so gradients equal torch's bit for bit (at NaN inputs too,
    except Hardtanh, where torch itself is inconsistent and we pass no gradient).
    With ``inplace`` the input is modified and marked dirty, as torch's in-place ops do.
    """

    @staticmethod
    def forward(ctx, x: Tensor, op: str, a: float, b: float, inplace: bool,
                slot: Optional[ZeroCodeSlot] = None) -> Tensor:
        session = active_session() if slot is not None and op == "relu" else None
        if session is not None:
            innermost = session.store.hooks_innermost()
            slot.probed = True
        elif slot is not None and slot.probed and op == "relu" and _session.hooks_top_is is None:
            save_probe()  # what the session's probe saved: a checkpoint's recomputation
        if session is not None and slot.enabled and innermost:
            # the consumer's sparse codes will hold the mask (ZeroCodeSlot)
            out = F.relu(x, inplace=inplace)
            if inplace:
                ctx.mark_dirty(x)
            ctx.claim = ZeroCodeClaim(out)
            slot.waiting = ("claim", ctx.claim)  # registered by relu() once out is final
            save(ctx)
            return out
        # The mask, packed in one read of x (quant.pack_compare), with torch's backward predicate
        kind, lo, hi, other = _predicate(op, a, b, x.dtype)
        perm = memory_perm(x)
        xm = to_memory_order(x, perm)
        packed, mshape = pack_compare(xm, kind, lo, hi), xm.shape
        if op == "relu":
            out = F.relu(x, inplace=inplace)
        elif op == "leaky_relu":
            out = F.leaky_relu(x, a, inplace=inplace)
        else:
            out = F.hardtanh(x, a, b, inplace=inplace)
        if inplace:
            ctx.mark_dirty(x)
        ctx.other = other
        ctx.mshape = mshape
        ctx.perm = perm
        ctx.claim = None
        save(ctx, packed)
        if session is not None:
            slot.waiting = ("offer", None)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        # One fused pass over grad and the packed bits (quant.masked_grad): no bool mask is
        # materialised. Bit-identical to torch.where(mask, grad, 0 or grad * other).
        if ctx.claim is not None:
            return _claimed_grad(ctx.claim, grad), None, None, None, None, None
        (packed,) = load(ctx)
        grad_in = masked_grad_in(grad, packed, ctx.mshape, ctx.perm, None,
                                 None if ctx.other == 0.0 else ctx.other)
        return grad_in, None, None, None, None, None


def _claimed_grad(claim: ZeroCodeClaim, grad: Tensor) -> Tensor:
    """ReLU's backward from its claim: the mask of the consumer's sparse codes (``x != 0`` of
    the output, which for a ReLU output is ``threshold_backward``'s predicate), else the mask
    packed at the end of the forward."""
    if claim.sparse_mask is not None:  # sparse codes: their mask is ReLU's, logical order
        return masked_grad(grad, claim.sparse_mask)
    if claim.mask is not None:
        packed, shape, perm = claim.mask
        return masked_grad_in(grad, packed, shape, perm, None, None)
    raise RuntimeError("actnn_zoo: the output of a ReLU was modified by an in-place operation "
                       "after the ReLU and before anything saved it; its backward needs the "
                       "original (torch's own ReLU raises for the same reason)")


# The compiled autograd node of the mask activations (cpp_ext/qlayers.cpp), None without the
# extension or in an older build.
_QMASK = getattr(extension(), "qmask", None)
# whether a ReLU in a capture session runs as that node (_claim_node); False: the Function
_QCLAIM = True


def _mask_node(x: Tensor, op: str, a: float, b: float, inplace: bool) -> Optional[Tensor]:
    """The mask path of :class:`MaskActivationFunction` as the compiled node ``_C.qmask``, for
    a contiguous plain tensor of the fused kernels' dtypes on a device with kernels (the bits
    in logical order, which is memory order then); None elsewhere. Bit-identical outputs and
    gradients (tests/test_qlayer_nodes.py)."""
    if not (_QMASK is not None and type(x) is Tensor and x.dtype in _MASK_NODE_DTYPES
            and x.is_contiguous() and (x.is_cpu or _CUDA_NODES)):
        return None
    kind, lo, hi, other = _predicate(op, a, b, x.dtype)
    packed = pack_compare(x, kind, lo, hi)
    return _QMASK(x, packed, op, a, b, inplace, None if other == 0.0 else other, None,
                  keep_saved(packed))


_MASK_NODE_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_SET_FLAG = getattr(extension(), "set_flag", None)  # (its build's pack_compare takes out=)


class _HeldClaim(ZeroCodeClaim):
    """The claim of a ReLU run as the compiled node: the node saved ``buffer`` (one bit per
    value) and the 1-byte ``filled`` flag at its forward; the consumer's sparse codes write
    their mask into ``buffer`` (:meth:`mask_buffer`), or :meth:`fall_back` packs the output's
    mask there at the end of the forward. Either sets the flag, through its pointer as the
    buffer is written (no version counter moves, so autograd's saved-tensor checks see the
    tensors it saved); the node's backward raises while it is unset."""

    __slots__ = ("buffer", "filled")

    def __init__(self, out: Tensor, buffer: Tensor, filled: Tensor) -> None:
        super().__init__(out)
        self.buffer, self.filled = buffer, filled

    def mask_buffer(self) -> Optional[Tensor]:
        return self.buffer

    def fulfil(self, q) -> None:
        if q.mask is not self.buffer:
            raise RuntimeError("actnn_zoo: a claimed ReLU output was quantized without its "
                               "mask buffer")
        _SET_FLAG(self.filled)
        super().fulfil(q)

    def fall_back(self) -> None:
        out, self.out = self.out, None
        if out is None or tensor_version(out) != self.version:
            return  # changed in place since the ReLU: the flag stays unset, backward raises
        pack_compare(out.detach(), "not_le", out=self.buffer)  # ReLU's backward predicate
        _SET_FLAG(self.filled)


def _claim_node(x: Tensor, inplace: bool, slot: ZeroCodeSlot, store) -> Optional[Tensor]:
    """ReLU inside a capture session as the compiled node ``_C.qmask``: what
    :class:`MaskActivationFunction` does there (the probe, then a claim on the consumer's
    codes when the slot learned that the consumer compresses the output, else the mask and an
    offer), without its Python autograd Function. For a contiguous CPU tensor of the mask
    node's dtypes whose saves reach autograd as themselves (:meth:`saves_pass_through`: the
    claim's buffer is written after the forward); else None, with nothing done. Gradients are
    bit-identical to the Function's (tests/test_qlayer_nodes.py)."""
    if not (_QMASK is not None and _SET_FLAG is not None and type(x) is Tensor
            and x.is_cpu and x.dtype in _MASK_NODE_DTYPES and x.is_contiguous()
            and store.saves_pass_through()):
        return None
    innermost = store.hooks_innermost()
    slot.probed = True
    if slot.enabled and innermost:  # the consumer's sparse codes will hold the mask
        buffer = torch.empty((x.numel() + 7) // 8, dtype=torch.uint8)
        filled = torch.zeros(1, dtype=torch.uint8)
        # (the consumer's payload counts the mask)
        own = store.keep_own(buffer, filled, counted=False)
        out = _QMASK(x, buffer, "relu", 0.0, 0.0, inplace, None, filled, own)
        store.claim(out, _HeldClaim(out, buffer, filled), slot)
        return out
    out = _mask_node(x, "relu", 0.0, 0.0, inplace)  # applies: the checks above include its own
    store.offer(out, slot)
    return out


def relu(x: Tensor, inplace: bool = False, slot: Optional[ZeroCodeSlot] = None) -> Tensor:
    """ReLU saving a 1-bit mask for backward; with a module's ``slot``, nothing of its own
    where the next layer compresses the output (:class:`~actnn_zoo._session.ZeroCodeSlot`)."""
    if slot is None or (active_session() is None
                        and (not slot.probed or _session.hooks_top_is is not None)):
        out = _mask_node(x, "relu", 0.0, 0.0, inplace)  # no claim, no probe to mirror
        if out is not None:
            return out
    elif _QCLAIM:
        session = active_session()
        if session is not None:
            out = _claim_node(x, inplace, slot, session.store)
            if out is not None:
                return out
    out = MaskActivationFunction.apply(x, "relu", 0.0, 0.0, inplace, slot)
    if slot is not None and slot.waiting is not None:
        session = active_session()
        if session is not None:
            slot.register(out, session.store)
        slot.waiting = None
    return out


def leaky_relu(x: Tensor, negative_slope: float = 0.01, inplace: bool = False) -> Tensor:
    """LeakyReLU saving a 1-bit sign mask (any slope, also negative with ``inplace``)."""
    out = _mask_node(x, "leaky_relu", float(negative_slope), 0.0, inplace)
    if out is not None:
        return out
    return MaskActivationFunction.apply(x, "leaky_relu", float(negative_slope), 0.0, inplace)


def hardtanh(x: Tensor, min_val: float = -1.0, max_val: float = 1.0,
             inplace: bool = False) -> Tensor:
    """Hardtanh saving a 1-bit inside-the-range mask."""
    if min_val > max_val:
        raise ValueError("min_val cannot be greater than max_val")
    out = _mask_node(x, "hardtanh", float(min_val), float(max_val), inplace)
    if out is not None:
        return out
    return MaskActivationFunction.apply(x, "hardtanh", float(min_val), float(max_val), inplace)


def relu6(x: Tensor, inplace: bool = False) -> Tensor:
    return hardtanh(x, 0.0, 6.0, inplace)


# ----------------------------------------------------------------------------------------------
# Smooth activations: compressed derivative
# ----------------------------------------------------------------------------------------------
_DERIV_OPS = ("gelu", "silu", "sigmoid", "tanh", "elu", "softplus", "hardswish", "hardsigmoid",
              "mish")


def _opmath(t: Tensor) -> Tensor:
    """float32 for half/bf16/float32 (torch's opmath type), float64 stays float64.

    A float32 tensor is returned as it is, not through ``t.float()`` (the same tensor): with
    torch 2.11, dynamo tracing a traced Function whose forward computed f'(x) from
    ``out.float()`` of its own output gave every gradient zero (sigmoid, tanh;
    ``tests/test_compile.py``)."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def activation_derivative(op: str, x: Tensor, y: Optional[Tensor] = None,
                          params: Tuple = ()) -> Tensor:
    """f'(x) in opmath precision (float32; float64 for float64 input).

    Computed by torch's own public backward kernel applied to a unit gradient (a stride-0
    expanded 1, so no extra memory; for the exact GELU on the CPU a dense one the result
    overwrites), hence exactly torch's derivative, in one fused pass.
    ``y`` (the output) is used where torch's backward uses it (sigmoid, tanh). On the CPU
    the extension makes it in one call (``_C.activation_derivative``, the same kernels on the
    same unit gradients, so the same values; ``tests/test_layers_activation.py``), except
    while ``torch.compile`` traces (a graph takes the torch ops, not an opaque call).
    """
    src = y if op in ("sigmoid", "tanh") else x
    if (_DERIVATIVE is not None and type(src) is Tensor and src.is_cpu
            and op in _DERIV_OPS and not torch.compiler.is_compiling()):  # (a traced form: ops)
        a, b, approximate = _node_params(op, params)
        return _DERIVATIVE(src, op, a, b, approximate)
    return _derivative_torch(op, src, params)


def _derivative_torch(op: str, src: Tensor, params: Tuple) -> Tensor:
    """:func:`activation_derivative` in torch ops (other devices, no extension)."""
    aten = torch.ops.aten
    t = _opmath(src)
    if op == "gelu" and params[0] == "none" and t.is_cpu:
        # torch's CPU kernel of the exact GELU's backward runs slower on a stride-0 gradient
        # than on a dense one (1.2-3x by shape: 4M values 5.3-11.6 ms against 3.9-4.2; the
        # same values). A dense one, overwritten in place, costs no memory beyond the result
        # (out= takes no part in autograd: t detached, as f'(x) is never differentiated).
        d = torch.ones_like(t)
        return aten.gelu_backward.grad_input(d, t.detach(), approximate="none", grad_input=d)
    one = torch.ones((), dtype=t.dtype, device=t.device).expand(t.shape)
    if op == "sigmoid":
        return aten.sigmoid_backward(one, t)
    if op == "tanh":
        return aten.tanh_backward(one, t)
    if op == "gelu":
        return aten.gelu_backward(one, t, approximate=params[0])
    if op == "silu":
        return aten.silu_backward(one, t)
    if op == "elu":  # F.elu(x, alpha) is elu(x, alpha, scale=1, input_scale=1)
        return aten.elu_backward(one, params[0], 1, 1, False, t)
    if op == "softplus":
        return aten.softplus_backward(one, t, params[0], params[1])
    if op == "hardswish":
        return aten.hardswish_backward(one, t)
    if op == "hardsigmoid":
        return aten.hardsigmoid_backward(one, t)
    if op == "mish":
        return aten.mish_backward(one, t)
    raise ValueError(f"unknown activation {op!r}; expected one of {_DERIV_OPS}")


def _apply_op(op: str, x: Tensor, params: Tuple, inplace: bool) -> Tensor:
    if op == "gelu":
        return F.gelu(x, approximate=params[0])
    if op == "silu":
        return F.silu(x, inplace=inplace)
    if op == "sigmoid":
        return torch.sigmoid(x)
    if op == "tanh":
        return torch.tanh(x)
    if op == "elu":
        return F.elu(x, params[0], inplace=inplace)
    if op == "softplus":
        return F.softplus(x, params[0], params[1])
    if op == "hardswish":
        return F.hardswish(x, inplace=inplace)
    if op == "hardsigmoid":
        return F.hardsigmoid(x, inplace=inplace)
    if op == "mish":
        return F.mish(x, inplace=inplace)
    raise ValueError(f"unknown activation {op!r}; expected one of {_DERIV_OPS}")


class DerivativeActivationFunction(torch.autograd.Function):
    """``y = f(x)`` saving the compressed derivative ``f'(x)``.

    The derivative is computed in forward by torch's own backward kernel in float32 (float64
    inputs: computed in float64, compressed as float32, since quantization supports up to
    float32 and its own error dwarfs the cast). Backward ``grad * f'(x)_hat`` is unbiased.
    Second derivatives would need f''(x), which is not saved: backward with
    ``create_graph=True`` raises.
    """

    @staticmethod
    def forward(ctx, x: Tensor, op: str, params: Tuple, qconfig: LayerQConfig, bits: OptBits,
                inplace: bool, derivative: Optional[Tensor] = None) -> Tensor:
        uses_out = op in ("sigmoid", "tanh")
        perm = memory_perm(x)
        shape = x.shape if perm is None else x.permute(perm).shape

        def produce(start: int, stop: int) -> Tensor:  # samples start:stop of f'(x)
            y = out[start:stop] if uses_out else None
            d = activation_derivative(op, x[start:stop], y, params)
            return to_memory_order(d.to(torch.float32), perm)

        # f'(x) before any in-place update of x (sigmoid/tanh read the output instead); made
        # and quantized a chunk of samples at a time when large (compress_produced)
        out = _apply_op(op, x, params, inplace) if uses_out else None
        if derivative is not None:  # made whole from this x already (see _deriv_apply)
            q, deriv = None, derivative
        else:
            q = compress_produced(produce, shape, qconfig, bits, x.device)
            deriv = activation_derivative(op, x, out, params) if q is None else None
        if not uses_out:
            out = _apply_op(op, x, params, inplace)
        if inplace:
            ctx.mark_dirty(x)
        if q is None:
            perm = memory_perm(deriv)
            # in memory order a channels_last map reads (N, H, W, C): not maps for DIVISION
            q = compress(to_memory_order(deriv.to(torch.float32), perm), qconfig, bits,
                         maps=None if perm is None else False)
            del deriv
        ctx.perm = perm
        ctx.in_dtype = x.dtype
        ctx.op = op
        ctx.chunks = qconfig.backward_chunks
        save(ctx, q)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        no_double_backward(ctx.op)
        (q,) = load(ctx)
        chunks = sample_chunks(q, ctx.chunks)
        if chunks:  # one decoded chunk of f'(x) at a time, each product into its rows
            grad_in = torch.empty_like(grad, dtype=ctx.in_dtype)
            for start, stop in chunks:
                deriv = from_memory_order(dequantize_rows(q, start, stop), ctx.perm)
                torch.mul(grad[start:stop], deriv, out=grad_in[start:stop])
                del deriv
            return grad_in, None, None, None, None, None, None
        deriv = from_memory_order(restore(q), ctx.perm)
        if ctx.in_dtype == torch.float64:
            deriv = deriv.double()
        if isinstance(q, CompressedPayload) and deriv.dtype == torch.promote_types(
                grad.dtype, deriv.dtype) and deriv.shape == grad.shape:
            # the decoded copy is this call's own: the product goes into it (the same values
            # as grad * deriv), no second full-size buffer
            grad_in = deriv.mul_(grad)
        else:
            grad_in = grad * deriv
        return grad_in.to(ctx.in_dtype), None, None, None, None, None, None


class TracedDerivativeActivation(torch.autograd.Function):
    """The form ``torch.compile`` traces: :class:`DerivativeActivationFunction` at one width,
    ``f'(x)`` kept as ``actnn_zoo::quantize_uniform`` codes (``_saving.save_codes``), no host
    work. Rounding the input instead (what the graph would save for torch's op) would make the
    gradient ``f'(x_hat)``: biased, where ``grad * f'(x)_hat`` is not. Out of place: an
    in-place layer copies the output into its input outside (a custom Function may not modify
    a view in place, and a graph has no in-place ops anyway)."""

    @staticmethod
    def forward(ctx, x: Tensor, op: str, params: Tuple,  # type: ignore[override]
                bits: int, group_size: int) -> Tensor:
        out = _apply_op(op, x, params, False)
        deriv = activation_derivative(op, x, out, params).to(torch.float32)
        ctx.in_dtype = x.dtype
        save_codes(ctx, deriv, bits, group_size)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        deriv, _ = load_codes(ctx)
        return (grad * deriv).to(ctx.in_dtype), None, None, None, None


def _deriv_apply(op: str, x: Tensor, params: Tuple, qconfig: Optional[LayerQConfig],
                 bits: OptBits, inplace: bool = False,
                 derivative: Optional[Tensor] = None) -> Tensor:
    """``derivative``: f'(x) as :func:`activation_derivative` makes it, already made from this
    very ``x`` (a precision strategy computes it to choose the widths, ``precision.stats``),
    so that the Function does not compute it a second time. Where :func:`_node_applies` -- the
    common case -- the autograd node is the compiled ``_C.qderivative`` (no Python in
    backward); otherwise :class:`DerivativeActivationFunction`. Both save the same codes and
    give the same gradients."""
    qconfig = LayerQConfig() if qconfig is None else qconfig
    if _QDERIVATIVE is not None and not inplace and _node_applies(op, x, qconfig, bits,
                                                                  derivative):
        # what the Function's forward does up to its save: f'(x) whole (made from x detached:
        # no graph, as inside a Function), compressed in float32
        deriv = (activation_derivative(op, x.detach(), None, params) if derivative is None
                 else derivative)
        q = compress_fresh(deriv.to(torch.float32), qconfig, bits, maps=None)
        del deriv
        made = node_codes(q)
        if made is not None:
            a, b, approximate = _node_params(op, params)
            return _QDERIVATIVE(x, op, a, b, approximate, *made[0], made[1])
        derivative = None  # (a payload the node does not decode: never with this qconfig)
    return DerivativeActivationFunction.apply(x, op, params, qconfig, bits, inplace, derivative)


# The compiled autograd node of the smooth activations that do not read their output in
# backward (cpp_ext/qlayers.cpp), None without the extension or in an older build; and the
# compiled f'(x) (activation_derivative's CPU path).
_QDERIVATIVE = getattr(extension(), "qderivative", None)
_DERIVATIVE = getattr(extension(), "activation_derivative", None)
_NODE_OPS = frozenset({"gelu", "silu", "elu", "softplus", "hardswish", "hardsigmoid", "mish"})


def _node_applies(op: str, x: Tensor, qconfig: LayerQConfig, bits: OptBits,
                  derivative: Optional[Tensor]) -> bool:
    """Whether ``_C.qderivative`` computes what :class:`DerivativeActivationFunction` would:
    an op that does not read its output, the plain quantizer (one width or per-sample widths),
    a contiguous plain tensor of one of the node's dtypes on a device with kernels, no
    autocast, f'(x) made whole (handed on, or small enough not to be made in chunks) and
    decoded whole in backward (``backward_chunks`` off or a small input)."""
    return (op in _NODE_OPS and type(x) is Tensor and x.dtype in _NODE_DTYPES
            and x.is_contiguous() and qconfig.compressor == "quant"
            and qconfig.transform == "none"
            and (bits is None or isinstance(bits, (int, SampleBits)))
            and (derivative is not None or produce_bounds(x.shape, x.device) is None)
            and (qconfig.backward_chunks <= 1 or x.numel() * 4 < _saving.CHUNK_MIN_BYTES)
            and (x.is_cpu or _CUDA_NODES)
            and not autocast_on(x))


_NODE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _node_params(op: str, params: Tuple) -> Tuple[float, float, str]:
    """(a, b, approximate) as ``_C.qderivative`` takes an op's parameters."""
    if op == "gelu":
        return 0.0, 0.0, params[0]
    if op == "elu":
        return float(params[0]), 0.0, "none"
    if op == "softplus":
        return float(params[0]), float(params[1]), "none"
    return 0.0, 0.0, "none"


def gelu(x: Tensor, approximate: str = "none", qconfig: Optional[LayerQConfig] = None,
         bits: OptBits = None,
         derivative: Optional[Tensor] = None) -> Tensor:
    """GELU ('none' or 'tanh') saving compressed GELU'(x)."""
    if approximate not in ("none", "tanh"):
        return F.gelu(x, approximate=approximate)  # raises torch's own error
    return _deriv_apply("gelu", x, (approximate,), qconfig, bits, derivative=derivative)


def silu(x: Tensor, inplace: bool = False, qconfig: Optional[LayerQConfig] = None,
         bits: OptBits = None,
         derivative: Optional[Tensor] = None) -> Tensor:
    """SiLU saving compressed SiLU'(x) = s(x) (1 + x (1 - s(x)))."""
    return _deriv_apply("silu", x, (), qconfig, bits, inplace, derivative=derivative)


def sigmoid(x: Tensor, qconfig: Optional[LayerQConfig] = None, bits: OptBits = None,
            derivative: Optional[Tensor] = None) -> Tensor:
    """Sigmoid saving compressed y (1 - y)."""
    return _deriv_apply("sigmoid", x, (), qconfig, bits, derivative=derivative)


def tanh(x: Tensor, qconfig: Optional[LayerQConfig] = None, bits: OptBits = None,
         derivative: Optional[Tensor] = None) -> Tensor:
    """Tanh saving compressed 1 - y^2."""
    return _deriv_apply("tanh", x, (), qconfig, bits, derivative=derivative)


def elu(x: Tensor, alpha: float = 1.0, inplace: bool = False,
        qconfig: Optional[LayerQConfig] = None, bits: OptBits = None,
        derivative: Optional[Tensor] = None) -> Tensor:
    """ELU saving compressed ELU'(x) (computed before an in-place update, so any alpha works
    in place, unlike torch's result-based in-place backward)."""
    return _deriv_apply("elu", x, (float(alpha),), qconfig, bits, inplace, derivative=derivative)


def softplus(x: Tensor, beta: float = 1.0, threshold: float = 20.0,
             qconfig: Optional[LayerQConfig] = None, bits: OptBits = None,
             derivative: Optional[Tensor] = None) -> Tensor:
    """Softplus saving compressed Softplus'(x) (1 above the linear threshold, as torch)."""
    return _deriv_apply("softplus", x, (float(beta), float(threshold)), qconfig, bits,
                        derivative=derivative)


def hardswish(x: Tensor, inplace: bool = False, qconfig: Optional[LayerQConfig] = None,
              bits: OptBits = None,
              derivative: Optional[Tensor] = None) -> Tensor:
    """Hardswish saving its compressed derivative (piecewise: 0, (2x + 3) / 6, 1). Saving the
    derivative rather than x keeps ``grad * f'`` linear in what is saved, hence unbiased."""
    return _deriv_apply("hardswish", x, (), qconfig, bits, inplace, derivative=derivative)


def hardsigmoid(x: Tensor, inplace: bool = False, qconfig: Optional[LayerQConfig] = None,
                bits: OptBits = None,
                derivative: Optional[Tensor] = None) -> Tensor:
    """Hardsigmoid saving its compressed derivative (1/6 inside (-3, 3), else 0): a 2-bit
    group holding both values rounds them stochastically, unbiased like the smooth ones."""
    return _deriv_apply("hardsigmoid", x, (), qconfig, bits, inplace, derivative=derivative)


def mish(x: Tensor, inplace: bool = False, qconfig: Optional[LayerQConfig] = None,
         bits: OptBits = None,
         derivative: Optional[Tensor] = None) -> Tensor:
    """Mish saving compressed Mish'(x) (computed before an in-place update)."""
    return _deriv_apply("mish", x, (), qconfig, bits, inplace, derivative=derivative)


class BoolMaskReLU(torch.autograd.Function):
    """ReLU saving ``~(x <= 0)`` packed to 1 bit per value by the ``actnn_zoo::pack_mask``
    operator: the form :func:`actnn_zoo.compile` traces.

    torch's own ReLU saves its output, which the compiled graph would round (moving small
    values to zero: a biased mask); and a bool mask made of plain ops can be recomputed by the
    graph's partitioner from a tensor that is itself rounded. A custom operator's output is
    saved as it is. The output, and with it the gradient, equals torch's (NaN passes the
    gradient, as ``threshold_backward`` lets it)."""

    @staticmethod
    def forward(ctx, x: Tensor, inplace: bool) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(ops.pack_mask(~(x <= 0)))
        ctx.shape = list(x.shape)
        if inplace:
            x.relu_()
            ctx.mark_dirty(x)
            return x
        return torch.relu(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tuple[Optional[Tensor], None]:  # type: ignore[override]
        (packed,) = ctx.saved_tensors
        keep = ops.unpack_mask(packed, ctx.shape)
        return torch.where(keep, grad, torch.zeros((), dtype=grad.dtype, device=grad.device)), None
