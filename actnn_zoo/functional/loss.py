"""Cross-entropy losses that never keep the [tokens, classes] log-softmax in fp32.

``F.cross_entropy(logits, target)`` saves the whole log-softmax for backward: for GPT-2 at 4 x
1024 tokens and 50257 classes that is 785 MiB in fp32. The loss's backward does not need the
logits, only dL/dlogits. So in forward, chunk of rows by chunk of rows, we compute the loss
*and* that gradient, and save the gradient compressed. Beyond the input, the peak is a few
(chunk rows x classes) fp32 temporaries.

**What cross_entropy saves.** Take one row (a sample, or a position of an (N, C, d1, ...)
input) with target t. Let w be the class weights (ones when none), e the label smoothing and s
the reduction scale (1 / summed target weight for 'mean', 1 for 'sum' and 'none'). Then::

    dL/dlogits = a q + d onehot(t) - c w        q = softmax(logits) with q_t set to 0
    a = s ((1 - e) w_t + e sum(w) / C),  d = a p_t - s (1 - e) w_t,  c = s e / C

a, d and c are 0 on ignored rows. ``q`` is stored compressed: per-group stochastic rounding at
``qconfig.bits``, 2 by default, one chunk of rows per QuantizedTensor. Also stored, exactly,
per row: the target index, a, d, and c when there is label smoothing. Backward computes
``grad_out * (a q_hat + d onehot(t) - c w)``. That is linear in ``q_hat``, so it is an unbiased
estimate of the exact gradient. ``grad_out`` is a scalar for 'mean'/'sum'. For 'none' it has
one value per row, and the saved quantities are then those of each row's own loss.

Why ``q`` and not the gradient itself: each gradient row has one entry near -1 (the target)
among tiny positives, so that entry sets the 2-bit step of its group of 256. The choice was
made by measurement: 512 rows x 50257 classes, Zipf-like logits plus noise, targets drawn
from the softmax. The table gives the cosine with the exact fp32 dL/dlogits after quantize +
dequantize, mean of 3 draws, at mean loss 4.4 / 2.7 (mean p_t 0.17 / 0.46)::

    bits   gradient compressed   p compressed, target exact   q compressed, p_t exact (chosen)
    2      0.806 / 0.847         0.9996 / 0.9994              0.9998 / 0.9998
    4      0.964 / 0.967         0.99994 / 0.99988            0.99996 / 0.99996
    8      0.99988 / 0.99988     1.0000 / 1.0000              1.0000 / 1.0000

At 2 bits and loss 2.7 the relative errors are 0.63 / 0.033 / 0.021. Removing p_t matters
when the model is confident, because then p_t alone sets its group's step. Through
:func:`cross_entropy` itself (the input gradient, same data) the cosines are 0.99976 / 0.99996
/ 1.00000 at 2 / 4 / 8 bits (loss 6.3), and 0.99978 / 0.99997 / 1.00000 at loss 2.6.

Bytes for N = 4096 rows and C = 50257 classes at 2 bits:
- codes: 4096 x 12565 = 51.5 MB;
- bf16 (lo, step) per group of 256: 3.2 MB;
- index, a and d per row: 64 KiB.
That is 54,759,424 B (52.2 MiB) in all, 1/15.0 of the 823 MB (785 MiB) fp32 log-softmax
torch saves. At 4 bits it is 101 MiB (1/7.7), at 8 bits 199 MiB.

**linear_cross_entropy** computes ``F.cross_entropy(F.linear(x, W, b), target)`` without ever
materialising all the logits. Per chunk of rows it computes the logits, the loss and
dL/dlogits as above (no class weights). In the same forward it accumulates, from
``dL/dlogits = (a q - c) + d onehot(t)``:
- ``dL/dW`` (fp32) += ``(a q - c)^T x`` plus ``d x`` added to row t;
- ``dL/db`` likewise;
- ``u = (a q - c) @ W``, kept for the chunk's rows.
Then ``dL/dx = u + d W[t]``. Saved:
- ``u`` compressed, with rows = tokens, so an ignored token's zeros stay exact and ranges are
  per token;
- the target index and d per token;
- W (the caller's parameter, no copy);
- dL/dW and dL/db as they are. These are parameter-sized: 154 MB in fp32 for GPT-2's tied
  50257 x 768 embedding. That is still 5x less than the log-softmax, and independent of the
  number of tokens.
Backward is ``grad_out * (u_hat + d W[t])`` and ``grad_out * dW``, ``grad_out * db``. The
first is unbiased (linear in u_hat); dW and db are exact. Compressing dL/dx itself would put
the target's embedding -W[t] into every group's range. Measured with the function, W random
(50257 x 768), x = beta W[k] + noise, cosine of dL/dx with exact fp32 at 2 / 4 / 8 bits:
- loss 9.9: 0.9992 / 0.99997 / 1.0000;
- loss 5.9: 0.970 / 0.9988 / 1.0000;
- loss 0.88: 0.909 / 0.9958 / 0.99999.
Compressing dL/dx instead gives 0.79 / 0.988 / 0.9999 in all three. Gradients nobody asked
for (``requires_grad`` off) are not computed.

**Chunks** (``CHUNK_ELEMENTS``, rows x classes; ``chunk_size`` in rows overrides). Times are
for fwd + bwd on this 2-core CPU, median of 5.
- cross_entropy on the CPU: 2**22 values (16 MiB fp32, 83 rows of a 50257 vocabulary). At
  4096 x 50257 it took 0.46 / 0.51 / 0.52 / 0.70 / 1.12 s at 2**20 / 2**21 / 2**22 / 2**23 /
  2**24, and torch's F.cross_entropy 2.35 s. Chunks up to 16 MiB stay in reused heap memory;
  larger ones are mapped afresh and page-fault every time.
- cross_entropy on other devices: 2**24 values, so that there are fewer and larger kernels
  and less Python per row. This is reasoned, not measured: no GPU was available.
- linear_cross_entropy: 2**24 values (333 rows of GPT-2's vocabulary). Each chunk re-reads W
  and rewrites the dL/dW accumulator, so larger chunks are faster. At 2048 x 768 x 50257 it
  took 3.47 / 3.43 / 3.21 / 3.08 s at 2**22 / 2**23 / 2**24 / 2**25, against torch's 3.53 s
  (which holds the logits, the log-softmax and their gradient).

**Semantics** follow ``torch.nn.functional.cross_entropy`` for class-index targets: weights,
ignore_index, reductions with torch's weighted mean, label smoothing. Errors are torch's own:
its shape and option checks run on meta tensors, and target bounds are checked on CPU (on
CUDA the gather asserts on the device, as torch's kernels do). Logits may be float32,
float16 or bfloat16 and are computed in float32. The loss has the input's dtype; under
autocast it is float32, since torch autocasts cross_entropy to float32, and the linear runs
in the autocast dtype.

These go to plain torch, as documented: probability (float) targets; float64 logits (nothing
to gain from compressing what the user asked to keep at that precision); for
``cross_entropy``, calls that need no gradient and ``qconfig.enabled=False``.
``linear_cross_entropy`` with ``qconfig.enabled=False`` saves u uncompressed. With
``reduction='none'`` it raises NotImplementedError: dL/dW = sum_n grad_out_n dlogits_n^T x_n
needs the per-token grad_out, which is known only in backward. Second derivatives are not
saved, so backward with ``create_graph=True`` raises.
"""
from __future__ import annotations

import functools
from typing import Iterator, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..config import LayerQConfig
from ..quant import Bits, SampleBits
from ..quant.api import debug_checks
from ..quant.backend import extension
from ._autocast import autocast_enabled as _autocast_on
from ._autocast import no_autocast as _no_autocast
from ._saving import compress, load, restore, save
from .activation import no_double_backward

__all__ = ["CrossEntropyFunction", "LinearCrossEntropyFunction", "cross_entropy",
           "linear_cross_entropy", "CHUNK_ELEMENTS", "chunk_rows"]

# Values of rows x classes per chunk (see the module docstring, "Chunks"): the elementwise loss
# on the CPU, the elementwise loss elsewhere (GPU: fewer, larger kernels), and the fused linear.
CHUNK_ELEMENTS = {"cpu": 2 ** 22, "other": 2 ** 24, "linear": 2 ** 24}
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_REDUCTIONS = ("none", "mean", "sum")

Block = Tuple[int, int, int, int]  # samples n0:n1, positions s0:s1 of the (N, C, S) view

# CrossEntropyFunction's operators for (rows, classes) float32 logits in one compiled call each
# way (cpp_ext/loss_cpu.cpp); None without the extension or in an older build
_ROWS_FORWARD = getattr(extension(), "cross_entropy_rows_forward", None)
_ROWS_BACKWARD = getattr(extension(), "cross_entropy_rows_backward", None)
_REDUCTION_CODES = {"none": 0, "mean": 1, "sum": 2}


def chunk_rows(classes: int, chunk_size: Optional[int] = None, kind: str = "cpu") -> int:
    """Rows per chunk: ``chunk_size``, or as many as fit in ``CHUNK_ELEMENTS[kind]`` values
    (``kind``: 'cpu', 'other' (another device) or 'linear')."""
    if chunk_size is not None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
        return chunk_size
    return max(1, CHUNK_ELEMENTS[kind] // max(1, classes))


def _blocks(n: int, s: int, rows: int) -> Iterator[Block]:
    """Chunks of about ``rows`` rows of the (N, S) positions: whole samples when a sample has
    at most ``rows`` positions, else pieces of one sample (row r = n * S + s throughout)."""
    if s == 0:
        return
    if s <= rows:
        k = max(1, rows // s)
        for n0 in range(0, n, k):
            yield n0, min(n, n0 + k), 0, s
    else:
        for i in range(n):
            for s0 in range(0, s, rows):
                yield i, i + 1, s0, min(s, s0 + rows)


def _block_rows(x3: Tensor, blk: Block) -> Tensor:
    """The block as (rows, C) (a view for 2-d inputs, a copy of the block otherwise)."""
    n0, n1, s0, s1 = blk
    return x3[n0:n1, :, s0:s1].transpose(1, 2).reshape(-1, x3.shape[1])


def _row_range(blk: Block, s: int) -> Tuple[int, int]:
    n0, n1, s0, s1 = blk
    return n0 * s + s0, (n1 - 1) * s + s1


def _block_bits(bits: Optional[Bits], blk: Block) -> Optional[Bits]:
    """Per-sample widths expanded to the block's rows (a row inherits its sample's width)."""
    if bits is None or isinstance(bits, int):
        return bits
    widths = bits.bits if isinstance(bits, SampleBits) else bits
    n0, n1, s0, s1 = blk
    return widths[n0:n1].repeat_interleave(s1 - s0)


def _token_bits(bits: Optional[Bits], x: Tensor) -> Optional[Bits]:
    """Per-sample widths (one per entry of ``x``'s dim 0) expanded to its tokens (rows of
    ``x.reshape(-1, hidden)``)."""
    if bits is None or isinstance(bits, int) or x.dim() <= 2:
        return bits
    widths = bits.bits if isinstance(bits, SampleBits) else bits
    return widths.repeat_interleave(x.shape[1:-1].numel())


def _check_reduction(reduction: str) -> None:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{reduction} is not a valid value for reduction")


def _targets(target: Tensor, classes: int, ignore_index: int, weight: Optional[Tensor]
             ) -> Tuple[Tensor, Tensor, Tensor]:
    """Per row: the target with ignored rows set to 0 (a safe index), the valid mask, and the
    target's weight (0 on ignored rows), float32.

    An out-of-range target is caught without reading the targets back (a device wait on a
    GPU): the gathers that read the logits and the weight at the target raise on the CPU
    ("index 7 is out of bounds ...") and assert on the device on CUDA, as torch's own kernels
    do. With the debug checks on (``ACTNN_ZOO_DEBUG=1``) the targets are read here and the
    error is torch's own ``IndexError: Target 7 is out of bounds.``"""
    _check_target_dtype(target)
    tf = target.reshape(-1).long()
    valid = tf != ignore_index
    if debug_checks():
        bad = valid & ((tf < 0) | (tf >= classes))
        if bool(bad.any()):
            raise IndexError(f"Target {int(tf[bad][0])} is out of bounds.")
    tt = torch.where(valid, tf, 0)
    if weight is None:
        wt = valid.float()
    else:  # gather, not indexing: a negative target must raise, not wrap around
        wt = torch.where(valid, weight.float().gather(0, tt), 0.0)
    return tt, valid, wt


def _check_target_dtype(target: Tensor) -> None:
    """torch's check of a class-index target's dtype, with its message."""
    if target.dtype not in (torch.int64, torch.uint8):
        raise RuntimeError(f"expected target dtype to be Long or Byte, but got "
                           f"{_dtype_name(target.dtype)}")


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.int32: "Int", torch.int16: "Short", torch.int8: "Char", torch.bool: "Bool",
            torch.float32: "Float", torch.float64: "Double", torch.float16: "Half",
            torch.bfloat16: "BFloat16"}.get(dtype, str(dtype))


def _coefficients(valid: Tensor, wt: Tensor, wsum: Tensor, classes: int, reduction: str,
                  smoothing: float) -> Tuple[Tensor, Tensor, Optional[Tensor], Tensor]:
    """Per row a, b, c of ``dL/dlogits = a p - b onehot(t) - c w`` (see the module docstring)
    and the denominator of 'mean' (torch's: the summed weight of the non-ignored targets)."""
    den = wt.sum()
    s = 1.0 / den if reduction == "mean" else torch.ones((), device=wt.device)
    e = smoothing
    a = torch.where(valid, s * ((1.0 - e) * wt + (e / classes) * wsum), 0.0)
    b = torch.where(valid, s * (1.0 - e) * wt, 0.0)
    c = torch.where(valid, s * (e / classes), 0.0) if e > 0 else None
    return a, b, c, den


def _row_losses(xb: Tensor, tt: Tensor, wt: Tensor, valid: Tensor, wf: Optional[Tensor],
                wsum: Tensor, smoothing: float, classes: int) -> Tuple[Tensor, Tensor]:
    """Per-row loss of a float32 (rows, C) block, and its log-sum-exp."""
    lse = torch.logsumexp(xb, 1)
    nll = lse - xb.gather(1, tt[:, None]).squeeze(1)
    loss = (1.0 - smoothing) * wt * nll
    if smoothing > 0:  # -sum_c w_c log p_c = sum(w) lse - sum_c w_c x_c
        wx = xb.sum(1) if wf is None else xb.matmul(wf)
        loss = loss + torch.where(valid, (smoothing / classes) * (wsum * lse - wx), 0.0)
    return loss, lse


def _reduce(rows: Tensor, den: Tensor, reduction: str, out_shape: torch.Size) -> Tensor:
    if reduction == "none":
        return rows.reshape(out_shape)
    total = rows.sum()
    return total / den if reduction == "mean" else total


def _shape(t: Optional[Tensor]) -> Optional[Tuple[int, ...]]:
    return None if t is None else tuple(t.shape)


@functools.lru_cache(maxsize=256)
def _checked_loss_shape(input_shape: Tuple[int, ...], compute: torch.dtype,
                        target_shape: Tuple[int, ...], weight_shape: Optional[Tuple[int, ...]],
                        ignore_index: int, reduction: str, label_smoothing: float
                        ) -> torch.Size:
    """The output shape of ``F.cross_entropy`` for arguments of these shapes, after torch's own
    shape and option checks, run on meta tensors (the target as int64: torch's meta kernels take
    no uint8 index). Remembered per argument set: the meta call runs Python decompositions
    (~1 ms, as long as a small model's whole step), and a training loop repeats one set; a set
    that fails raises every time (exceptions are not cached)."""
    def meta(shape: Optional[Tuple[int, ...]], dtype: torch.dtype) -> Optional[Tensor]:
        return None if shape is None else torch.empty(shape, dtype=dtype, device="meta")

    return F.cross_entropy(meta(input_shape, compute), meta(target_shape, torch.int64),
                           meta(weight_shape, compute), ignore_index=ignore_index,
                           reduction=reduction, label_smoothing=label_smoothing).shape


def _check_loss(input_shape: Tuple[int, ...], compute: torch.dtype,
                target_shape: Tuple[int, ...], weight_shape: Optional[Tuple[int, ...]],
                ignore_index: int, reduction: object, label_smoothing: float) -> torch.Size:
    """:func:`_checked_loss_shape`, remembered only for a string ``reduction``: any other value
    is unhashable or wrong, and torch's own check must name it."""
    check = _checked_loss_shape if isinstance(reduction, str) else _checked_loss_shape.__wrapped__
    return check(input_shape, compute, target_shape, weight_shape, ignore_index, reduction,
                 label_smoothing)


# ----------------------------------------------------------------------------------------------
# cross_entropy
# ----------------------------------------------------------------------------------------------
class CrossEntropyFunction(torch.autograd.Function):
    """Cross-entropy over class dim 1 saving the compressed softmax (its target entry removed)
    and exact per-row coefficients; see the module docstring. Inputs are validated by
    :func:`cross_entropy`."""

    @staticmethod
    def forward(ctx, x: Tensor, target: Tensor, weight: Optional[Tensor], ignore_index: int,
                reduction: str, label_smoothing: float, out_shape: torch.Size,
                out_dtype: torch.dtype, qconfig: LayerQConfig, bits: Optional[Bits],
                chunk_size: Optional[int]) -> Tensor:
        if _rows_compiled(x, weight, label_smoothing, chunk_size):
            return _rows_forward(ctx, x, target, ignore_index, reduction, out_shape, out_dtype,
                                 qconfig, bits)
        ctx.compiled = False
        with _no_autocast(x):
            if x.dim() == 1:
                x3 = x.reshape(1, -1, 1)
            elif x.dim() == 2:
                x3 = x.unsqueeze(2)
            else:
                x3 = x.reshape(x.shape[0], x.shape[1], x.shape[2:].numel())
            n, classes, s = x3.shape
            tt, valid, wt = _targets(target, classes, ignore_index, weight)
            wf = None if weight is None else weight.float()
            wsum = torch.full((), float(classes), device=x.device) if wf is None else wf.sum()
            e = float(label_smoothing)
            a, b, c, den = _coefficients(valid, wt, wsum, classes, reduction, e)
            need_grad = ctx.needs_input_grad[0]
            loss_rows = torch.empty(n * s, dtype=torch.float32, device=x.device)
            d = torch.empty_like(loss_rows) if need_grad else None
            kind = "cpu" if x.device.type == "cpu" else "other"
            blocks = list(_blocks(n, s, chunk_rows(classes, chunk_size, kind)))
            payloads = []
            for blk in blocks:
                r0, r1 = _row_range(blk, s)
                block = _block_rows(x3, blk)
                xb = block.float()
                loss, lse = _row_losses(xb, tt[r0:r1], wt[r0:r1], valid[r0:r1], wf, wsum, e,
                                        classes)
                loss_rows[r0:r1] = loss
                if not need_grad:
                    continue
                if xb.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
                    p = xb - lse[:, None]  # xb is the caller's tensor: do not overwrite it
                else:
                    p = xb.sub_(lse[:, None])
                del xb, block
                p.exp_()
                idx = tt[r0:r1, None]
                pt = p.gather(1, idx).squeeze(1)
                p.scatter_(1, idx, 0.0)
                d[r0:r1] = a[r0:r1] * pt - b[r0:r1]
                payloads.append(compress(p, qconfig, _block_bits(bits, blk)))
                del p
            out = _reduce(loss_rows, den, reduction, out_shape).to(out_dtype)
        ctx.layout = (x.shape, x.dtype, x3.shape, blocks, reduction, e > 0)
        if need_grad:
            save(ctx, tt, a, d, c, weight if e > 0 else None, *payloads)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        no_double_backward("cross_entropy")
        if ctx.needs_input_grad[2]:
            raise RuntimeError("the derivative for 'weight' is not implemented")
        if ctx.compiled:
            tt, a, d, payload = load(ctx)
            gx = _ROWS_BACKWARD(restore(payload), tt, a, d, grad, ctx.reduction_code)
            return (gx,) + (None,) * 10
        shape, dtype, (n, classes, s), blocks, reduction, smoothing = ctx.layout
        tt, a, d, c, weight, *payloads = load(ctx)
        g = grad.float().reshape(-1) if reduction == "none" else grad.float()
        wf = None if weight is None else weight.float()
        grad3 = torch.empty((n, classes, s), dtype=dtype, device=grad.device)
        for blk, q in zip(blocks, payloads):
            r0, r1 = _row_range(blk, s)
            gr = g[r0:r1] if reduction == "none" else g
            out = restore(q)
            out.mul_((a[r0:r1] * gr)[:, None])
            out.scatter_add_(1, tt[r0:r1, None], (d[r0:r1] * gr)[:, None])
            if smoothing:
                gc = (c[r0:r1] * gr)[:, None]
                if wf is None:
                    out.sub_(gc)
                else:
                    out.addcmul_(gc, wf[None, :], value=-1.0)
            n0, n1, s0, s1 = blk
            grad3[n0:n1, :, s0:s1].copy_(out.view(n1 - n0, s1 - s0, classes).transpose(1, 2))
            del out
        return (grad3.reshape(shape),) + (None,) * 10


def _rows_compiled(x: Tensor, weight: Optional[Tensor], label_smoothing: float,
                   chunk_size: Optional[int]) -> bool:
    """Whether the forward and backward run as one compiled call each (cpp_ext/loss_cpu.cpp):
    contiguous, nonempty float32 (rows, classes) logits on the CPU, no class weights, no
    smoothing, one chunk of rows, no autocast, and the targets not read for the debug checks.
    The calls run the Python path's operators on the same tensors: the same loss, codes and
    gradient."""
    return (_ROWS_FORWARD is not None and x.dim() == 2 and x.dtype == torch.float32
            and x.device.type == "cpu" and x.is_contiguous() and x.numel() > 0
            and weight is None and label_smoothing == 0.0 and not _autocast_on(x)
            and not debug_checks() and x.shape[0] <= chunk_rows(x.shape[1], chunk_size, "cpu"))


def _rows_forward(ctx, x: Tensor, target: Tensor, ignore_index: int, reduction: str,
                  out_shape: torch.Size, out_dtype: torch.dtype, qconfig: LayerQConfig,
                  bits: Optional[Bits]) -> Tensor:
    """CrossEntropyFunction.forward through ``_ROWS_FORWARD``; saves (tt, a, d, codes of q)."""
    _check_target_dtype(target)
    need_grad = ctx.needs_input_grad[0]
    ctx.compiled = True
    ctx.reduction_code = _REDUCTION_CODES[reduction]
    loss, tt, a, d, q = _ROWS_FORWARD(x, target, ignore_index, ctx.reduction_code, need_grad)
    if need_grad:
        save(ctx, tt, a, d, compress(q, qconfig, _block_bits(bits, (0, x.shape[0], 0, 1))))
    if reduction == "none":
        loss = loss.reshape(out_shape)
    return loss.to(out_dtype)


def cross_entropy(input: Tensor, target: Tensor, weight: Optional[Tensor] = None,
                  ignore_index: int = -100, reduction: str = "mean",
                  label_smoothing: float = 0.0, *, qconfig: Optional[LayerQConfig] = None,
                  bits: Optional[Bits] = None, chunk_size: Optional[int] = None) -> Tensor:
    """``F.cross_entropy`` (class-index targets) saving the compressed softmax, not the fp32
    log-softmax. ``bits`` overrides ``qconfig.bits`` (an int, or one width per sample of dim
    0); ``chunk_size``: rows (positions) per chunk, default :func:`chunk_rows`.

    Probability (float) targets, float64 or non-float logits, ``qconfig.enabled=False`` and
    calls that need no gradient go to ``F.cross_entropy`` itself.
    """
    qconfig = LayerQConfig() if qconfig is None else qconfig
    plain = (not isinstance(input, Tensor) or not isinstance(target, Tensor)
             or input.dtype not in _FLOATS or target.dtype.is_floating_point
             or not qconfig.enabled or input.dim() == 0
             or not (torch.is_grad_enabled() and input.requires_grad))
    if plain:
        return F.cross_entropy(input, target, weight, ignore_index=ignore_index,
                               reduction=reduction, label_smoothing=label_smoothing)
    _check_reduction(reduction)
    autocast = _autocast_on(input)
    compute = torch.float32 if autocast else input.dtype
    classes = input.shape[1] if input.dim() >= 2 else input.shape[0]
    if weight is not None:
        if weight.dim() != 1 or weight.numel() != classes:
            raise RuntimeError(f"weight tensor should be defined either for all {classes} "
                               f"classes or no classes but got weight tensor of shape: "
                               f"{list(weight.shape)}")
        wdt = torch.float32 if autocast and weight.dtype in _FLOATS else weight.dtype
        if wdt != compute:
            raise RuntimeError(f"expected scalar type {_dtype_name(compute)} but found "
                               f"{_dtype_name(wdt)}")
        if weight.device != input.device:
            raise RuntimeError(f"Expected all tensors to be on the same device, but found at "
                               f"least two devices, {input.device} and {weight.device}!")
        if weight.requires_grad and torch.is_grad_enabled():
            raise RuntimeError("The function 'nll_loss_forward' is not differentiable with "
                               "respect to argument 'weight'. This input cannot have "
                               "requires_grad True.")
    if target.device != input.device:
        raise RuntimeError(f"Expected all tensors to be on the same device, but found at "
                           f"least two devices, {input.device} and {target.device}!")
    # torch's own shape / option checks (and the output shape of 'none'), on meta tensors
    # (the target as int64: torch's meta kernels take no uint8 index; its dtype is checked
    # in forward)
    out_shape = _check_loss(tuple(input.shape), compute, tuple(target.shape), _shape(weight),
                            int(ignore_index), reduction, float(label_smoothing))
    return CrossEntropyFunction.apply(input, target, weight, int(ignore_index), reduction,
                                      float(label_smoothing), out_shape, compute, qconfig, bits,
                                      chunk_size)


# ----------------------------------------------------------------------------------------------
# linear_cross_entropy
# ----------------------------------------------------------------------------------------------
class LinearCrossEntropyFunction(torch.autograd.Function):
    """``cross_entropy(linear(x, W, b), target)`` in row chunks, gradients computed in forward:
    saves compressed dL/dx and exact dL/dW, dL/db; see the module docstring."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor,
                ignore_index: int, reduction: str, label_smoothing: float,
                chunk_size: Optional[int], compute: torch.dtype, out_dtype: torch.dtype,
                qconfig: LayerQConfig, bits: Optional[Bits], grad_mode: bool) -> Tensor:
        # needs_input_grad reflects requires_grad even under no_grad: check the mode too
        need_x, need_w, need_b = (grad_mode and need for need in ctx.needs_input_grad[:3])
        need_b = need_b and bias is not None
        with _no_autocast(x):
            hidden = weight.shape[1]
            classes = weight.shape[0]
            x2 = x.reshape(-1, hidden)
            n = x2.shape[0]
            tt, valid, wt = _targets(target, classes, ignore_index, None)
            wsum = torch.full((), float(classes), device=x.device)
            e = float(label_smoothing)
            a, b, c, den = _coefficients(valid, wt, wsum, classes, reduction, e)
            wd = weight.to(compute)
            bd = None if bias is None else bias.to(compute)
            loss_rows = torch.empty(n, dtype=torch.float32, device=x.device)
            # u = (a q - c) @ W, the part of dL/dx that is compressed; d: the target's entry
            u = torch.empty((n, hidden), dtype=compute, device=x.device) if need_x else None
            d = torch.zeros(n, dtype=torch.float32, device=x.device)
            dw = torch.zeros((classes, hidden), dtype=torch.float32, device=x.device) \
                if need_w else None
            db = torch.zeros(classes, dtype=torch.float32, device=x.device) if need_b else None
            rows = chunk_rows(classes, chunk_size, "linear")
            for r0 in range(0, n, rows):
                r1 = min(n, r0 + rows)
                xc = x2[r0:r1].to(compute)
                logits = F.linear(xc, wd, bd).float()  # ours: updated in place below
                loss, lse = _row_losses(logits, tt[r0:r1], wt[r0:r1], valid[r0:r1], None,
                                        wsum, e, classes)
                loss_rows[r0:r1] = loss
                if not (need_x or need_w or need_b):
                    continue
                # dL/dlogits = (a q - c) + d onehot(t), q = p with its target entry set to 0
                idx = tt[r0:r1, None]
                gl = logits.sub_(lse[:, None]).exp_()
                dc = a[r0:r1] * gl.gather(1, idx).squeeze(1) - b[r0:r1]
                d[r0:r1] = dc
                gl.scatter_(1, idx, 0.0)
                gl.mul_(a[r0:r1, None])
                if c is not None:
                    gl.sub_(c[r0:r1, None])
                if need_b:
                    db.add_(gl.sum(0))
                    db.index_add_(0, tt[r0:r1], dc)
                gd = gl.to(compute)
                if need_x:
                    torch.mm(gd, wd, out=u[r0:r1])
                if need_w:
                    if compute == torch.float32:
                        dw.addmm_(gd.t(), xc)
                    else:  # matmul in the compute dtype (as torch), accumulated in fp32
                        dw.add_(gd.t().mm(xc))
                    dw.index_add_(0, tt[r0:r1], dc[:, None] * xc.float())
                del logits, gl, gd
            out = _reduce(loss_rows, den, reduction, torch.Size(())).to(out_dtype)
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.x_shape = x.shape
        saved_u = None
        if need_x:  # rows = tokens: an ignored token's zeros stay exact, ranges are per token
            saved_u = compress(u, qconfig, _token_bits(bits, x)) if qconfig.enabled else u
        save(ctx, saved_u, tt if need_x else None, d if need_x else None,
             weight if need_x else None, None if dw is None else dw.to(weight.dtype),
             None if db is None else db.to(bias.dtype))
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        no_double_backward("linear_cross_entropy")
        u, tt, d, weight, dw, db = load(ctx)
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        gx = gw = gb = None
        if u is not None:
            gx = restore(u).reshape(tt.shape[0], weight.shape[1]).float()
            gx.addcmul_(d[:, None], weight[tt].float())  # + d W[t], exact
            gx = gx.mul_(grad.float()).reshape(ctx.x_shape).to(x_dtype)
        if dw is not None:
            gw = dw * grad.to(dw.dtype)
        if db is not None:
            gb = db * grad.to(db.dtype)
        return (gx, gw, gb) + (None,) * 10


def linear_cross_entropy(x: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor,
                         ignore_index: int = -100, reduction: str = "mean",
                         label_smoothing: float = 0.0, chunk_size: Optional[int] = None, *,
                         qconfig: Optional[LayerQConfig] = None,
                         bits: Optional[Bits] = None) -> Tensor:
    """The loss of ``F.cross_entropy(F.linear(x, weight, bias), target, ...)`` without all the
    logits ever existing at once: ``chunk_size`` rows at a time (default :func:`chunk_rows`).

    ``x``: (..., hidden) with ``target`` of shape ``x.shape[:-1]``; the classes are the
    linear's outputs (for 2-d ``x`` exactly the expression above; for more dims the one with
    the logits flattened to (tokens, classes)). Reduction 'mean' or 'sum' ('none' raises
    NotImplementedError). ``bits``: an int, or one width per sample of ``x``'s dim 0. Float64
    and probability (float) targets go to plain torch, logits and all.
    """
    qconfig = LayerQConfig() if qconfig is None else qconfig
    _check_reduction(reduction)
    if reduction == "none":
        raise NotImplementedError(
            "linear_cross_entropy: reduction='none' is not supported: the weight gradient "
            "sum_n grad_out_n * dlogits_n^T x_n needs the per-token grad_out, known only in "
            "backward, so forward could not accumulate it without saving [tokens, classes] "
            "gradients; use cross_entropy(F.linear(...), reduction='none') instead")
    if weight.dim() != 2:
        raise RuntimeError(f"linear_cross_entropy: weight must be 2-d (classes, hidden), got "
                           f"shape {list(weight.shape)}")
    if x.dim() == 0:
        raise RuntimeError("linear_cross_entropy: x must have at least one dimension")
    # torch's own dtype / device / shape checks of the linear, on one row (and its autocast)
    with torch.no_grad():
        probe = F.linear(x.reshape(-1, x.shape[-1])[:1], weight, bias)
    if x.dtype == torch.float64 or probe.dtype not in _FLOATS or target.dtype.is_floating_point:
        logits = F.linear(x, weight, bias)  # plain torch: float64, or probability targets
        flat = target.reshape(-1, target.shape[-1]) if target.dtype.is_floating_point \
            else target.reshape(-1)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), flat,
                               ignore_index=ignore_index, reduction=reduction,
                               label_smoothing=label_smoothing)
    compute = probe.dtype
    out_dtype = torch.float32 if _autocast_on(x) else compute
    if tuple(target.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"linear_cross_entropy: target shape {list(target.shape)} does not "
                         f"match x's leading dims {list(x.shape[:-1])}")
    if target.device != x.device:
        raise RuntimeError(f"Expected all tensors to be on the same device, but found at "
                           f"least two devices, {x.device} and {target.device}!")
    rows = x.shape[:-1].numel()
    _check_loss((rows, weight.shape[0]), torch.float32, (target.numel(),), None,
                int(ignore_index), reduction, float(label_smoothing))  # torch's checks
    chunk_rows(weight.shape[0], chunk_size)  # validates chunk_size
    return LinearCrossEntropyFunction.apply(x, weight, bias, target, int(ignore_index),
                                            reduction, float(label_smoothing), chunk_size,
                                            compute, out_dtype, qconfig, bits,
                                            torch.is_grad_enabled())
