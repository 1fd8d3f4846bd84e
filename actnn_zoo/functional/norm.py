"""BatchNorm (local and synchronised), LayerNorm and GroupNorm that save their normalized input
compressed.

Forward runs the public ``aten::native_*_norm`` op on the real input: the same kernel torch's
functional op ends in, so the output is torch's, and it also returns the statistics (mean and
invstd / rstd) that backward needs. Saved: compress(x_hat) with x_hat = (x - mean) * invstd,
the statistics (one pair per channel, row or group, exact), the weight (a Parameter). Backward
reads the codes of x_hat directly on the CPU (``quant.norm_backward``: batch norm per channel,
layer and group norm per row); elsewhere it rebuilds x = x_hat / invstd + mean and calls the
public ``aten::native_*_norm_backward``, and batch norm with ``backward_chunks`` evaluates the
same formula in x_hat a chunk of samples at a time (``_bn_backward_by_chunks``).

Why the normalized input: a quantization group holds 256 consecutive values, which mixes
channels whenever a feature map has fewer positions than that (late CNN stages, batch 8:
Inception-v3's 8x8 maps put 4 channels in a group). Compressing x, a narrow channel gets the
step of a wide neighbour, and the backward multiplies that error by the narrow channel's
1/std -- twice in the input gradient: 2-bit training diverged within 3 steps. x_hat has unit
scale in every channel, so a step costs every channel the same.

Bias: the weight gradient sum(grad_out * x_hat) is linear in the saved x_hat (the statistics
are exact), hence unbiased under stochastic rounding. The input gradient has a term quadratic
in x_hat, x_hat_i * mean(w * g * x_hat) over the m values normalized together, whose diagonal
is biased by w_i g_i Var(x_hat_i) / m: at 2 bits a layer norm over 16 / 64 / 256 values missed
its exact input gradient by 2.2 / 1.5 / 1.25x what the noise of 400 passes explains
(tests/test_bias.py). Forward also saves an unbiased estimate of the rounding variance
(``_rounding_variance``, ~0.14 bit per value) when the input needs a gradient, and backward
adds ``scale_i * w_i * g_i * Var_hat_i / m`` on every path (codes kernel, chunks, aten): the
input gradient is then exactly unbiased for the plain stochastic quantizer.

Double backward (``create_graph=True``) raises NotImplementedError naming the layer: the input
gradient depends on x itself (through x_hat and the statistics), and only a compressed x_hat is
kept, so a graph of it would silently lack the x-dependent part (``first_order_only``).
"""
from __future__ import annotations

import math
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..config import LayerQConfig
from ..quant import Bits, QuantizedTensor, ops
from ..quant.api import draw_seed
from ..quant.backend import extension
from ..quant.norm_backward import (batch_norm_backward_codes, channels_last,
                                   group_norm_backward_codes, layer_norm_backward_codes,
                                   reads_codes)
from ._saving import (compress, compress_normalized, compress_produced, dequantize_rows,
                      keep_saved, load, load_codes, restore, sample_chunks, save, save_codes)
from ._rounding_variance import Stat, correct_, norm_stride, sample_variance
from ._autocast import autocast_on, no_autocast
from .linear import cast, dtype_of, first_order_only, memory_format_of



def autocast_dtype(x: Tensor, probe: Callable[[Tensor], Tensor]) -> torch.dtype:
    """The dtype torch's own functional op would compute in for ``x`` right now.

    Autocast policies differ per device (CUDA runs layer_norm/group_norm in float32, CPU leaves
    them alone); rather than copy the tables, run the functional op on an empty tensor and read
    the dtype autocast gave it. Costs nothing when autocast is off.
    """
    if not autocast_on(x):
        return x.dtype
    return probe(x).dtype


def _autocast_inputs(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
                     dt: torch.dtype) -> Tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
    """An autocast float32 policy casts every floating argument; mirror it when it applied."""
    if dt == x.dtype:
        return x, weight, bias
    return x.to(dt), cast(weight, dt), cast(bias, dt)


def _channel_dims(x: Tensor) -> List[int]:
    return [0] + list(range(2, x.dim()))


def _needs_saved_input(ctx, weight_index: int) -> bool:
    """The input is read back only for the input and weight gradients (bias needs a sum)."""
    return ctx.needs_input_grad[0] or ctx.needs_input_grad[weight_index]


def _per_channel(stat: Tensor, x: Tensor) -> Tensor:
    """A (C,) statistic shaped to broadcast over (N, C, *spatial) (any memory format)."""
    return stat.view([1, -1] + [1] * (x.dim() - 2))


def _per_group(stat: Tensor, x: Tensor, groups: int) -> Tensor:
    """An (N, G) group-norm statistic expanded to (N, C, 1, ...) so it broadcasts over x."""
    n, c = x.shape[0], x.shape[1]
    return stat.reshape(n, groups, 1).expand(n, groups, c // groups).reshape(
        [n, c] + [1] * (x.dim() - 2))


def _normalize(x: Tensor, mean: Tensor, invstd: Tensor) -> Tensor:
    """x_hat = (x - mean) * invstd in float32 (float64 stays float64), x's memory format."""
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    return (cast(x, work) - cast(mean, work)).mul_(cast(invstd, work))


def _compress_normalized(xc: Tensor, mean: Tensor, invstd: Tensor, qconfig: LayerQConfig,
                         bits: Bits, maps: bool):
    """``compress(_normalize(xc, mean, invstd))``. On the CPU: normalized on the way into the
    quantizer (``_saving.compress_normalized``), the copy never made. Otherwise the normalized
    copy is made and quantized a chunk of samples at a time when large (``compress_produced``):
    the forward never holds it whole next to the layer's input and output. Statistics with a
    sample dim are sliced with it. ``maps``: channels-first (batch and group norm) or features
    last (layer norm)."""
    n = xc.shape[0] if xc.dim() >= 2 else 1
    q = compress_normalized(xc, mean, invstd, qconfig, bits)
    if q is not None:  # normalized on the way into the quantizer (CPU)
        return q

    def rows(stat: Tensor, start: int, stop: int) -> Tensor:
        return stat[start:stop] if stat.dim() and stat.shape[0] == n else stat

    def produce(start: int, stop: int) -> Tensor:
        t = _normalize(xc[start:stop], rows(mean, start, stop), rows(invstd, start, stop))
        return t.float() if t.dtype == torch.float64 else t  # quantized through float32

    q = compress_produced(produce, xc.shape, qconfig, bits, xc.device)
    return q if q is not None else compress(_normalize(xc, mean, invstd), qconfig, bits,
                                            maps=maps)


def _variance_sample(ctx, x_q, xc: Tensor, stat: Stat, mean: Tensor, invstd: Tensor,
                     qconfig: LayerQConfig, m: int):
    """Saved for the correction of the input gradient (module docstring, "Bias"): the 1-bit
    codes of sampled rounding variances of x_hat (their offset on ``ctx``), or None when the
    input needs no gradient or the payload gets no correction. x_hat at flat index ``i`` is
    computed from ``xc`` as :func:`_normalize` does, with the statistic ``stat`` picks
    (``_rounding_variance.Stat``); ``m``: values per statistic."""
    ctx.var_offset = None
    if x_q is None or not ctx.needs_input_grad[0]:
        return None
    ctx.var_offset, var = sample_variance(x_q, xc, qconfig.rounding, norm_stride(m),
                                          shift=mean, scale=invstd, stat=stat)
    return var


def _denormalize(x_hat: Tensor, mean: Tensor, invstd: Tensor, dtype: torch.dtype,
                 owned: bool = False) -> Tensor:
    """x = x_hat / invstd + mean, cast to the compute dtype of the backward op. ``owned``: x_hat
    is a decoded copy nobody else reads, overwritten when it has the working dtype (the same
    operations, so the same values): one full map less at the backward's peak. A plain saved
    tensor is never owned (a second backward reads it again)."""
    work = torch.float64 if dtype == torch.float64 else torch.float32
    if owned and x_hat.dtype == work:
        return cast(x_hat.div_(cast(invstd, work)).add_(cast(mean, work)), dtype)
    return cast((cast(x_hat, work) / cast(invstd, work)).add_(cast(mean, work)), dtype)


# -- BatchNorm ----------------------------------------------------------------------------------
# One compiled call each for the common case's forward with its save and its backward
# (cpp_ext/norm_cpu.cpp; None without the extension or in an older build): the Python path
# below costs ~40 calls each way, the layer's largest host cost (docs/design.md, "Host cost").
_BN_FORWARD = getattr(extension(), "batch_norm_forward_codes", None)
_BN_BACKWARD = getattr(extension(), "batch_norm_backward_fused", None)
_LN_FORWARD = getattr(extension(), "layer_norm_forward_codes", None)
_LN_BACKWARD = getattr(extension(), "layer_norm_backward_fused", None)
_GN_FORWARD = getattr(extension(), "group_norm_forward_codes", None)
_GN_BACKWARD = getattr(extension(), "group_norm_backward_fused", None)


def _fusable(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
             qconfig: LayerQConfig, bits: Bits, dt: torch.dtype) -> bool:
    """Whether a norm's fused forward (:data:`_BN_FORWARD`, :data:`_LN_FORWARD`,
    :data:`_GN_FORWARD`) computes what its Python path would: the CPU path that normalizes
    inside the quantizer and reads the codes in backward (a contiguous non-empty float32
    input, float32 affine parameters, computing in float32: no autocast), the plain quantizer
    at one width."""
    return (type(x) is Tensor and x.is_cpu
            and x.dtype == torch.float32 and dt == torch.float32 and x.dim() >= 2
            and x.is_contiguous() and x.numel() > 0
            and (weight is None or weight.dtype == torch.float32)
            and (bias is None or bias.dtype == torch.float32)
            and qconfig.compressor == "quant" and qconfig.transform == "none"
            and type(bits) is int)


def _norm_fused(ctx, x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
                qconfig: LayerQConfig, bits: Bits, dt: torch.dtype, weight_index: int) -> bool:
    """:func:`_fusable`, and the input is saved (the input or the weight, argument
    ``weight_index``, needs a gradient)."""
    return _fusable(x, weight, bias, qconfig, bits, dt) and _needs_saved_input(ctx, weight_index)


def _fused_call(call: Callable, x: Tensor, args: tuple, qconfig: LayerQConfig, bits: int,
                m: int, need_input: bool) -> tuple:
    """``call(x, *args, bits, group size, seed, stochastic, variance stride)`` -- (out, mean,
    stat, data, lo, step, variance codes or None, their offset) -- and the stride. The draws
    are the Python path's, in its order: the codes' seed here, the variances' (offset, seed)
    in the call. ``m``: values per statistic; variances are sampled only for the input
    gradient."""
    stochastic = qconfig.rounding == "stochastic"
    stride = norm_stride(m) if stochastic and need_input else 0
    return call(x, *args, bits, qconfig.group_size, draw_seed() if stochastic else 0,
                stochastic, stride), stride


def _forward_fused(ctx, call: Callable, x: Tensor, args: tuple, weight: Optional[Tensor],
                   extra: tuple, qconfig: LayerQConfig, bits: int, m: int) -> Tensor:
    """A norm Function's forward through its fused call (:func:`_fused_call`), saved as its
    Python path saves: codes, mean, the inverse deviation, the weight, ``extra`` and the
    variance codes."""
    (out, mean, stat, data, lo, step, var, offset), stride = _fused_call(
        call, x, args, qconfig, bits, m, ctx.needs_input_grad[0])
    ctx.var_offset = (offset, stride) if var is not None else None
    ctx.fused = (bits, qconfig.group_size, weight is not None, var is not None)
    x_q = QuantizedTensor(data, lo, step, x.shape, torch.float32, bits, qconfig.group_size)
    save(ctx, x_q, mean, stat, weight, *extra, var)
    return out


def _backward_fused(ctx, grad_out: Tensor) -> bool:
    """Whether the backward of a forward :func:`_forward_fused` made runs its fused call: the
    codes path reads a float32 gradient in (N, C, *) order (a channels-last one goes to aten,
    as in the Python path)."""
    return (ctx.fused is not None and grad_out.dtype == torch.float32
            and not channels_last(grad_out))


def _fused_grads(ctx, grad_out: Tensor, call: Callable, need_wb: Tuple[bool, bool],
                 *extra: int) -> Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """(input, weight, bias) gradients through a fused backward ``call(grad, data, lo, step,
    bits, group size, stat, weight, variance codes, offset, stride, *extra, need_input)``, None
    where not needed. The saves: data, lo, step, mean, stat[, weight][, ...][, variances]."""
    bits, group_size, has_weight, has_var = ctx.fused
    saved = ctx.saved_tensors
    offset, stride = ctx.var_offset if has_var else (0, 0)
    gi, gw, gb = call(grad_out, saved[0], saved[1], saved[2], bits, group_size, saved[4],
                      saved[5] if has_weight else None, saved[-1] if has_var else None, offset,
                      stride, *extra, ctx.needs_input_grad[0])
    return gi, gw if need_wb[0] else None, gb if need_wb[1] else None


# The norms as one compiled autograd node each (cpp_ext/qlayers.cpp, qnorm) where their fused
# calls apply: see _norm_node
_QNORM = getattr(extension(), "qnorm", None)


def _norm_node(kind: int, call: Callable, x: Tensor, args: tuple, weight: Optional[Tensor],
               bias: Optional[Tensor], extra: int, qconfig: LayerQConfig, bits: Bits, m: int,
               layer: str) -> Optional[Tensor]:
    """The norm as the compiled node ``_C.qnorm`` where its Python Function would take the
    fused call (:func:`_norm_fused`'s case), else None with nothing drawn: the fused forward
    (:func:`_fused_call`) here, its saves handed to the node, the fused
    backward in the node -- the same draws in the same order, the same saves, bit-identical
    results (tests/test_qlayer_nodes.py; a channels-last gradient, which the Function hands to
    aten, is made contiguous for the fused backward: the same gradient up to rounding). Why:
    the Python Function's apply, ctx and backward cost ~15-20 us a call, as much as the norm
    itself at small sizes. ``kind``: 0 batch, 1 layer, 2 group norm; ``extra``: the
    backward's (values per row, groups); ``m``: values per statistic; ``layer`` names it in
    the double-backward error."""
    if not (_QNORM is not None and torch.is_grad_enabled()
            and not torch.is_autocast_enabled("cpu")
            and _fusable(x, weight, bias, qconfig, bits, x.dtype)
            and (x.requires_grad or (weight is not None and weight.requires_grad))):
        return None
    (out, mean, stat, data, lo, step, var, offset), stride = _fused_call(
        call, x, args, qconfig, bits, m, x.requires_grad)
    made = [out, data, lo, step, mean, stat] + ([var] if var is not None else [])
    # what the Function's save() tells the store, in its order
    own = keep_saved(*[t for t in (data, lo, step, mean, stat, weight,
                                   bias if kind == 1 else None, var) if t is not None])
    return _QNORM(x, weight, bias, made, kind, extra, bits, qconfig.group_size, offset, stride,
                  kind == 1, layer, own)


def batch_norm_train(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
                     running_mean: Optional[Tensor], running_var: Optional[Tensor],
                     momentum: float, eps: float, qconfig: LayerQConfig, bits: Bits) -> Tensor:
    """Training batch norm saving its normalized input compressed: the compiled node where it
    applies (:func:`_norm_node`), else :class:`BatchNormFunction`."""
    if _BN_FORWARD is not None and x.dim() >= 2:
        out = _norm_node(0, _BN_FORWARD, x, (weight, bias, running_mean, running_var, momentum,
                                             eps), weight, bias, 0, qconfig, bits,
                         x.numel() // max(x.shape[1], 1), "QBatchNorm (batch_norm)")
        if out is not None:
            return out
    return BatchNormFunction.apply(x, weight, bias, running_mean, running_var, momentum, eps,
                                   qconfig, bits)


def layer_norm_train(x: Tensor, normalized_shape: Sequence[int], weight: Optional[Tensor],
                     bias: Optional[Tensor], eps: float, qconfig: LayerQConfig,
                     bits: Bits) -> Tensor:
    """Layer norm saving its normalized input compressed: the compiled node where it applies
    (:func:`_norm_node`), else :class:`LayerNormFunction`."""
    shape = list(normalized_shape)
    if _LN_FORWARD is not None and len(shape) < x.dim():
        m = math.prod(shape)
        out = _norm_node(1, _LN_FORWARD, x, (shape, weight, bias, eps), weight, bias, m,
                         qconfig, bits, m, "QLayerNorm (layer_norm)")
        if out is not None:
            return out
    return LayerNormFunction.apply(x, tuple(normalized_shape), weight, bias, eps, qconfig, bits)


def group_norm_train(x: Tensor, num_groups: int, weight: Optional[Tensor],
                     bias: Optional[Tensor], eps: float, qconfig: LayerQConfig,
                     bits: Bits) -> Tensor:
    """Group norm saving its normalized input compressed: the compiled node where it applies
    (:func:`_norm_node`), else :class:`GroupNormFunction`."""
    if (_GN_FORWARD is not None and x.dim() >= 2 and num_groups > 0
            and x.shape[1] % num_groups == 0):
        out = _norm_node(2, _GN_FORWARD, x, (num_groups, weight, bias, eps), weight, bias,
                         num_groups, qconfig, bits, x.numel() // (x.shape[0] * num_groups),
                         "QGroupNorm (group_norm)")
        if out is not None:
            return out
    return GroupNormFunction.apply(x, num_groups, weight, bias, eps, qconfig, bits)


def _bn_probe(x: Tensor) -> Tensor:
    e = x.new_empty((0, 1))
    return F.batch_norm(e, None, None, training=True)


class BatchNormFunction(torch.autograd.Function):
    """Training-mode batch norm; running statistics are updated in forward exactly as torch does
    (``native_batch_norm`` updates them in place with the given momentum, unbiased variance)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
                running_mean: Optional[Tensor], running_var: Optional[Tensor], momentum: float,
                eps: float, qconfig: LayerQConfig, bits: Bits) -> Tensor:
        dt = autocast_dtype(x, _bn_probe)
        ctx.eps = eps
        ctx.x_format = memory_format_of(x)
        ctx.chunks = qconfig.backward_chunks
        ctx.dtypes = (x.dtype, dtype_of(weight), dtype_of(bias))
        ctx.compute_dtype = dt
        ctx.fused = None
        if _BN_FORWARD is not None and _norm_fused(ctx, x, weight, bias, qconfig, bits, dt, 1):
            return _forward_fused(ctx, _BN_FORWARD, x, (weight, bias, running_mean,
                                                        running_var, momentum, eps),
                                  weight, (), qconfig, bits, x.numel() // x.shape[1])
        xc, w, b = _autocast_inputs(x, weight, bias, dt)
        out, mean, invstd = torch.ops.aten.native_batch_norm(xc, w, b, running_mean, running_var,
                                                             True, momentum, eps)
        x_q = None
        if _needs_saved_input(ctx, 1):
            x_q = _compress_normalized(xc, _per_channel(mean, xc), _per_channel(invstd, xc),
                                       qconfig, bits, maps=True)
        var = _variance_sample(ctx, x_q, xc, _channel_stat(xc), mean, invstd, qconfig,
                               xc.numel() // max(xc.shape[1], 1) if xc.dim() >= 2 else 1)
        save(ctx, x_q, mean, invstd, weight, var)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> Tuple[Optional[Tensor], ...]:
        first_order_only("QBatchNorm (batch_norm)")
        if _backward_fused(ctx, grad_out):
            gi, gw, gb = _fused_grads(ctx, grad_out, _BN_BACKWARD, ctx.needs_input_grad[1:3])
            return (gi, gw, gb) + (None,) * 6
        x_q, mean, invstd, weight, var = load(ctx)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        dt = ctx.compute_dtype
        gi = gw = gb = None
        with no_autocast(grad_out.device.type):
            go = cast(grad_out, dt)
            chunks = sample_chunks(x_q, ctx.chunks)
            w = cast(weight, dt)
            if x_q is not None and reads_codes(go, x_q, invstd, w):
                # from the codes: no decoded x_hat, no aten temporary (quant/norm_backward.py)
                gi, gw, gb = batch_norm_backward_codes(go, x_q, invstd, w, need_x)
            elif chunks:
                gi, gw, gb = _bn_backward_by_chunks(go, x_q, invstd, weight, chunks, ctx.x_format,
                                                    need_x)
            elif x_q is not None:
                x_hat = restore(x_q).contiguous(memory_format=ctx.x_format)
                x = _denormalize(x_hat, _per_channel(mean, x_hat), _per_channel(invstd, x_hat),
                                 dt, owned=not isinstance(x_q, Tensor))
                del x_hat
                gi, gw, gb = torch.ops.aten.native_batch_norm_backward(
                    go, x, cast(weight, dt if dt != x_dtype else None), None, None, mean,
                    invstd, True, ctx.eps, [need_x, need_w, need_b])
            elif need_b:
                gb = go.sum(_channel_dims(go))
            if need_x:
                ch = _channel_stat(go)
                gi = correct_(gi, go, ctx.var_offset, var, scale=invstd, weight=weight, stat=ch,
                              weight_stat=ch, divisor=go.numel() // go.shape[1])
        return (cast(gi, x_dtype) if need_x else None, cast(gw, w_dtype) if need_w else None,
                cast(gb, b_dtype) if need_b else None) + (None,) * 6


def _channel_stat(x: Tensor) -> Stat:
    """Flat logical index of an (N, C, *spatial) tensor -> its channel, as a ``Stat``."""
    c = x.shape[1] if x.dim() >= 2 else 1
    hw = x.numel() // (x.shape[0] * c) if x.numel() else 1
    return max(hw, 1), c


def _bn_backward_by_chunks(go: Tensor, x_q: QuantizedTensor, invstd: Tensor,
                           weight: Optional[Tensor], chunks: List[Tuple[int, int]],
                           x_format: torch.memory_format, need_x: bool
                           ) -> Tuple[Optional[Tensor], Tensor, Tensor]:
    """Training-mode batch-norm backward from the saved x_hat, decoded a chunk of samples at a
    time (twice: once for the reductions, once for the input gradient), so the backward holds
    grad_out, grad_in and two chunks instead of grad_out, grad_in, x and aten's temporaries.

    Per channel, with m values: gb = sum(g), gw = sum(g * x_hat),
    gi = weight * invstd * (g - gb / m - x_hat * gw / m): what ``native_batch_norm_backward``
    computes, written in x_hat (which is what was saved) instead of x.
    """
    work = torch.float64 if go.dtype == torch.float64 else torch.float32
    dims = _channel_dims(go)
    gb = go.sum(dims, dtype=work)
    gw = torch.zeros_like(gb)
    for start, stop in chunks:
        xh = dequantize_rows(x_q, start, stop).to(work).contiguous(memory_format=x_format)
        gw += xh.mul_(go[start:stop]).sum(dims)
        del xh
    gi = None
    if need_x:
        m = go.numel() // go.shape[1]
        scale = invstd.to(work) if weight is None else invstd.to(work) * weight.to(work)
        mean_g, mean_gx = _per_channel(gb / m, go), _per_channel(gw / m, go)
        scale = _per_channel(scale, go)
        gi = torch.empty_like(go, memory_format=x_format)
        for start, stop in chunks:
            xh = dequantize_rows(x_q, start, stop).to(work).contiguous(memory_format=x_format)
            # (g - mean_g - x_hat * mean_gx) * scale, in place in the decoded chunk
            xh.mul_(mean_gx).neg_().add_(go[start:stop]).sub_(mean_g).mul_(scale)
            gi[start:stop].copy_(xh)
            del xh
    return gi, gw, gb


def _gather_moments(x: Tensor, process_group, world_size: int) -> Tuple[Tensor, Tensor, Tensor]:
    """Global per-channel (mean, biased var, count) over every rank of ``process_group``.

    Each rank contributes (count, mean, M2 = sum of squared deviations); the combination is
    Chan's parallel formula, which avoids the cancellation of a sum-of-squares approach.
    """
    import torch.distributed as dist

    xf = x.float()
    c = x.shape[1]
    count = x.numel() // c if c else 0
    if count > 0:
        var_l, mean_l = torch.var_mean(xf, _channel_dims(x), correction=0)
    else:
        var_l = mean_l = xf.new_zeros(c)
    local = torch.cat([mean_l, var_l * count, xf.new_full((1,), float(count))])
    gathered = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(gathered, local, group=process_group)
    allv = torch.stack(gathered)  # (world, 2C + 1)
    means, m2s, counts = allv[:, :c], allv[:, c:2 * c], allv[:, 2 * c:]
    total = counts.sum()
    if float(total) == 0:
        raise ValueError("SyncBatchNorm: the input is empty on every rank")
    mean = (means * counts).sum(0) / total
    m2 = (m2s + counts * (means - mean) ** 2).sum(0)
    return mean, m2 / total, total


class SyncBatchNormFunction(torch.autograd.Function):
    """Batch norm with statistics over every rank of a process group (public torch.distributed).

    Forward all-gathers per-rank (count, mean, M2); backward all-reduces the two reductions
    (sum dy, sum dy * (x - mean)) over the dequantized input, like nn.SyncBatchNorm. The weight
    and bias gradients stay local (DDP averages them), as in nn.SyncBatchNorm.
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
                running_mean: Optional[Tensor], running_var: Optional[Tensor], momentum: float,
                eps: float, process_group, world_size: int, qconfig: LayerQConfig,
                bits: Bits) -> Tensor:
        dt = autocast_dtype(x, _bn_probe)
        xc, w, b = _autocast_inputs(x, weight, bias, dt)
        mean, var, total = _gather_moments(xc, process_group, world_size)
        n = float(total)
        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_((mean * momentum).to(running_mean.dtype))
        if running_var is not None:
            unbiased = var * (n / (n - 1)) if n > 1 else var
            running_var.mul_(1 - momentum).add_((unbiased * momentum).to(running_var.dtype))
        # Eval-mode native batch norm with the global statistics: (x - mean) / sqrt(var + eps).
        out = torch.ops.aten.native_batch_norm(xc, w, b, mean, var, False, 0.0, eps)[0]
        invstd = torch.rsqrt(var + eps)
        ctx.count = n
        ctx.group = process_group
        ctx.x_format = memory_format_of(x)
        ctx.dtypes = (x.dtype, dtype_of(weight), dtype_of(bias))
        x_q = None
        if _needs_saved_input(ctx, 1):
            x_q = _compress_normalized(xc, _per_channel(mean, xc), _per_channel(invstd, xc),
                                       qconfig, bits, maps=True)
        var = _variance_sample(ctx, x_q, xc, _channel_stat(xc), mean, invstd, qconfig,
                               xc.numel() // max(xc.shape[1], 1) if xc.dim() >= 2 else 1)
        save(ctx, x_q, mean, invstd, weight, var)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> Tuple[Optional[Tensor], ...]:
        first_order_only("QSyncBatchNorm")
        import torch.distributed as dist

        x_q, mean, invstd, weight, var = load(ctx)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        gi = gw = gb = None
        with no_autocast(grad_out.device.type):
            go = grad_out.float()
            dims = _channel_dims(go)
            shape = [1, -1] + [1] * (go.dim() - 2)
            sum_dy = go.sum(dims)
            if need_b:
                gb = sum_dy
            if x_q is not None:
                xmu = restore(x_q).float().contiguous(memory_format=ctx.x_format) / \
                    invstd.view(shape)  # x - mean, from the saved normalized input
                sum_dy_xmu = (go * xmu).sum(dims)
                if need_w:
                    gw = sum_dy_xmu * invstd
                if need_x:
                    both = torch.cat([sum_dy, sum_dy_xmu])
                    dist.all_reduce(both, group=ctx.group)
                    mean_dy, mean_dy_xmu = (both / ctx.count).chunk(2)
                    scale = invstd if weight is None else invstd * weight.float()
                    gi = (go - mean_dy.view(shape)
                          - xmu * (invstd * invstd * mean_dy_xmu).view(shape)) * scale.view(shape)
                    ch = _channel_stat(go)
                    gi = correct_(gi, go, ctx.var_offset, var, scale=invstd, weight=weight,
                                  stat=ch, weight_stat=ch, divisor=ctx.count)
        return (cast(gi, x_dtype), cast(gw, w_dtype), cast(gb, b_dtype)) + (None,) * 8


# -- LayerNorm ----------------------------------------------------------------------------------
class LayerNormFunction(torch.autograd.Function):
    """Layer norm; saves compress(x), per-row mean and rstd, weight and bias (Parameters)."""

    @staticmethod
    def forward(ctx, x: Tensor, normalized_shape: Sequence[int], weight: Optional[Tensor],
                bias: Optional[Tensor], eps: float, qconfig: LayerQConfig, bits: Bits) -> Tensor:
        shape = list(normalized_shape)
        dt = autocast_dtype(x, lambda t: F.layer_norm(t.new_empty([0] + shape), shape))
        ctx.normalized_shape = shape
        ctx.dtypes = (x.dtype, dtype_of(weight), dtype_of(bias))
        ctx.compute_dtype = dt
        ctx.fused = None
        if (_LN_FORWARD is not None and len(shape) < x.dim()
                and _norm_fused(ctx, x, weight, bias, qconfig, bits, dt, 2)):
            return _forward_fused(ctx, _LN_FORWARD, x, (shape, weight, bias, eps), weight,
                                  (bias,), qconfig, bits, math.prod(shape))
        xc, w, b = _autocast_inputs(x, weight, bias, dt)
        out, mean, rstd = torch.ops.aten.native_layer_norm(xc, shape, w, b, eps)
        x_q = None
        if _needs_saved_input(ctx, 2):
            x_q = _compress_normalized(xc, mean, rstd, qconfig, bits, maps=False)
        m = math.prod(shape)
        var = _variance_sample(ctx, x_q, xc, (m, 0), mean, rstd, qconfig, m)
        save(ctx, x_q, mean, rstd, weight, bias, var)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> Tuple[Optional[Tensor], ...]:
        first_order_only("QLayerNorm (layer_norm)")
        if _backward_fused(ctx, grad_out):
            shape = ctx.normalized_shape
            gi, gw, gb = _fused_grads(ctx, grad_out, _LN_BACKWARD, ctx.needs_input_grad[2:4],
                                      math.prod(shape))
            return (gi, None, None if gw is None else gw.view(shape),
                    None if gb is None else gb.view(shape), None, None, None)
        x_q, mean, rstd, weight, bias, var = load(ctx)
        need_x, need_w, need_b = (ctx.needs_input_grad[0], ctx.needs_input_grad[2],
                                  ctx.needs_input_grad[3])
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        dt = ctx.compute_dtype
        to_dt = dt if dt != x_dtype else None
        gi = gw = gb = None
        with no_autocast(grad_out.device.type):
            go = cast(grad_out, dt)
            w = cast(weight, to_dt)
            if (x_q is not None and len(ctx.normalized_shape) < go.dim()
                    and reads_codes(go, x_q, rstd, w, "layer_norm_backward_codes")):
                # from the codes, a row at a time (quant/norm_backward.py)
                shape = ctx.normalized_shape
                gi, gw, gb = layer_norm_backward_codes(go, x_q, rstd, math.prod(shape), w, need_x)
                gw, gb = gw.view(shape), gb.view(shape)
            elif x_q is not None:
                x = _denormalize(restore(x_q), mean, rstd, dt,
                                 owned=not isinstance(x_q, Tensor))
                gi, gw, gb = torch.ops.aten.native_layer_norm_backward(
                    go, x, ctx.normalized_shape, mean, rstd, cast(weight, to_dt),
                    cast(bias, to_dt), [need_x, need_w, need_b])
            elif need_b:
                lead = go.dim() - len(ctx.normalized_shape)
                gb = go.sum(list(range(lead))) if lead else go
            if need_x:
                m = math.prod(ctx.normalized_shape)
                gi = correct_(gi, go, ctx.var_offset, var, scale=rstd, weight=weight,
                              stat=(m, 0), weight_stat=(1, m), divisor=m)
        return (cast(gi, x_dtype) if need_x else None, None,
                cast(gw, w_dtype) if need_w else None, cast(gb, b_dtype) if need_b else None,
                None, None, None)


# -- GroupNorm ----------------------------------------------------------------------------------
class GroupNormFunction(torch.autograd.Function):
    """Group norm; saves compress(x), per-(sample, group) mean and rstd, and the weight."""

    @staticmethod
    def forward(ctx, x: Tensor, num_groups: int, weight: Optional[Tensor],
                bias: Optional[Tensor], eps: float, qconfig: LayerQConfig, bits: Bits) -> Tensor:
        dt = autocast_dtype(x, lambda t: F.group_norm(t.new_empty((0, num_groups)), num_groups))
        n, c = x.shape[0], x.shape[1]
        hxw = x.numel() // (n * c) if n * c else 1
        ctx.sizes = (n, c, hxw, num_groups)
        ctx.dtypes = (x.dtype, dtype_of(weight), dtype_of(bias))
        ctx.compute_dtype = dt
        ctx.fused = None
        if _GN_FORWARD is not None and _norm_fused(ctx, x, weight, bias, qconfig, bits, dt, 2):
            ctx.x_format = torch.contiguous_format
            return _forward_fused(ctx, _GN_FORWARD, x, (num_groups, weight, bias, eps), weight,
                                  (), qconfig, bits, (c // num_groups) * hxw)
        xc, w, b = _autocast_inputs(x, weight, bias, dt)
        fmt = memory_format_of(xc)
        xc = xc.contiguous(memory_format=fmt)  # what aten::group_norm does before the kernel
        out, mean, rstd = torch.ops.aten.native_group_norm(xc, w, b, n, c, hxw, num_groups, eps)
        ctx.x_format = fmt
        x_q = None
        if _needs_saved_input(ctx, 2):
            x_q = _compress_normalized(xc, _per_group(mean, xc, num_groups),
                                       _per_group(rstd, xc, num_groups), qconfig, bits,
                                       maps=True)
        m = (c // num_groups) * hxw  # values per (sample, group): x's flat index // m
        var = _variance_sample(ctx, x_q, xc, (max(m, 1), 0), mean, rstd, qconfig, m)
        save(ctx, x_q, mean, rstd, weight, var)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> Tuple[Optional[Tensor], ...]:
        first_order_only("QGroupNorm (group_norm)")
        if _backward_fused(ctx, grad_out):
            gi, gw, gb = _fused_grads(ctx, grad_out, _GN_BACKWARD, ctx.needs_input_grad[2:4],
                                      ctx.sizes[3])
            return (gi, None, gw, gb, None, None, None)
        x_q, mean, rstd, weight, var = load(ctx)
        need_x, need_w, need_b = (ctx.needs_input_grad[0], ctx.needs_input_grad[2],
                                  ctx.needs_input_grad[3])
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        dt = ctx.compute_dtype
        n, c, hxw, g = ctx.sizes
        gi = gw = gb = None
        with no_autocast(grad_out.device.type):
            # Like autograd's own rule: gradient and input in the input's memory format.
            go = cast(grad_out, dt).contiguous(memory_format=ctx.x_format)
            w = cast(weight, dt if dt != x_dtype else None)
            if (x_q is not None and go.numel()
                    and reads_codes(go, x_q, rstd, w, "group_norm_backward_codes")):
                # from the codes, in batch norm's two passes (quant/norm_backward.py)
                gi, gw, gb = group_norm_backward_codes(go, x_q, rstd, g, w, need_x)
            elif x_q is not None:
                x_hat = restore(x_q).contiguous(memory_format=ctx.x_format)
                x = _denormalize(x_hat, _per_group(mean, x_hat, g), _per_group(rstd, x_hat, g),
                                 dt, owned=not isinstance(x_q, Tensor)
                                 ).contiguous(memory_format=ctx.x_format)
                del x_hat
                gi, gw, gb = torch.ops.aten.native_group_norm_backward(
                    go, x, mean, rstd, w, n, c, hxw, g, [need_x, need_w, need_b])
            elif need_b:
                gb = go.sum(_channel_dims(go))
            if need_x:
                m = (c // g) * hxw
                gi = correct_(gi, go, ctx.var_offset, var, scale=rstd, weight=weight,
                              stat=(max(m, 1), 0), weight_stat=(max(hxw, 1), c), divisor=m)
        return (cast(gi, x_dtype) if need_x else None, None,
                cast(gw, w_dtype) if need_w else None, cast(gb, b_dtype) if need_b else None,
                None, None, None)


class NormalizedBatchNorm(torch.autograd.Function):
    """Training batch norm that saves the normalized input ``x_hat`` as ``bits``-wide codes
    (the ``actnn_zoo::quantize_uniform`` operator, in memory order) and the exact per-channel
    ``invstd``, in traceable ops: the form :func:`actnn_zoo.compile` traces.

    Why not torch's op there: ``native_batch_norm`` saves the raw input, and a group of values
    spanning channels of very different scales loses the small channels to rounding, which the
    division by their deviation then magnifies (measured at 8 bits on ResNet-50's last stage
    at batch 2: weight-gradient cosine -0.77). Codes made by an operator are saved as they are
    (a float ``x_hat`` could be swapped by the graph's partitioner for the raw input it is
    recomputed from). The backward is linear in ``x_hat`` but for ``x_hat * mean(g * x_hat)``
    (as in the eager Function). Returns ``(y, mean, var)``, the statistics (biased variance)
    for the running averages; only ``y`` has a gradient. ``y`` and the statistics come from
    torch's own kernel (``aten::native_batch_norm``), so the forward is torch's."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Optional[Tensor],  # type: ignore[override]
                bias: Optional[Tensor], eps: float, bits: int,
                group_size: int) -> Tuple[Tensor, Tensor, Tensor]:
        # torch's own kernel for the output and the statistics: the forward is torch's, bit
        # for bit (running averages are updated by the caller)
        y, mean, invstd = torch.ops.aten.native_batch_norm(x, weight, bias, None, None, True,
                                                           0.0, eps)
        shape = [1, x.shape[1]] + [1] * (x.dim() - 2)
        mean, invstd = mean.float().view(shape), invstd.float().view(shape)
        x_hat = (x.float() - mean) * invstd
        var = (invstd.reciprocal() ** 2 - eps).clamp_min(0)
        seed = torch.randint(0, 2 ** 31 - 1, (1,), dtype=torch.int64)
        data, lo, step = ops.quantize_uniform(x_hat.contiguous(), seed, bits, group_size, True)
        ctx.save_for_backward(data, lo, step, invstd, weight)
        ctx.layout = (list(x.shape), bits, group_size, bias is not None, x.dtype)
        mean, var = mean.reshape(-1), var.reshape(-1)
        ctx.mark_non_differentiable(mean, var)
        return y, mean, var

    @staticmethod
    def backward(ctx, grad: Tensor, _mean: Optional[Tensor],  # type: ignore[override]
                 _var: Optional[Tensor]):
        data, lo, step, invstd, weight = ctx.saved_tensors
        shape_x, bits, group_size, has_bias, in_dtype = ctx.layout
        x_hat = ops.dequantize_uniform(data, lo, step, shape_x, bits, group_size, torch.float32)
        dims = [0] + list(range(2, x_hat.dim()))
        shape = [1, x_hat.shape[1]] + [1] * (x_hat.dim() - 2)
        g = grad.float()
        m = g.numel() // x_hat.shape[1]
        grad_b = g.sum(dims)
        grad_w = (g * x_hat).sum(dims)
        scale = invstd if weight is None else invstd * weight.float().view(shape)
        grad_x = scale * (g - (grad_b.view(shape) + x_hat * grad_w.view(shape)) / m)
        gw = grad_w.to(weight.dtype) if weight is not None and ctx.needs_input_grad[1] else None
        gb = grad_b.to(weight.dtype if weight is not None else grad.dtype) \
            if has_bias and ctx.needs_input_grad[2] else None
        return grad_x.to(in_dtype), gw, gb, None, None, None


class NormalizedLayerNorm(torch.autograd.Function):
    """Layer norm that saves the normalized input ``x_hat`` as ``bits``-wide codes
    (``_saving.save_codes``) and the exact per-row ``rstd``, in traceable ops: the form
    ``torch.compile`` traces. The output is ``aten::native_layer_norm``'s (torch's forward);
    the backward is :class:`NormalizedBatchNorm`'s per row: linear in ``x_hat`` but for
    ``x_hat * mean(g * x_hat)``."""

    @staticmethod
    def forward(ctx, x: Tensor, normalized_shape: Tuple[int, ...],  # type: ignore[override]
                weight: Optional[Tensor], bias: Optional[Tensor], eps: float, bits: int,
                group_size: int) -> Tensor:
        y, mean, rstd = torch.ops.aten.native_layer_norm(x, list(normalized_shape), weight,
                                                         bias, eps)
        rstd = rstd.float()
        x_hat = (x.float() - mean.float()) * rstd
        ctx.layout = (len(normalized_shape), x.dtype, bias is not None)
        save_codes(ctx, x_hat, bits, group_size, rstd, *(() if weight is None else (weight,)))
        return y

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        x_hat, saved = load_codes(ctx)
        rstd, weight = saved[0], (saved[1] if len(saved) > 1 else None)
        k, in_dtype, has_bias = ctx.layout
        g = grad.float()
        rows = list(range(g.dim() - k))
        feats = list(range(g.dim() - k, g.dim()))
        gw = None if weight is None else (g * x_hat).sum(rows).to(weight.dtype)
        gb = g.sum(rows).to(grad.dtype if weight is None else weight.dtype) if has_bias else None
        if weight is not None:
            g = g * weight.float()
        gx = rstd * (g - g.mean(feats, keepdim=True)
                     - x_hat * (g * x_hat).mean(feats, keepdim=True))
        need = ctx.needs_input_grad
        return (gx.to(in_dtype) if need[0] else None, None, gw if need[2] else None,
                gb if need[3] else None, None, None, None)
