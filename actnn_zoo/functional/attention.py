"""Scaled-dot-product attention that never saves (or holds) the L x S attention matrix.

torch's math path for ``F.scaled_dot_product_attention`` saves the probabilities, ``L x S``
values per head. This Function saves compressed ``q``, ``k`` and ``v`` only, and recomputes
the probabilities tile by tile in backward, with public torch ops only, so the same code runs
on CPU and CUDA:

* **Forward** walks over tiles of (flattened batch x query rows), whole rows of ``S`` keys,
  at most :data:`BLOCK_ELEMENTS` scores per tile on the CPU, :data:`DEVICE_BLOCK_SCALE` times
  that off it (at least one row), in float32 (float64 for float64 inputs): scores, scale,
  mask / causal, softmax, dropout, ``P @ v``. The peak is one tile of scores plus its
  temporaries, never ``L x S`` per head.
* **Saved** (through :func:`~actnn_zoo.functional._saving.save`): ``compress(q)``,
  ``compress(k)`` and, when ``q``, ``k`` or the mask needs a gradient, ``compress(v)``
  (``qconfig.bits``, stochastic rounding; float64 inputs are compressed as float32, since
  quantization holds up to float32 and its own error dwarfs the cast). With dropout, one int
  seed on ``ctx``. Nothing with ``L x S`` elements is saved. At B=2, H=4, L=S=512, E=64 and
  2 bits that is 3 x 69,632 = 208,896 bytes (the test checks it), against 8 MiB for the
  float32 probabilities alone.
* The attention mask is the caller's tensor: it is kept by reference on ``ctx`` (not copied,
  not packed, not handed to saved-tensor hooks, so ``save_on_cpu`` never duplicates an
  expanded mask); changing it in place before backward raises, as autograd does for saved
  tensors. A **boolean mask** is therefore held at one byte per element for as long as the
  graph lives, as the caller's own tensor; when it is a causal mask built per call,
  ``is_causal=True`` costs nothing instead.
* **Backward** is the exact gradient of attention at the dequantized ``q_hat, k_hat, v_hat``
  (and the same dropout mask): per tile, ``P = softmax(q_hat k_hat^T * scale + mask)``
  recomputed and normalized over its whole row, ``dV += (P*M)^T dO``, ``dP = dO v_hat^T * M``,
  ``D = rowsum(P * dP)``, ``dS = P * (dP - D)``, ``dQ = dS k_hat * scale``,
  ``dK += dS^T q_hat * scale`` and, for a learned mask, ``dMask += dS`` summed over the
  mask's broadcast dims.

Why not FlashAttention's saved set (``q, k, v``, output ``o`` and the log-sum-exp)? Its
backward needs ``lse`` and ``o`` because it also tiles over keys; here every tile holds whole
rows, and with *compressed* ``q, k`` both hurt. ``exp(q_hat k_hat^T - lse)`` is not normalized:
the rounding noise of the scores enters as ``E[exp(noise)] > 1`` (about ``exp(sigma^2/2)``, a
factor of ~2 at 2 bits, heavy-tailed). Measured at the shapes of ``test_2bit_bias_floor``:
the relative error of the mean of 256 compressed 2-bit dQ was 1.96 with the saved ``lse``,
0.26 renormalized (4 bits: 0.040 vs 0.021). ``D = rowsum(dO * o_hat)`` from a saved output
instead of ``rowsum(P * dP)`` gave a 1.35x larger one-pass error at 2 bits (2.6-2.9 vs
1.9-2.1 x the gradient norm over two seeds and two shapes; 1.1x at 4 bits) for a slightly lower
floor of the mean (0.21-0.25 vs 0.25-0.28), and costs a fourth compressed tensor. A training
step sees one pass, so neither is saved; the per-row log-sum-exp would be an exact float32
statistic worth keeping only for a key-tiled backward.

**Bias.** ``dQ`` and ``dK`` are linear in the saved ``v``, and ``dV`` does not read it, but
all three depend on ``q_hat, k_hat`` through the softmax, and ``E[softmax(s + noise)] !=
softmax(s)``: averaging compressed backward passes converges to a biased gradient. At 2 bits
the stochastic rounding noise of a 256-value group is about 0.8 of a unit-variance input's
scale, so the scores' noise exceeds their spread. ``test_2bit_bias_floor`` (B=1, H=2,
L=S=64, E=32, unit-normal q, k, v, a fixed dO; relative error ``||g - exact|| / ||exact||``
of dQ / dK / dV; the mean of K=256 passes against the 1/sqrt(K) an unbiased estimate would
reach; bias estimated as ``sqrt(e256^2 - e1^2 / 256)``):

====== ==================== ==================== ==================== ==================
 bits   one pass             mean of 256          1/sqrt(256) would be  bias (estimated)
====== ==================== ==================== ==================== ==================
 2      2.07 / 2.18 / 1.30   0.25 / 0.26 / 0.16   0.13 / 0.14 / 0.08    0.21 / 0.22 / 0.14
 4      0.31 / 0.31 / 0.21   0.021/ 0.022/ 0.015  0.019/ 0.020/ 0.013   ~0.008
 8      0.018/ 0.018/ 0.012  0.001                0.001                 not measurable
====== ==================== ==================== ==================== ==================

So at 2 bits one backward pass carries about twice the gradient's norm of noise in dQ and dK
and the bias floor is about a fifth of the gradient: attention is the place to spend more
bits (4 bits: 0.3 per pass, bias < 0.01). At 8 bits the gradient cosine against exact
autograd is about 0.99985 for dQ, dK (three independently rounded inputs, ~1% noise each),
0.9999 for dV, and 0.99992 with round-to-nearest.

**Dropout** (``dropout_p > 0``): the keep-mask is a counter-based hash of (seed, flat batch
index, query row, key column) compared with ``(1 - p) 2^32`` (:func:`attention_dropout_mask`),
so it is the same in forward and backward, independent of the tile size and identical on CPU
and CUDA. The seed is one int drawn from torch's default CPU generator (as the quantizer's
seeds are), so ``torch.manual_seed`` reproduces it. The stream is not torch's: with the same
generator state torch's SDPA drops other entries. As in torch, dropout applies whenever
``dropout_p > 0`` (SDPA has no training flag); ``dropout_p <= 0`` means none and
``dropout_p == 1`` zeros the output.

**Cost** (2 CPU threads, B=2, H=4, T=512, E=64, forward + backward, median of interleaved
runs): 15 ms against 11.4 ms for torch's fused CPU kernel (which keeps q, k, v, output and
log-sum-exp in float32), causal alike (a causal row tile reads only the keys up to its last
row); with dropout 21 ms against 26.5 ms (torch's CPU dropout takes the math path and saves
the probabilities). Peak above the inputs for one step at B=1, H=8, T=2048, causal (fresh
process, VmHWM): ~90 MiB, torch's fused kernel ~63 MiB, the math path ~570 MiB.

**Learned additive masks** (a float ``attn_mask`` that requires grad: T5's relative position
bias, ALiBi-style learned slopes): the mask is added to the scaled scores, so its gradient is
``dS`` itself, summed over the dims the mask is broadcast along (a missing or size-1 leading
dim, a size-1 row or key dim). Each row tile's ``dS`` (already computed for ``dQ``, ``dK``) is
reduced into a float32 buffer of the mask's own shape and dropped, so backward's peak grows by
that buffer only (the gradient autograd needs anyway) and nothing more is saved: the mask is
held by reference as any mask is, ``v`` is saved compressed as it is for ``dQ``, and no
probabilities or ``dS`` are kept. A stride-0 (expanded) mask gets a gradient of its expanded
shape, as autograd defines it; the expand's own backward sums it. Like ``dQ`` and ``dK``, the
mask's gradient depends on ``q_hat, k_hat`` through the softmax, so it carries the same bias
at 2 bits (measured in ``test_2bit_mask_gradient_bias``: about 0.2 of the gradient's norm at
2 bits, < 0.02 at 4); only ``v_hat`` enters linearly.

Second derivatives (``create_graph=True``) raise. Without anything to differentiate
(``no_grad``, or none of ``q, k, v`` and the mask requires grad) or with
``qconfig.enabled=False``, :func:`scaled_dot_product_attention` is torch's own op.
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .._torch_private import tensor_version
from ..config import LayerQConfig
from ..quant import Bits
from ..quant.api import draw_seed
from ..quant.backend import extension, kernels
from ..quant.hash32 import fmix32_int as _fmix32_int
from ..quant.hash32 import fmix32_int32_ as _fmix32_  # int32, in place: ~4x int64's speed
from ._autocast import no_autocast as _no_autocast
from ._saving import compress, keep_saved, load, restore, save
from .activation import no_double_backward
from .linear import cast, payload_codes

__all__ = ["ScaledDotProductAttentionFunction", "scaled_dot_product_attention",
           "attention_dropout_mask", "BLOCK_ELEMENTS"]

# Scores per tile (flattened batch x query rows x keys): 2^20 float32 = 4 MiB. Forward holds
# one or two tiles of float32 temporaries, backward about three; dropout adds two int32 tiles
# while a tile's mask is drawn.
BLOCK_ELEMENTS = 1 << 20
# Off the CPU tiles are this many times larger (32 MiB of scores). Each tile costs host work (its
# Python, a few dozen kernel launches) that on a GPU outweighs a 4 MiB tile's kernels: GPT-2
# small at batch 4, sequence 1024 made 48 tiles per layer (576 a step, each forward and
# backward) and its step ran 13x fp32's on an H200, 1.13 s over it (docs/results.md, GPU);
# 6 per layer at this size. Larger would cut host work further but add to the step's peak
# (backward holds about three tiles).
DEVICE_BLOCK_SCALE = 8

_EXP_FLOOR = {torch.float32: -87.0, torch.float64: -708.0}  # exp() still a normal number

# The whole forward and backward of a call that one tile holds, one compiled call each on the
# CPU (cpp_ext/attention_dropout_cpu.cpp: the tile loop's ops in its order); None without the
# extension or in an older build.
_WHOLE_FORWARD = getattr(extension(), "attention_whole_forward", None)
_WHOLE_BACKWARD = getattr(extension(), "attention_whole_backward", None)
# The whole call as one compiled autograd node (cpp_ext/qlayers.cpp): see _attention_node
_QATTENTION = getattr(extension(), "qattention", None)

_M32 = 0xFFFFFFFF
_I32_MIN = -(1 << 31)


# ----------------------------------------------------------------------------------------------
# Dropout: a counter-based hash, the same for any tiling and on any device
# ----------------------------------------------------------------------------------------------
def _as_int32(x: Tensor) -> Tensor:
    """int64 values in [0, 2^32) -> int32 tensors with the same 32 bits."""
    return torch.where(x >= (1 << 31), x - (1 << 32), x).to(torch.int32)


class _Dropout:
    """The keep-mask of one call. Element (n, l, j) of the (N, L, S) scores, with row index
    ``r = n L + l``, is kept when, as unsigned 32-bit values,
    ``fmix32(fmix32(fmix32((r mod 2^32) ^ s2) ^ (r >> 32)) ^ fmix32(j ^ s1)) < (1 - p) 2^32``
    (``s1, s2`` mixed from the seed). The row and column hashes are bijections of their index,
    so within a row no two keys share their random bits; the outer fmix32 breaks the xor's
    structure between rows."""

    def __init__(self, seed: int, p: float, L: int, S: int, device: torch.device,
                 batch: Optional[int] = None) -> None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # the seed is a host int: a CUDA graph would replay one mask on every step
            raise RuntimeError(
                "actnn_zoo scaled_dot_product_attention: dropout cannot be captured into a CUDA "
                "graph: its seed is drawn on the host, so every replay would drop the same "
                "entries. Use torch.compile without CUDA graphs (mode=\"default\") or "
                "dropout_p=0.")
        self.L, self.S = L, S
        # kept when the unsigned hash < threshold; compared as signed after flipping the sign
        # bit (p > 0 here, so threshold <= 2^32 - 1 and threshold - 2^31 fits in int32)
        self.threshold = min((1 << 32) - 1, max(0, int(round((1.0 - p) * 2.0 ** 32))))
        self.signed_threshold = self.threshold - (1 << 31)
        self.scale = 1.0 / (1.0 - p) if p < 1.0 else 0.0
        self.s1 = _fmix32_int(seed ^ 0x9E3779B9)
        self.s2 = _fmix32_int(seed ^ 0x68E31DA4)
        # One compiled call per tile, on the CPU and in a CUDA build on CUDA (the torch
        # program below costs ~15-20 small ops of dispatch per tile); the meta device's
        # shape-only stand-in; without the kernel, the torch program.
        self._kernel = getattr(kernels(device), "attention_keep", None)
        self._device = device
        self._col: Optional[Tensor] = None
        # batch: the call's flattened batch size N, when known. The torch program then hashes
        # every row of the call once (N * L int32s) and each tile slices them: ~40 of a tile's
        # ~60 small operators are the rows' hashes, which on a GPU is host work per tile.
        self._batch = batch
        self._rows: Optional[Tensor] = None

    @property
    def col(self) -> Tensor:
        """The column hashes ``fmix32(j ^ s1)`` as int32 (the torch program's)."""
        if self._col is None:
            col = torch.arange(self.S, dtype=torch.int64, device=self._device) ^ self.s1
            self._col = _fmix32_(_as_int32(col))
        return self._col

    @property
    def compiled(self) -> bool:
        """Whether :meth:`keep` runs a compiled kernel (the extension's, on the CPU or CUDA)."""
        return self._kernel is not None

    def keep(self, n0: int, n1: int, r0: int, r1: int, cols: Optional[int] = None) -> Tensor:
        """Bool (n1 - n0, r1 - r0, cols): which probabilities of the tile (keys below ``cols``,
        default all) survive."""
        if self._kernel is not None:
            return self._kernel(n0, n1, r0, r1, self.S if cols is None else cols, self.L,
                                self.s1, self.s2, self.threshold, self._device)
        return self.keep_torch(n0, n1, r0, r1, cols)

    def keep_torch(self, n0: int, n1: int, r0: int, r1: int,
                   cols: Optional[int] = None) -> Tensor:
        """:meth:`keep` as a torch program (any device; the compiled kernel's twin)."""
        if self._batch is not None and n1 <= self._batch:
            if self._rows is None:
                self._rows = self._row_hashes(0, self._batch, 0, self.L)
            h = self._rows[n0:n1, r0:r1]
        else:
            h = self._row_hashes(n0, n1, r0, r1)
        x = h[..., None] ^ self.col[:cols]  # (nb, c, cols)
        _fmix32_(x)
        x ^= _I32_MIN  # unsigned order -> signed order
        return x < self.signed_threshold

    def release(self) -> None:
        """Forget the call's row hashes (a tensor of N * L int32s), e.g. between forward and
        backward; the next tile makes them again."""
        self._rows = None

    def _row_hashes(self, n0: int, n1: int, r0: int, r1: int) -> Tensor:
        """int32 (n1 - n0, r1 - r0): the hashes of rows ``n L + l`` (the mask's row part)."""
        dev = self.col.device
        rows = (torch.arange(n0, n1, dtype=torch.int64, device=dev)[:, None] * self.L
                + torch.arange(r0, r1, dtype=torch.int64, device=dev)[None, :])
        h = _fmix32_(_as_int32((rows & _M32) ^ self.s2))
        return _fmix32_(h ^ _as_int32(rows >> 32))


def attention_dropout_mask(seed: int, batch_shape: Sequence[int], L: int, S: int, p: float,
                           device: Optional[torch.device] = None) -> Tensor:
    """The keep-mask (bool, ``(*batch_shape, L, S)``) that :func:`scaled_dot_product_attention`
    uses for dropout probability ``p`` and ``seed``; ``batch_shape`` is the output's batch
    shape (all dims but the last two). For tests and for reproducing a step by hand."""
    n = math.prod(batch_shape)
    drop = _Dropout(int(seed), float(p), L, S, torch.device("cpu") if device is None else device)
    return drop.keep(0, n, 0, L).reshape(*batch_shape, L, S)


# ----------------------------------------------------------------------------------------------
# Checks (torch's messages where torch has one)
# ----------------------------------------------------------------------------------------------
def _check_inputs(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor],
                  mask_dtype: Optional[torch.dtype], dropout_p: float, is_causal: bool,
                  enable_gqa: bool) -> None:
    """Raise where torch raises (``mask_dtype``: the mask's dtype after autocast's cast)."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor):
            raise TypeError(f"scaled_dot_product_attention(): argument '{name}' must be Tensor, "
                            f"not {type(t).__name__}")
        if t.is_nested or t.layout != torch.strided:
            raise NotImplementedError(
                f"actnn_zoo scaled_dot_product_attention: {name} is a nested or sparse tensor "
                f"(layout {t.layout}); only dense tensors are supported while compressing "
                "activations (set qconfig enabled=False)")
    if query.dim() < 2 or key.dim() < 2 or value.dim() < 2:
        raise RuntimeError(
            "Expected query, key, and value to all be  at least 2 dimensional, but got "
            f"query.dim: {query.dim()} key.dim: {key.dim()} and value.dim: {value.dim()} instead.")
    if not (query.dtype == key.dtype == value.dtype):
        raise RuntimeError(
            "Expected query, key, and value to have the same dtype, but got query.dtype: "
            f"{query.dtype} key.dtype: {key.dtype} and value.dtype: {value.dtype} instead.")
    if not query.dtype.is_floating_point:
        raise RuntimeError(f"Expected query, key, and value to be floating point, got "
                           f"{query.dtype}")
    if not (query.device == key.device == value.device):
        raise RuntimeError(
            "Expected query, key, and value to have the same device type, but got query.device: "
            f"{query.device} key.device: {key.device} and value.device: {value.device} instead.")
    if dropout_p > 1.0:
        raise RuntimeError(f"dropout probability has to be between 0 and 1, but got {dropout_p}")
    if query.shape[-1] != key.shape[-1]:
        raise RuntimeError(f"query and key must have the same embedding size (last dim), got "
                           f"{tuple(query.shape)} and {tuple(key.shape)}")
    if key.shape[-2] != value.shape[-2]:
        raise RuntimeError(f"key and value must have the same sequence length (dim -2), got "
                           f"{tuple(key.shape)} and {tuple(value.shape)}")
    kb, vb = list(key.shape[:-2]), list(value.shape[:-2])
    if enable_gqa:
        if query.dim() < 3 or key.dim() < 3 or value.dim() < 3:
            raise RuntimeError("enable_gqa=True needs a head dimension (dim -3) in query, key "
                               "and value")
        hq = query.shape[-3]
        for name, t, b in (("key", key, kb), ("value", value, vb)):
            h = t.shape[-3]
            if h == 0 or hq % h:
                raise RuntimeError(
                    "Number of heads in key and value must divide the number of heads in query "
                    f"(query has {hq}, {name} has {h})")
            b[-1] = hq  # repeat_interleave(hq // h, dim=-3)
    qk = _broadcast_shapes(query.shape[:-2], torch.Size(kb))  # raises like matmul
    _broadcast_shapes(qk, torch.Size(vb))
    if attn_mask is not None:
        if is_causal:
            raise RuntimeError("_scaled_dot_product_attention: Explicit attn_mask should not be "
                               "set when is_causal=True")
        if not isinstance(attn_mask, Tensor):
            raise TypeError(f"attn_mask must be a Tensor or None, not {type(attn_mask).__name__}")
        if mask_dtype not in (torch.bool, torch.float32, query.dtype):
            raise RuntimeError(
                "Expected attn_mask dtype to be bool or float or to match query dtype, but got "
                f"attn_mask.dtype: {mask_dtype} and  query.dtype: {query.dtype} instead.")
        if attn_mask.device != query.device:
            raise RuntimeError(f"attn_mask is on {attn_mask.device}, query on {query.device}")
        if attn_mask.is_nested or attn_mask.layout != torch.strided:
            raise NotImplementedError("actnn_zoo scaled_dot_product_attention: nested or sparse "
                                      "attn_mask is not supported")
        target = qk + (query.shape[-2], key.shape[-2])
        if attn_mask.dim() < 2 or not _broadcasts_to(attn_mask.shape, target):
            raise RuntimeError(f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast "
                               f"to the attention scores' shape {tuple(target)}")


def _broadcasts_to(shape: Sequence[int], target: Sequence[int]) -> bool:
    if len(shape) > len(target):
        return False
    return all(s in (1, t) for s, t in zip(reversed(shape), reversed(target)))


# ----------------------------------------------------------------------------------------------
# Indexing the tiles: flat output batch index -> each operand's own batch index
# ----------------------------------------------------------------------------------------------
def _batch_index(batch: Sequence[int], out: Sequence[int], group: int,
                 device: torch.device) -> Optional[Tensor]:
    """For each flat index of the output batch ``out``, the flat index into a tensor of batch
    shape ``batch`` whose last batch dim (heads) is repeated ``group`` times (GQA). None when
    that is the identity (no broadcasting, no GQA): tiles are then plain slices."""
    if tuple(batch) == tuple(out) and group == 1:
        return None
    base = torch.arange(math.prod(batch), device=device).reshape(tuple(batch))
    if group > 1:
        base = base.repeat_interleave(group, dim=-1)
    return base.expand(tuple(out)).reshape(-1)


def _rows(t: Tensor) -> Tensor:
    """``t`` as (prod(batch), rows, cols); a view when its layout allows, else a copy."""
    return t.reshape(math.prod(t.shape[:-2]), t.shape[-2], t.shape[-1])


def _take(flat: Tensor, index: Optional[Tensor], n0: int, n1: int) -> Tensor:
    if index is None:
        return flat if n0 == 0 and n1 == flat.shape[0] else flat[n0:n1]
    return flat[index[n0:n1]]


# The helpers below skip the torch call where it would give back its input (a slice over the
# whole dim; ``linear.cast`` does the same for a cast to the dtype a tensor has): small shapes
# run one tile, and each call is a dispatch of a microsecond or more for nothing.
def _cols(t: Tensor, stop: int) -> Tensor:
    """``t[:, :stop]``."""
    return t if stop == t.shape[1] else t[:, :stop]


def _row_tile(t: Tensor, r0: int, r1: int) -> Tensor:
    """``t[:, r0:r1]``."""
    return t if r0 == 0 and r1 == t.shape[1] else t[:, r0:r1]


class _Mask:
    """Tiles of the attention mask, read from the caller's tensor without copying all of it.

    Dims the mask was expanded along (stride 0) are narrowed to size 1, so an expanded
    ``(B, H, L, S)`` view of a ``(B, 1, L, S)`` mask costs what the latter does; a tile is a
    view when the mask does not vary over the batch, else one gather of the tile's size."""

    def __init__(self, mask: Tensor, out_batch: torch.Size, L: int, S: int,
                 round_to: Optional[torch.dtype]) -> None:
        m = mask[(None,) * (len(out_batch) + 2 - mask.dim())]
        for d in range(m.dim()):
            if m.shape[d] > 1 and m.stride(d) == 0:
                m = m.narrow(d, 0, 1)
        self.m = m
        self.is_bool = mask.dtype == torch.bool
        self.round_to = round_to  # autocast: torch casts a float mask to the autocast dtype
        self.full_rows = m.shape[-2] == L
        nb = len(out_batch)
        device = mask.device
        self.coords: List[Optional[Tensor]] = []
        n = math.prod(out_batch)
        stride = 1
        strides = []
        for size in reversed(out_batch):
            strides.append(stride)
            stride *= size
        strides.reverse()
        flat = torch.arange(n, device=device) if any(m.shape[d] > 1 for d in range(nb)) else None
        for d in range(nb):
            if m.shape[d] > 1:
                self.coords.append((flat // strides[d]) % out_batch[d])
            else:
                self.coords.append(None)

    def tile(self, n0: int, n1: int, r0: int, r1: int) -> Tensor:
        """(nb or 1, rows or 1, S or 1): the mask for output batch [n0, n1), rows [r0, r1)."""
        m = self.m[..., r0:r1, :] if self.full_rows else self.m
        if all(c is None for c in self.coords):
            t = m[(0,) * len(self.coords)].unsqueeze(0)
        else:
            # a one-element index, not a 0-d one: torch reads a 0-d index tensor on the host
            # (a device sync on a GPU, every tile); (1,) broadcasts with the others instead
            idx = tuple(torch.zeros(1, dtype=torch.int64, device=m.device) if c is None
                        else c[n0:n1] for c in self.coords)
            t = m[idx]
        if self.round_to is not None and not self.is_bool:
            t = t.to(self.round_to)
        return t

    def apply_(self, s: Tensor, n0: int, n1: int, r0: int, r1: int) -> None:
        """Add the mask to the scores: a float mask as it is, a boolean one as 0 / -inf."""
        t = self.tile(n0, n1, r0, r1).to(s.dtype)
        if self.is_bool:  # 1 -> 1 - 1/1 = 0, 0 -> 1 - 1/0 = -inf (masked_fill/where on a
            t.reciprocal_().neg_().add_(1.0)  # bool is ~8x slower than this on CPU)
        s.add_(t)


class _MaskGrad:
    """The gradient of a float mask: each tile's ``dS`` reduced over the dims the mask is
    broadcast along, into a float32 buffer of the mask's own shape (never larger: it is the
    gradient autograd returns). Stride-0 dims are *not* reduced: the gradient of an expanded
    view has the view's shape."""

    def __init__(self, mask: Tensor, out_batch: torch.Size, work: torch.dtype) -> None:
        self.shape = mask.shape
        self.dtype = mask.dtype
        full = (1,) * (len(out_batch) + 2 - mask.dim()) + tuple(mask.shape)
        mb = full[:-2]
        self.sum_rows, self.sum_keys = full[-2] == 1, full[-1] == 1
        self.one_batch = math.prod(mb) == 1  # every batch dim broadcast: sum over the tile
        self.index = None if self.one_batch else _batch_index(mb, out_batch, 1, mask.device)
        self.buf = torch.zeros(math.prod(mb), full[-2], full[-1], dtype=work,
                               device=mask.device)

    def add(self, n0: int, n1: int, r0: int, r1: int, ds: Tensor) -> None:
        """Accumulate ``ds`` (n1 - n0, r1 - r0, S), the score gradient of one tile."""
        if self.sum_keys:
            ds = ds.sum(-1, keepdim=True)
        if self.sum_rows:
            ds = ds.sum(1, keepdim=True)
        dest = self.buf if self.sum_rows else self.buf[:, r0:r1]
        if self.one_batch:
            dest += ds.sum(0, keepdim=True)
        else:
            _accumulate(dest, self.index, n0, n1, ds)

    def result(self) -> Tensor:
        return self.buf.reshape(self.shape).to(self.dtype)


def _causal_(s: Tensor, r0: int, r1: int) -> None:
    """torch's is_causal: the top-left aligned lower triangle takes part (key j <= row i);
    -inf is added above it (one (rows, S) bias, broadcast over the batch)."""
    bias = torch.full(s.shape[-2:], float("-inf"), dtype=s.dtype, device=s.device)
    s.add_(bias.triu_(r0 + 1))


def tile_budget(device: torch.device) -> int:
    """Scores per tile on ``device`` (see :data:`DEVICE_BLOCK_SCALE`)."""
    return BLOCK_ELEMENTS * (1 if device.type == "cpu" else DEVICE_BLOCK_SCALE)


def _tiles(n: int, L: int, S: int, budget: int) -> Tuple[int, int]:
    """(batch elements, rows) per tile: whole rows of S keys, rows first, <= budget scores."""
    per_row = max(S, 1)
    rows = max(1, min(L, budget // per_row))
    batch = max(1, min(n, budget // (rows * per_row)))
    return batch, rows


# ----------------------------------------------------------------------------------------------
# The Function
# ----------------------------------------------------------------------------------------------
class _Plan:
    """Shapes, index maps and tile sizes of one call; the backward reads the forward's."""

    def __init__(self, qshape: torch.Size, kshape: torch.Size, vshape: torch.Size,
                 gqa: bool, device: torch.device, budget: int) -> None:
        self.out_batch = _output_batch(qshape, kshape, vshape, gqa)
        self.N = math.prod(self.out_batch)
        self.L, self.E = qshape[-2], qshape[-1]
        self.S, self.Ev = kshape[-2], vshape[-1]
        gk = qshape[-3] // kshape[-3] if gqa else 1
        gv = qshape[-3] // vshape[-3] if gqa else 1
        self.qi = _batch_index(qshape[:-2], self.out_batch, 1, device)
        self.ki = _batch_index(kshape[:-2], self.out_batch, gk, device)
        self.vi = _batch_index(vshape[:-2], self.out_batch, gv, device)
        self.nb, self.nr = _tiles(self.N, self.L, self.S, budget)

    def batch_tiles(self):
        for n0 in range(0, self.N if self.S else 0, self.nb):
            yield n0, min(self.N, n0 + self.nb)

    def row_tiles(self):
        for r0 in range(0, self.L, self.nr):
            yield r0, min(self.L, r0 + self.nr)

    def keys(self, r0: int, r1: int, is_causal: bool) -> int:
        """Keys a row tile reads: with is_causal, rows below r1 see no key at or after r1."""
        return min(self.S, r1) if is_causal else self.S

    def whole(self, is_causal: bool) -> bool:
        """One tile holds the whole call (every sample, row and key) and every operand is
        indexed by the output's own batch (no broadcasting, no GQA): the tile's gradients are
        the results, with no buffers to zero and accumulate into."""
        return bool(self.S and self.N and self.L and self.nb >= self.N and self.nr >= self.L
                    and self.qi is None and self.ki is None and self.vi is None
                    and self.keys(0, self.L, is_causal) == self.S)


def _output_batch(qshape: Sequence[int], kshape: Sequence[int], vshape: Sequence[int],
                  gqa: bool) -> torch.Size:
    kb, vb = list(kshape[:-2]), list(vshape[:-2])
    if gqa:
        kb[-1] = vb[-1] = qshape[-3]
    return _broadcast_shapes(torch.Size(qshape[:-2]), torch.Size(kb), torch.Size(vb))


def _broadcast_shapes(*shapes: Sequence[int]) -> torch.Size:
    """``torch.broadcast_shapes`` for plain int shapes, in a few microseconds (torch's goes
    through its symbolic-shape reference, ~25 us a call, three calls per attention call); any
    shape that does not broadcast is handed to torch's, which raises its own error."""
    first = shapes[0]
    if shapes.count(first) == len(shapes):  # self-attention's q, k and v: nothing to do
        return torch.Size(first)
    out: List[int] = []
    for shape in shapes:
        for i, size in enumerate(reversed(shape)):
            if i == len(out):
                out.append(size)
            elif out[i] == 1:
                out[i] = size
            elif size != 1 and size != out[i]:
                return torch.broadcast_shapes(*shapes)
    return torch.Size(reversed(out))


def _probs(qs: Tensor, kt: Tensor, mask: Optional[_Mask], is_causal: bool,
           n0: int, n1: int, r0: int, r1: int) -> Tensor:
    """softmax(qs kt^T + mask) of one tile, normalized over its whole rows (a row with every key
    masked gives zeros, as torch does). The one place forward and backward get P from."""
    s = torch.bmm(qs, kt.transpose(1, 2))
    if mask is not None:
        mask.apply_(s, n0, n1, r0, r1)
    fused = (getattr(extension(), "attention_softmax_", None)
             if s.device.type == "cpu" and s.dtype in _EXP_FLOOR else None)
    if fused is not None:  # the same steps in one compiled pass per row (~10 ops less)
        return fused(s, r0 if is_causal else -1)
    return softmax_torch_(s, r0 if is_causal else -1)


def softmax_torch_(s: Tensor, causal: int) -> Tensor:
    """:func:`_probs`' softmax of scores ``s`` (nb, rows, keys), in place, as torch ops (any
    device; the twin of the compiled CPU ``attention_softmax_``). ``causal`` >= 0: the tile's
    first row, whose key j is masked above ``causal + row``; -1: no causal mask."""
    if causal >= 0:
        _causal_(s, causal, causal + s.shape[-2])
    m = s.amax(-1, keepdim=True)
    m.masked_fill_(m == float("-inf"), 0.0)
    # exp(max(x, floor)) - exp(floor): exactly 0 for masked scores, any other value moved by
    # < 2e-38 (in a row whose sum is >= 1); torch's CPU exp is ~6x slower on inputs whose
    # result is 0 or subnormal, i.e. on every masked score.
    floor = _EXP_FLOOR[s.dtype]
    s.sub_(m).clamp_min_(floor).exp_().sub_(math.exp(floor))
    return s.div_(s.sum(-1, keepdim=True).clamp_min(1.0))  # the sum is >= 1 unless all masked


def _whole_compiled(plan: "_Plan", is_causal: bool, mask: Optional[_Mask],
                    drop: Optional[_Dropout], q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether the compiled whole-call forward and backward (:data:`_WHOLE_FORWARD`) compute
    what the tile loop would: one tile holds the call (:meth:`_Plan.whole`), float32 operands
    on the CPU, no mask, dropout (if any) through the compiled keep-mask."""
    return (_WHOLE_FORWARD is not None and mask is None and q.device.type == "cpu"
            and q.dtype == k.dtype == v.dtype == torch.float32 and plan.whole(is_causal)
            and (drop is None or drop.compiled))


def _attention_node(plan: "_Plan", query: Tensor, key: Tensor, value: Tensor, p: float,
                    is_causal: bool, scale: Optional[float], qconfig: LayerQConfig,
                    bits: Optional[Bits]) -> Optional[Tensor]:
    """The call as the compiled autograd node ``_C.qattention``, where it computes what
    :class:`ScaledDotProductAttentionFunction`'s whole-call path would, bit for bit: no mask
    (the caller's check), one tile holds the call (``plan``, :meth:`_Plan.whole`), float32
    plain tensors on the CPU outside autocast, the plain quantizer at one width. Else None,
    with nothing drawn or compressed.

    Why: at GPT-2's short sequences the Function's Python (apply, ctx, save and load, the
    backward's decoding) cost about as much as its arithmetic. The seed and the codes are drawn
    in the Function's order (the dropout seed, then q, k, v through the capture store), and the
    store is told the node keeps the codes, as :func:`~._saving.save` tells it."""
    width = qconfig.bits if bits is None else bits
    if not (type(query) is Tensor and type(key) is Tensor and type(value) is Tensor
            and query.device.type == "cpu"
            and query.dtype == key.dtype == value.dtype == torch.float32
            and qconfig.compressor == "quant" and qconfig.transform == "none"
            and isinstance(width, int) and not torch.is_autocast_enabled("cpu")
            and plan.whole(is_causal)):
        return None
    if scale is None:
        scale = 1.0 / math.sqrt(plan.E) if plan.E else float("inf")
    drop = _Dropout(draw_seed(), p, plan.L, plan.S, query.device) if p > 0 else None
    codes: List[Optional[Tensor]] = []
    widths: List[int] = []
    saved: List[Tensor] = []
    with torch.no_grad():  # as inside the Function's forward
        q, k, v = _rows(query), _rows(key), _rows(value)
        for r, t in ((q, query), (k, key), (v, value))[
                :3 if query.requires_grad or key.requires_grad else 2]:
            entries = _row_codes(r, t, qconfig, width)
            codes += entries[:6]
            widths.append(entries[6])
            saved += [e for e in entries[:6] if e is not None]
    return _QATTENTION(query, key, value, q, k, v, (*plan.out_batch, plan.L, plan.Ev), scale,
                       is_causal, *_drop_args(drop), codes, widths, qconfig.group_size,
                       keep_saved(*saved))


def _row_codes(rows: Tensor, t: Tensor, qconfig: LayerQConfig, width: int) -> tuple:
    """``payload_codes(compress(rows.view(t.shape)))`` for the node's plain quantizer at one
    width: (data, lo, step, row_bits, offsets, mask, bits, group_size).

    Where ``rows`` is a copy :func:`_rows` made (``t``'s layout had no such view: transformers
    pass q, k and v transposed), nothing else can save or claim its memory, so the capture
    store's compress-once lookup could never answer it: it is quantized by the one-width kernel
    directly, with a seed from the same stream in the same order (``quant.api.quantize_saved``'s
    call, without its payload object), so the codes are those the store would have made. With
    the three copies of a GPT-2 attention call, its extra time over torch's fell from ~165 to
    ~118 us (store key, lookup and eviction entry, the payload objects, the Python between).
    Otherwise through the store, whose answer may be sparse codes (q, k or v the output of a
    ReLU)."""
    x = rows.view(t.shape)
    if rows.numel() and rows.data_ptr() != t.data_ptr():
        stochastic = qconfig.rounding == "stochastic"
        seed = draw_seed() if stochastic else 0
        data, lo, step = kernels(x.device).quantize_uniform(x, width, qconfig.group_size,
                                                            seed & 0xFFFFFFFF, stochastic)
        return (data, lo, step, None, None, None, width, qconfig.group_size)
    c = compress(x, qconfig, width, maps=False)
    entries = payload_codes(c)
    if entries is None:
        raise RuntimeError(f"actnn_zoo attention: the store answered {type(c).__name__} for a "
                           "plain quantizer's payload")
    return entries


def _drop_args(drop: Optional[_Dropout]) -> Tuple[int, int, int, float]:
    """(threshold, s1, s2, scale) of the compiled whole-call functions; threshold -1: none."""
    if drop is None:
        return -1, 0, 0, 1.0
    return drop.threshold, drop.s1, drop.s2, drop.scale


def _accumulate(dest: Tensor, index: Optional[Tensor], n0: int, n1: int, tile: Tensor) -> None:
    """dest[own batch index of n] += tile[n - n0] for n in [n0, n1) (sums broadcast / GQA)."""
    if index is None:
        (dest if n0 == 0 and n1 == dest.shape[0] else dest[n0:n1]).add_(tile)
    else:
        dest.index_add_(0, index[n0:n1], tile)


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class ScaledDotProductAttentionFunction(torch.autograd.Function):
    """``F.scaled_dot_product_attention`` saving compressed q, k, v; see the module docstring.

    Arguments after ``enable_gqa``: ``qconfig``, ``bits`` (as for every zoo Function),
    ``mask_round`` (the dtype autocast would cast a float mask to, else None), ``block``
    (scores per tile) and ``plan`` (the call's :class:`_Plan` at ``block``, when the caller
    made it already). Use :func:`scaled_dot_product_attention`, which checks the inputs.
    """

    @staticmethod
    def forward(ctx, query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor],
                dropout_p: float, is_causal: bool, scale: Optional[float], enable_gqa: bool,
                qconfig: LayerQConfig, bits: Optional[Bits], mask_round: Optional[torch.dtype],
                block: int, plan: Optional["_Plan"] = None) -> Tensor:
        dev = query.device
        work = _work_dtype(query.dtype)
        if plan is None:
            plan = _Plan(query.shape, key.shape, value.shape, enable_gqa, dev, block)
        L, S = plan.L, plan.S
        if scale is None:
            scale = 1.0 / math.sqrt(plan.E) if plan.E else float("inf")  # E = 0: no scores
        seed = draw_seed() if dropout_p > 0 else None
        drop = _Dropout(seed, dropout_p, L, S, dev, plan.N) if seed is not None else None
        mask = (_Mask(attn_mask, plan.out_batch, L, S, mask_round)
                if attn_mask is not None else None)
        q, k, v = _rows(query), _rows(key), _rows(value)
        # S == 0: softmax over no keys, torch gives zeros (the tile loops do not run). One
        # tile of the output's dtype: its result is the output (no buffer, no copy into it).
        one_tile = (S and plan.N and L and plan.nb >= plan.N and plan.nr >= L
                    and work == query.dtype)
        ctx.whole = _whole_compiled(plan, is_causal, mask, drop, q, k, v)
        if ctx.whole:  # the tile loop below in one compiled call
            out = _WHOLE_FORWARD(q, k, v, scale, is_causal, *_drop_args(drop))
        else:
            out = None if one_tile else (torch.empty if S else torch.zeros)(
                plan.N, L, plan.Ev, dtype=query.dtype, device=dev)
            with _no_autocast(dev):
                for n0, n1 in plan.batch_tiles():
                    kt = cast(_take(k, plan.ki, n0, n1), work)
                    vt = cast(_take(v, plan.vi, n0, n1), work)
                    qb = _take(q, plan.qi, n0, n1)
                    for r0, r1 in plan.row_tiles():
                        ke = plan.keys(r0, r1, is_causal)
                        p = _probs(cast(_row_tile(qb, r0, r1), work) * scale, _cols(kt, ke),
                                   mask, is_causal, n0, n1, r0, r1)
                        if drop is not None:
                            p.mul_(drop.keep(n0, n1, r0, r1, ke))
                        o = torch.bmm(p, _cols(vt, ke))
                        if drop is not None:
                            o.mul_(drop.scale)
                        if out is None:
                            out = o
                        else:
                            out[n0:n1, r0:r1] = o
                        del p, o
        out = out.reshape(*plan.out_batch, L, plan.Ev)

        # v enters dQ, dK and the mask's gradient (through dP); dV alone needs only q and k
        need_qk = ctx.needs_input_grad[0] or ctx.needs_input_grad[1] or ctx.needs_input_grad[3]

        def comp(rows: Tensor, t: Tensor) -> object:
            # ``rows`` (the tiles' operand: a view of ``t``, or its contiguous copy when the
            # batch dims do not merge) in ``t``'s shape: a second copy would cost as much again
            r = rows.view(t.shape)
            return compress(r if r.dtype != torch.float64 else r.float(), qconfig, bits,
                            maps=False)

        save(ctx, comp(q, query), comp(k, key), comp(v, value) if need_qk else None)
        ctx.attn_mask = attn_mask  # a reference to the caller's tensor, never a copy
        ctx.mask_version = tensor_version(attn_mask) if attn_mask is not None else None
        if drop is not None:
            drop.release()  # its row hashes are made again in backward, not kept until then
        ctx.plan, ctx.drop = plan, drop  # host objects: shapes, ints, small index maps
        ctx.args = (is_causal, scale, mask_round)
        ctx.dtypes = (query.dtype, key.dtype, value.dtype)
        ctx.vshape = value.shape
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        no_double_backward("scaled_dot_product_attention")
        attn_mask = ctx.attn_mask
        if attn_mask is not None and tensor_version(attn_mask) != ctx.mask_version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                "inplace operation: the attn_mask of actnn_zoo scaled_dot_product_attention is "
                f"at version {tensor_version(attn_mask)}; expected version "
                f"{ctx.mask_version} instead.")
        qc, kc, vc = load(ctx)
        is_causal, scale, mask_round = ctx.args
        need_q, need_k, need_v, need_m = ctx.needs_input_grad[:4]
        q_dtype, k_dtype, v_dtype = ctx.dtypes
        dev = grad_out.device
        work = _work_dtype(q_dtype)
        vshape = ctx.vshape
        plan, drop = ctx.plan, ctx.drop
        L, S, Ev = plan.L, plan.S, plan.Ev
        mask = (_Mask(attn_mask, plan.out_batch, L, S, mask_round)
                if attn_mask is not None else None)
        q, k = _rows(restore(qc)), _rows(restore(kc))
        v = _rows(restore(vc)) if vc is not None else None  # saved when dS is needed
        go = _rows(grad_out)
        if ctx.whole and go.dtype == torch.float32 and not need_m:  # the loop in one call
            dq, dk, dv = _WHOLE_BACKWARD(go, q, k, v, scale, is_causal, *_drop_args(drop),
                                         need_q, need_k, need_v)
            return (dq.reshape(qc.shape) if need_q else None,
                    dk.reshape(kc.shape) if need_k else None,
                    dv.reshape(vshape) if need_v else None, None) + (None,) * 9

        whole = plan.whole(is_causal)  # one tile: its products are the gradients
        dq = dk = dv = None
        if not whole:
            dq = torch.zeros(q.shape, dtype=work, device=dev) if need_q else None
            dk = torch.zeros(k.shape, dtype=work, device=dev) if need_k else None
            dv = (torch.zeros(math.prod(vshape[:-2]), S, Ev, dtype=work, device=dev)
                  if need_v else None)
        dm = _MaskGrad(attn_mask, plan.out_batch, work) if need_m else None
        with _no_autocast(dev):
            for n0, n1 in plan.batch_tiles():
                kt = cast(_take(k, plan.ki, n0, n1), work)
                qb = _take(q, plan.qi, n0, n1)
                vt = cast(_take(v, plan.vi, n0, n1), work) if v is not None else None
                dkt = torch.zeros_like(kt) if need_k and not whole else None
                dvt = (torch.zeros(n1 - n0, S, Ev, dtype=work, device=dev)
                       if need_v and not whole else None)
                for r0, r1 in plan.row_tiles():
                    ke = plan.keys(r0, r1, is_causal)
                    qs = cast(_row_tile(qb, r0, r1), work) * scale
                    kk = _cols(kt, ke)
                    p = _probs(qs, kk, mask, is_causal, n0, n1, r0, r1)
                    keep = drop.keep(n0, n1, r0, r1, ke) if drop is not None else None
                    g = cast(_row_tile(_take(go, None, n0, n1), r0, r1), work)
                    if drop is not None:  # dropout's 1 / (1 - p) rides on dO (not in place:
                        g = g * drop.scale  # g may be a view of grad_out)
                    if need_v:  # dV = (P * M)^T dO
                        pm = (p if keep is None else p * keep).transpose(1, 2)
                        if whole:
                            dv = torch.bmm(pm, g)
                        else:
                            _cols(dvt, ke).baddbmm_(pm, g)
                        del pm
                    if need_q or need_k or need_m:
                        dp = torch.bmm(g, _cols(vt, ke).transpose(1, 2))
                        if keep is not None:
                            dp.mul_(keep)
                        ds = dp.mul_(p)  # dS = P * (dP - D), D = rowsum(P * dP), in dP's memory
                        ds.addcmul_(p, ds.sum(-1, keepdim=True), value=-1.0)
                        del p
                        if need_m:  # the mask is added to the scaled scores: dMask = dS
                            dm.add(n0, n1, r0, r1, ds)
                        if need_q:
                            dq_t = torch.bmm(ds, kk).mul_(scale)
                            if whole:
                                dq = dq_t
                            else:
                                _accumulate(_row_tile(dq, r0, r1), plan.qi, n0, n1, dq_t)
                            del dq_t
                        if need_k:  # qs carries the scale
                            if whole:
                                dk = torch.bmm(ds.transpose(1, 2), qs)
                            else:
                                _cols(dkt, ke).baddbmm_(ds.transpose(1, 2), qs)
                        del ds, dp
                if need_k and not whole:
                    _accumulate(dk, plan.ki, n0, n1, dkt)
                if need_v and not whole:
                    _accumulate(dv, plan.vi, n0, n1, dvt)
        gq = cast(dq.reshape(qc.shape), q_dtype) if need_q else None
        gk = cast(dk.reshape(kc.shape), k_dtype) if need_k else None
        gv = cast(dv.reshape(vshape), v_dtype) if need_v else None
        gm = dm.result() if need_m else None
        return (gq, gk, gv, gm) + (None,) * 9


def scaled_dot_product_attention(query: Tensor, key: Tensor, value: Tensor,
                                 attn_mask: Optional[Tensor] = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: Optional[float] = None,
                                 enable_gqa: bool = False, *,
                                 qconfig: Optional[LayerQConfig] = None,
                                 bits: Optional[Bits] = None) -> Tensor:
    """``F.scaled_dot_product_attention`` (same arguments, shapes, masks, errors and autocast
    dtype) saving compressed q, k, v for a backward that recomputes the probabilities.

    Under autocast, q, k and v are cast to the autocast dtype as torch does (a float mask is
    rounded to it tile by tile, without a copy) and the math stays float32. Without anything to
    differentiate, or with ``qconfig.enabled=False``, this is torch's own op (its kernels and
    its dropout stream).
    """
    qconfig = LayerQConfig() if qconfig is None else qconfig
    mask_round: Optional[torch.dtype] = None
    mask_dtype = attn_mask.dtype if isinstance(attn_mask, Tensor) else None
    if isinstance(query, Tensor):
        dev_type = query.device.type
        if dev_type in ("cpu", "cuda") and torch.is_autocast_enabled(dev_type):
            ac = torch.get_autocast_dtype(dev_type)

            def eligible(t: object) -> bool:  # autocast's rule: floating, not float64, on device
                return (isinstance(t, Tensor) and t.is_floating_point()
                        and t.dtype != torch.float64 and t.device.type == dev_type)

            query, key, value = (t.to(ac) if eligible(t) else t for t in (query, key, value))
            if eligible(attn_mask):
                mask_round, mask_dtype = ac, ac
    _check_inputs(query, key, value, attn_mask, mask_dtype, float(dropout_p), bool(is_causal),
                  bool(enable_gqa))
    wants_grad = torch.is_grad_enabled() and (
        query.requires_grad or key.requires_grad or value.requires_grad
        or (isinstance(attn_mask, Tensor) and attn_mask.requires_grad))
    if not qconfig.enabled or not wants_grad:
        return F.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p,
                                              is_causal, scale=scale, enable_gqa=enable_gqa)
    p = float(dropout_p) if dropout_p > 0 else 0.0  # torch: dropout_p <= 0 is no dropout
    scale = None if scale is None else float(scale)
    # the call's plan, made once: the node's test reads it, else the Function runs with it
    block = tile_budget(query.device)
    plan = _Plan(query.shape, key.shape, value.shape, bool(enable_gqa), query.device, block)
    if _QATTENTION is not None and attn_mask is None:
        out = _attention_node(plan, query, key, value, p, bool(is_causal), scale, qconfig, bits)
        if out is not None:
            return out
    return ScaledDotProductAttentionFunction.apply(
        query, key, value, attn_mask, p, bool(is_causal), scale, bool(enable_gqa), qconfig,
        bits, mask_round, block, plan)
