"""cross_entropy / linear_cross_entropy (actnn_zoo.functional.loss): torch's loss for every
option, gradients close to exact at 8 bits and unbiased at 2 bits, what is saved, and that no
[tokens, classes] tensor is kept (or, for the fused one, ever allocated)."""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Tuple

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings, strategies as st
from torch import Tensor

import actnn_zoo.functional.loss as loss_mod
from actnn_zoo.config import LayerQConfig
from actnn_zoo.functional.loss import cross_entropy, linear_cross_entropy

Q8 = LayerQConfig(bits=8)
Q2 = LayerQConfig(bits=2)
HYP = settings(max_examples=40, deadline=None, derandomize=True,
               suppress_health_check=[HealthCheck.too_slow])


def cosine(a: Tensor, b: Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return float(torch.dot(a, b) / (a.norm() * b.norm()))


def saved(fn: Callable[[], Tensor], exclude: Tuple[Tensor, ...] = ()
          ) -> Tuple[Tensor, List[Tuple[Tuple[int, ...], torch.dtype, int]]]:
    """Run ``fn`` and list (shape, dtype, storage bytes) of every distinct storage autograd
    saved, leaving out those of ``exclude`` (parameters, as docs/design.md's "Measuring")."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: Dict[int, Tuple[Tuple[int, ...], torch.dtype, int]] = {}

    def pack(t: Tensor) -> Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            seen[s.data_ptr()] = (tuple(t.shape), t.dtype, s.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, list(seen.values())


def _tol(dtype: torch.dtype) -> Dict[str, float]:
    """Our loss is the float32 loss rounded once to ``dtype``: one rounding of tolerance."""
    return {torch.float32: dict(rtol=2e-5, atol=2e-5), torch.float16: dict(rtol=2e-3, atol=1e-3),
            torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}[dtype]


@st.composite
def ce_cases(draw):
    layout = draw(st.sampled_from(["2d", "1d", "kd"]))
    classes = draw(st.integers(1, 40))
    n = draw(st.integers(0, 6))
    if layout == "1d":
        shape, tshape = (classes,), ()
    elif layout == "2d":
        shape, tshape = (n, classes), (n,)
    else:
        spatial = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=2)))
        shape, tshape = (n, classes) + spatial, (n,) + spatial
    return dict(shape=shape, tshape=tshape, classes=classes,
                dtype=draw(st.sampled_from([torch.float32, torch.float32, torch.bfloat16,
                                            torch.float16])),
                weight=draw(st.booleans()),
                ignore=draw(st.sampled_from(["-100", "class", "none"])),
                reduction=draw(st.sampled_from(["mean", "sum", "none"])),
                smoothing=draw(st.sampled_from([0.0, 0.1, 0.37, 1.0])),
                chunk=draw(st.sampled_from([None, 1, 2, 5])),
                seed=draw(st.integers(0, 2 ** 16)))


def _ce_inputs(case) -> Tuple[Tensor, Tensor, Optional[Tensor], int]:
    g = torch.Generator().manual_seed(case["seed"])
    classes = case["classes"]
    x = (torch.randn(case["shape"], generator=g) * 3).to(case["dtype"])
    target = torch.randint(0, classes, case["tshape"], generator=g)
    ignore = -100
    if case["ignore"] == "class":
        ignore = int(torch.randint(0, classes, (), generator=g))
    if case["ignore"] != "none" and target.numel():
        target.view(-1)[torch.rand(target.numel(), generator=g) < 0.3] = ignore
    weight = None
    if case["weight"]:
        weight = (torch.rand(classes, generator=g) + 0.1).to(case["dtype"])
    return x, target, weight, ignore


# ----------------------------------------------------------------------------------------------
# cross_entropy: torch's loss, 8-bit gradients ~ exact
# ----------------------------------------------------------------------------------------------
@HYP
@given(ce_cases())
def test_cross_entropy_matches_torch(case):
    """Loss: equal to torch's float32 loss (on the same values) rounded to the input dtype
    (fp32: rtol 2e-5); shape and dtype as torch's. Gradient at 8 bits: cosine >= 0.9999 with
    exact fp32 autograd (zero where that is zero)."""
    x, target, weight, ignore = _ce_inputs(case)
    kw = dict(ignore_index=ignore, reduction=case["reduction"],
              label_smoothing=case["smoothing"])
    x32 = x.float().requires_grad_(True)
    ref = F.cross_entropy(x32, target, None if weight is None else weight.float(), **kw)
    ref_lowp = F.cross_entropy(x, target, weight, **kw)
    xq = x.clone().requires_grad_(True)
    out = cross_entropy(xq, target, weight, qconfig=Q8, chunk_size=case["chunk"], **kw)
    assert out.shape == ref_lowp.shape and out.dtype == ref_lowp.dtype
    torch.testing.assert_close(out.float(), ref.detach().to(x.dtype).float(), equal_nan=True,
                               **_tol(x.dtype))
    if out.numel() == 0 or x.numel() == 0:
        return
    gen = torch.Generator().manual_seed(1)
    go = torch.randn(out.shape, generator=gen)
    (g_ref,) = torch.autograd.grad(ref, x32, go)
    (g,) = torch.autograd.grad(out, xq, go.to(out.dtype))
    assert g.dtype == x.dtype and g.shape == x.shape
    if g_ref.norm() == 0:
        assert g.float().abs().max() <= 1e-6
    else:
        assert cosine(g, g_ref) >= 0.9999


@pytest.mark.parametrize("layout", ["2d", "kd", "1d"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_formulas_exact_without_compression(monkeypatch, layout, reduction):
    """With compression replaced by the identity, the saved softmax and coefficients give
    torch's gradient to float32 rounding: everything but the codes is exact."""
    monkeypatch.setattr(loss_mod, "compress", lambda x, qconfig, bits=None: x)
    g = torch.Generator().manual_seed(3)
    shape, tshape = {"2d": ((9, 13), (9,)), "kd": ((3, 13, 4, 2), (3, 4, 2)),
                     "1d": ((13,), ())}[layout]
    x = (torch.randn(shape, generator=g) * 4).requires_grad_(True)
    target = torch.randint(0, 13, tshape, generator=g)
    if target.dim():
        target.view(-1)[::4] = -100
    weight = torch.rand(13, generator=g) + 0.2
    kw = dict(reduction=reduction, label_smoothing=0.2)
    ref = F.cross_entropy(x, target, weight, **kw)
    out = cross_entropy(x, target, weight, chunk_size=3, **kw)
    go = torch.randn(out.shape, generator=g)
    torch.testing.assert_close(torch.autograd.grad(out, x, go)[0],
                               torch.autograd.grad(ref, x, go)[0], rtol=1e-5, atol=1e-6)


def test_cross_entropy_probability_targets_and_float64_are_torch():
    """Float targets (class probabilities) and float64 logits go to F.cross_entropy itself."""
    x = torch.randn(5, 7, requires_grad=True)
    probs = torch.softmax(torch.randn(5, 7), 1)
    out = cross_entropy(x, probs, label_smoothing=0.1)
    assert type(out.grad_fn).__name__ != "CrossEntropyFunctionBackward"
    assert torch.equal(out, F.cross_entropy(x, probs, label_smoothing=0.1))
    x64 = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 7, (5,))
    assert torch.equal(cross_entropy(x64, t), F.cross_entropy(x64, t))


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("target", [7, -3])
def test_cross_entropy_bad_target_raises_without_a_read_back(target, weighted):
    """Without the debug checks the targets are not read back (a device wait on a GPU): the
    gathers at the target raise on the CPU, also for a negative target with a class weight
    (indexing would wrap it around silently)."""
    x = torch.randn(4, 5, requires_grad=True)
    t = torch.tensor([0, 1, 2, target])
    weight = torch.rand(5) if weighted else None
    with pytest.raises(RuntimeError, match=f"index {target} is out of bounds"):
        cross_entropy(x, t, weight=weight)


def test_cross_entropy_errors_are_torchs(monkeypatch):
    monkeypatch.setenv("ACTNN_ZOO_DEBUG", "1")  # the target check reads the targets back
    x = torch.randn(4, 5, requires_grad=True)
    t = torch.tensor([0, 1, 2, 3])
    cases = [
        (dict(target=torch.tensor([0, 1, 2])), ValueError, "batch_size"),
        (dict(target=torch.tensor([0, 1, 2, 7])), IndexError, "Target 7 is out of bounds"),
        (dict(target=torch.tensor([0, 1, 2, -3])), IndexError, "Target -3 is out of bounds"),
        # (torch 2.13 words it "Long or Byte, but got Int", as the zoo does; 2.11 "Long but
        # found Int")
        (dict(target=t.int()), RuntimeError, "Long.* Int"),
        (dict(reduction="foo"), ValueError, "not a valid value for reduction"),
        (dict(label_smoothing=1.5), RuntimeError, "label_smoothing must be between"),
        (dict(weight=torch.ones(3)), RuntimeError, "all 5 classes"),
        (dict(weight=torch.ones(5, dtype=torch.float64)), RuntimeError,
         "expected scalar type Float but found Double"),
        (dict(weight=torch.ones(5, requires_grad=True)), RuntimeError, "not differentiable"),
    ]
    for kw, err, msg in cases:
        kw = {"target": t, **kw}
        with pytest.raises(err, match=msg):
            F.cross_entropy(x, **kw)
        with pytest.raises(err, match=msg):
            cross_entropy(x, **kw)
    with pytest.raises(RuntimeError, match="Expected target size"):
        cross_entropy(torch.randn(2, 5, 3, requires_grad=True), torch.zeros(2, 4).long())
    with pytest.raises(ValueError, match="chunk_size"):
        cross_entropy(x, t, chunk_size=0)


def test_cross_entropy_shape_checks_are_remembered_only_when_they_pass():
    """torch's shape and option checks run once per argument set (on meta tensors, ~1 ms):
    a passing set is remembered, a failing one raises on every call, and a new shape is
    checked anew."""
    loss_mod._checked_loss_shape.cache_clear()
    x = torch.randn(4, 5, requires_grad=True)
    t = torch.tensor([0, 1, 2, 3])
    for _ in range(3):
        cross_entropy(x, t).backward()
    info = loss_mod._checked_loss_shape.cache_info()
    assert (info.misses, info.hits) == (1, 2)
    for _ in range(2):  # not remembered: raises each time
        with pytest.raises(ValueError, match="batch_size"):
            cross_entropy(x, torch.tensor([0, 1, 2]))
    with pytest.raises(RuntimeError, match="Expected target size"):
        cross_entropy(torch.randn(2, 5, 3, requires_grad=True), torch.zeros(2, 4).long())
    out = cross_entropy(torch.randn(3, 5, 2, requires_grad=True), torch.zeros(3, 2).long(),
                        reduction="none")
    assert out.shape == (3, 2)


def test_cross_entropy_uint8_targets_and_all_ignored():
    x = torch.randn(4, 5, requires_grad=True)
    t8 = torch.tensor([0, 1, 4, 3], dtype=torch.uint8)
    torch.testing.assert_close(cross_entropy(x, t8), F.cross_entropy(x, t8))
    ignored = torch.full((4,), -100)
    out = cross_entropy(x, ignored, label_smoothing=0.1)  # torch: nan loss, zero gradient
    assert torch.isnan(out) and torch.isnan(F.cross_entropy(x, ignored, label_smoothing=0.1))
    (g,) = torch.autograd.grad(out, x)
    assert torch.equal(g, torch.zeros_like(x))


@HYP
@given(n=st.integers(1, 12), classes=st.integers(1, 300),
       reduction=st.sampled_from(["mean", "sum", "none"]), ignored=st.booleans(),
       uint8=st.booleans(), bits=st.sampled_from([2, 8, "per-sample"]), seed=st.integers(0, 99))
def test_cross_entropy_compiled_rows_equal_the_python_path(n, classes, reduction, ignored, uint8,
                                                           bits, seed):
    """(rows, classes) float32 logits on the CPU run as one compiled call each way
    (cpp_ext/loss_cpu.cpp): the loss, the codes' seed and the gradient are the Python path's,
    bit for bit, for every reduction, ignored rows, uint8 targets and per-sample widths."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, classes, generator=g) * 3).requires_grad_(True)
    t = torch.randint(0, classes, (n,), generator=g)
    if ignored:
        t[::3] = -100
    if uint8:
        t = t.clamp_min(0).to(torch.uint8)
    widths = torch.tensor([1, 2, 4, 8], dtype=torch.uint8)
    b = widths[torch.randint(0, 4, (n,), generator=g)] if bits == "per-sample" else bits
    go = torch.randn(n if reduction == "none" else (), generator=g)

    def run():
        torch.manual_seed(seed)  # the seed compress draws for the codes
        out = cross_entropy(x, t, reduction=reduction, bits=b)
        return out, torch.autograd.grad(out, x, go)[0]

    assert loss_mod._rows_compiled(x, None, 0.0, None)
    calls = []
    with pytest.MonkeyPatch.context() as mp:  # count the compiled forward's calls
        fwd = loss_mod._ROWS_FORWARD
        mp.setattr(loss_mod, "_ROWS_FORWARD", lambda *a: calls.append(1) or fwd(*a))
        out, grad = run()
    assert calls == [1]  # the compiled path ran, and only once
    assert type(out.grad_fn).__name__ == "CrossEntropyFunctionBackward"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loss_mod, "_ROWS_FORWARD", None)
        ref_out, ref_grad = run()
    assert out.dtype == ref_out.dtype and out.shape == ref_out.shape
    assert torch.equal(out, ref_out) or (out.isnan().all() and ref_out.isnan().all())
    assert torch.equal(grad, ref_grad)


def test_cross_entropy_compiled_rows_only_where_they_apply(monkeypatch):
    """Anything but contiguous float32 (rows, classes) logits without weights or smoothing, in
    one chunk and without the debug checks, takes the Python path; the compiled calls check
    their own arguments."""
    x = torch.randn(6, 5)
    assert loss_mod._rows_compiled(x, None, 0.0, None)
    assert not loss_mod._rows_compiled(x.t(), None, 0.0, None)  # not contiguous
    assert not loss_mod._rows_compiled(x.double(), None, 0.0, None)
    assert not loss_mod._rows_compiled(x.reshape(6, 5, 1), None, 0.0, None)
    assert not loss_mod._rows_compiled(x[:0], None, 0.0, None)
    assert not loss_mod._rows_compiled(x, torch.ones(5), 0.0, None)
    assert not loss_mod._rows_compiled(x, None, 0.1, None)
    assert not loss_mod._rows_compiled(x, None, 0.0, 5)  # two chunks of rows
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not loss_mod._rows_compiled(x, None, 0.0, None)
    monkeypatch.setenv("ACTNN_ZOO_DEBUG", "1")
    assert not loss_mod._rows_compiled(x, None, 0.0, None)
    monkeypatch.delenv("ACTNN_ZOO_DEBUG")
    fwd, bwd = loss_mod._ROWS_FORWARD, loss_mod._ROWS_BACKWARD
    t = torch.tensor([0, 1, 2, 3, 4, 0])
    with pytest.raises(ValueError, match="contiguous float32"):
        fwd(x.double(), t, -100, 1, True)
    with pytest.raises(ValueError, match="reduction code"):
        fwd(x, t, -100, 3, True)
    with pytest.raises(ValueError, match="int64 or uint8"):
        fwd(x, t.int(), -100, 1, True)
    with pytest.raises(ValueError, match="5 targets for 6 rows"):
        fwd(x, t[:5], -100, 1, True)
    _, tt, a, d, q = fwd(x, t, -100, 0, True)
    with pytest.raises(ValueError, match="'none' needs 6 gradient values"):
        bwd(q, tt, a, d, torch.ones(5), 0)
    with pytest.raises(ValueError, match="6 int64 targets"):
        bwd(q, tt[:5], a, d, torch.ones(()), 1)
    with pytest.raises(RuntimeError, match="index 7 is out of bounds"):
        fwd(x, torch.tensor([0, 1, 2, 3, 4, 7]), -100, 1, True)


# ----------------------------------------------------------------------------------------------
# Unbiasedness at 2 bits
# ----------------------------------------------------------------------------------------------
def _unbiased_check(sample: Callable[[], Tensor], exact: Tensor, k: int, group: int = 256
                    ) -> Tuple[float, float, float]:
    """K draws of a 2-d gradient whose rows are quantized in groups of ``group`` columns.

    Returns (z_bound, z_null, ratio):

    * z_bound: the largest |mean - exact| / SE over all elements, SE being the largest
      standard error a stochastic rounding on the group's lattice can have, step / 2 /
      sqrt(K) (a two-point variable has variance <= step^2 / 4). The step of a group is read
      off the draws: the widest spread (max - min over the K draws) of any of its elements (an
      element that ever rounded both ways spans exactly one step). By Hoeffding, |z| > 5 has
      probability <= 2 e^-12.5 = 7e-6 per element for an unbiased estimator. A group none of
      whose elements varied must be exact (inf otherwise).
    * z_null: the same with each element's own standard error if it is unbiased: its draws
      take two values L < U (the lattice around it), so the mean is exact only if it rounds
      up with probability f = (exact - L) / (U - L), and then SE = (U - L) sqrt(f (1-f) / K).
      Over the elements with K f (1-f) >= 10, where the normal approximation holds. (The
      sample SD is no good here: an element that rounded up 4 times where 16 were expected
      has a third of its true SD.)
    * ratio: ||mean - exact|| * sqrt(K) / single-draw RMS error, ~1 for an unbiased estimator
      (E||mean - exact||^2 = RMS^2 / K); a bias b adds ||b|| that averaging does not remove.
    """
    exact = exact.double()
    draws = torch.stack([sample().double() for _ in range(k)])
    mean = draws.mean(0)
    err = (mean - exact).abs()
    spread = draws.amax(0) - draws.amin(0)
    n, c = exact.shape
    step = F.pad(spread, (0, (-c) % group)).view(n, -1, group).amax(2)
    step = step.repeat_interleave(group, 1)[:, :c]
    flat = step == 0  # no element of the group varied: it must be exact (ignored rows)
    z_bound = float(torch.where(flat, torch.where(err <= 1e-7, 0.0, math.inf),
                                err / (step / 2 / math.sqrt(k))).max())
    lo = draws.amin(0)
    f = ((exact - lo) / spread.clamp_min(1e-300)).clamp(0, 1)
    usable = (spread > 0) & (k * f * (1 - f) >= 10)
    z_null = float((err / (spread * (f * (1 - f) / k).sqrt()))[usable].max()) \
        if bool(usable.any()) else math.inf
    rms = math.sqrt(float(((draws - exact) ** 2).sum(dim=(1, 2)).mean()))
    ratio = float((mean - exact).norm()) * math.sqrt(k) / rms
    return z_bound, z_null, ratio


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_cross_entropy_unbiased_at_2_bits(reduction):
    """K = 300 draws, 24 rows x 700 classes (3 groups a row), weights, label smoothing and
    ignored rows: every element within 5 standard errors of the exact gradient (both kinds of
    :func:`_unbiased_check`), and the error of the mean ~ RMS / sqrt(K) (ratio in
    [0.8, 1.25]). Round-to-nearest, which is biased, gives a ratio > 3 even at K = 20."""
    torch.manual_seed(0)
    x = (torch.randn(24, 700) * 2).requires_grad_(True)
    target = torch.randint(0, 700, (24,))
    target[::5] = -100
    weight = torch.rand(700) + 0.5
    kw = dict(reduction=reduction, label_smoothing=0.1)
    ref = F.cross_entropy(x, target, weight, **kw)
    go = torch.randn(ref.shape)
    (exact,) = torch.autograd.grad(ref, x, go)

    def sample() -> Tensor:
        return torch.autograd.grad(cross_entropy(x, target, weight, qconfig=Q2, **kw), x,
                                   go)[0]

    z_bound, z_null, ratio = _unbiased_check(sample, exact, k=300)
    print(f"cross_entropy {reduction}: max |z| {z_bound:.2f} (bound SE), {z_null:.2f} "
          f"(SE if unbiased); ||mean - exact|| sqrt(K) / RMS = {ratio:.3f}")
    assert z_bound <= 5 and z_null <= 5 and 0.8 <= ratio <= 1.25

    def nearest() -> Tensor:  # negative control: round-to-nearest is biased, and is caught
        q = LayerQConfig(bits=2, rounding="nearest")
        return torch.autograd.grad(cross_entropy(x, target, weight, qconfig=q, **kw), x,
                                   go)[0]

    _, _, biased = _unbiased_check(nearest, exact, k=20)
    assert biased > 3, biased


def test_linear_cross_entropy_unbiased_at_2_bits():
    """Same check for the fused loss's dL/dx (the only compressed gradient; dW, db exact):
    K = 300, 48 tokens x 300 hidden (groups 256 + 44), 2000 classes."""
    torch.manual_seed(1)
    x = torch.randn(48, 300).requires_grad_(True)
    w = (torch.randn(2000, 300) * 0.1).requires_grad_(True)
    target = torch.randint(0, 2000, (48,))
    target[::7] = -100
    ref = F.cross_entropy(F.linear(x, w), target, label_smoothing=0.1)
    exact, exact_w = torch.autograd.grad(ref, (x, w))

    def sample() -> Tensor:
        out = linear_cross_entropy(x, w, None, target, label_smoothing=0.1, chunk_size=20,
                                   qconfig=Q2)
        gx, gw = torch.autograd.grad(out, (x, w))
        torch.testing.assert_close(gw, exact_w, rtol=1e-4, atol=1e-7)
        return gx

    z_bound, z_null, ratio = _unbiased_check(sample, exact, k=300)
    print(f"linear_cross_entropy: max |z| {z_bound:.2f} (bound SE), {z_null:.2f} "
          f"(SE if unbiased); ||mean - exact|| sqrt(K) / RMS = {ratio:.3f}")
    assert z_bound <= 5 and z_null <= 5 and 0.8 <= ratio <= 1.25


# ----------------------------------------------------------------------------------------------
# What is saved
# ----------------------------------------------------------------------------------------------
def test_cross_entropy_saves_under_a_twelfth_of_the_log_softmax():
    """GPT-2's loss at batch 4 x 1024: N = 4096 tokens, C = 50257. At 2 bits the saved tensors
    (compressed softmax chunks, target index, two fp32 coefficients per row) are <= 1/12 of
    the fp32 [N, C] log-softmax torch saves (measured: 1/15); nothing of size N x C is kept
    uncompressed."""
    n, c = 4096, 50257
    torch.manual_seed(0)
    x = torch.randn(n, c).requires_grad_(True)
    target = torch.randint(0, c, (n,))
    out, items = saved(lambda: cross_entropy(x, target))
    total = sum(b for _, _, b in items)
    codes = n * math.ceil(c * 2 / 8) + n * math.ceil(c / 256) * 2 * 2
    assert codes <= total <= codes + n * 16 + 4096
    assert total * 12 <= n * c * 4, total
    for shape, dtype, _ in items:
        assert dtype in (torch.uint8, torch.bfloat16) or math.prod(shape) <= n, (shape, dtype)
    _, torch_items = saved(lambda: F.cross_entropy(x, target))
    assert max(b for _, _, b in torch_items) >= n * c * 4  # the log-softmax, for comparison
    out.backward()  # and the saved tensors do give a gradient
    assert x.grad.shape == (n, c)


def test_linear_cross_entropy_saves_no_logits_and_skips_unneeded_grads():
    """Saved (parameters excluded): compressed dL/dx, target, one fp32 per token, dL/dW and
    dL/db (parameter-sized): nothing of tokens x classes. A frozen weight gets no dL/dW."""
    torch.manual_seed(0)
    n, h, c = 512, 64, 5000
    x = torch.randn(n, h, requires_grad=True)
    w = (torch.randn(c, h) * 0.1).requires_grad_(True)
    b = torch.zeros(c, requires_grad=True)
    target = torch.randint(0, c, (n,))
    _, items = saved(lambda: linear_cross_entropy(x, w, b, target), exclude=(w, b))
    assert all(math.prod(s) < n * c for s, _, _ in items)
    assert sorted(s for s, d, _ in items if d == torch.float32) == [(512,), (5000,),
                                                                   (5000, 64)]
    total = sum(nb for _, _, nb in items)
    assert total <= (c * h + c) * 4 + n * h * 2 // 8 + n * 4 + n * 24
    w.requires_grad_(False)
    b.requires_grad_(False)
    out, items = saved(lambda: linear_cross_entropy(x, w, b, target), exclude=(w, b))
    assert not [s for s, _, _ in items if s in ((c, h), (c,))]  # no dW, no db
    out.backward()
    assert w.grad is None and b.grad is None and x.grad is not None
    x.grad = None
    x.requires_grad_(False)
    w.requires_grad_(True)
    out, items = saved(lambda: linear_cross_entropy(x, w, None, target), exclude=(w,))
    assert [s for s, _, _ in items] == [(c, h)]  # dW alone
    out.backward()
    assert x.grad is None and w.grad.shape == (c, h)


def test_linear_cross_entropy_never_allocates_logits():
    """N = 256 tokens, C = 4000 classes, chunks of 32 rows. torch.profiler's memory events
    (profile_memory=True) give each op's allocation: the largest one over forward and backward
    stays under N * C * 4 / 2 bytes, while the plain linear + cross_entropy allocates the full
    N x C fp32 logits (checked too, so the measurement can see them)."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    n, h, c = 256, 64, 4000
    x = torch.randn(n, h, requires_grad=True)
    w = (torch.randn(c, h) * 0.1).requires_grad_(True)
    target = torch.randint(0, c, (n,))

    def largest(fn: Callable[[], Tensor]) -> int:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn().backward()
        return max(e.cpu_memory_usage for e in prof.events())

    assert largest(lambda: F.cross_entropy(F.linear(x, w), target)) >= n * c * 4
    fused = largest(lambda: linear_cross_entropy(x, w, None, target, chunk_size=32))
    assert fused < n * c * 4 // 2, fused


# ----------------------------------------------------------------------------------------------
# linear_cross_entropy: torch's loss, 8-bit gradients ~ exact
# ----------------------------------------------------------------------------------------------
@HYP
@given(n=st.integers(1, 40), h=st.integers(1, 48), c=st.integers(1, 300),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), bias=st.booleans(),
       three_d=st.booleans(), reduction=st.sampled_from(["mean", "sum"]),
       smoothing=st.sampled_from([0.0, 0.1, 1.0]), ignore=st.booleans(),
       chunk=st.sampled_from([None, 1, 3, 16]), seed=st.integers(0, 2 ** 16))
def test_linear_cross_entropy_matches_torch(n, h, c, dtype, bias, three_d, reduction,
                                            smoothing, ignore, chunk, seed):
    """Loss equal to F.cross_entropy(F.linear(x, W, b), target) (fp32 rtol 1e-5; bf16: the
    logits are bf16 in both, the rest fp32 here, so 2 bf16 roundings); gradients of x, W, b at
    8 bits: cosine >= 0.9999 with exact fp32 autograd."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g).to(dtype)
    w = (torch.randn(c, h, generator=g) / math.sqrt(h) * 3).to(dtype)
    b = (torch.randn(c, generator=g) * 0.5).to(dtype) if bias else None
    target = torch.randint(0, c, (n,), generator=g)
    if ignore:
        target[::3] = -100
    if three_d and n % 2 == 0:
        x, target = x.view(2, n // 2, h), target.view(2, n // 2)
    kw = dict(reduction=reduction, label_smoothing=smoothing)
    leaves = [t.clone().requires_grad_(True) for t in (x, w) + ((b,) if bias else ())]
    lx, lw, lb = leaves[0], leaves[1], leaves[2] if bias else None
    ref32 = [t.float().requires_grad_(True) for t in leaves]
    logits = F.linear(lx.detach(), lw.detach(), None if lb is None else lb.detach())
    ref_val = F.cross_entropy(logits.float().reshape(-1, c), target.reshape(-1), **kw)
    out = linear_cross_entropy(lx, lw, lb, target, chunk_size=chunk, qconfig=Q8, **kw)
    assert out.dtype == dtype and out.shape == ()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(out.float(), ref_val, equal_nan=True, **tol)
    ref = F.cross_entropy(F.linear(ref32[0], ref32[1], ref32[2] if bias else None)
                          .reshape(-1, c), target.reshape(-1), **kw)
    exact = torch.autograd.grad(ref, ref32)
    got = torch.autograd.grad(out, leaves)
    for name, a, e in zip("xWb", got, exact):
        assert a.dtype == dtype and a.shape == e.shape
        if e.norm() == 0:  # (C = 1: the compressed part -c W cancels the exact d W[t])
            assert a.float().abs().max() <= 1e-4, name
        else:
            assert cosine(a, e) >= 0.9999, (name, cosine(a, e))


def test_linear_cross_entropy_formulas_exact_without_compression(monkeypatch):
    monkeypatch.setattr(loss_mod, "compress", lambda x, qconfig, bits=None: x)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 7, 16, generator=g, requires_grad=True)
    w = (torch.randn(50, 16, generator=g) * 0.5).requires_grad_(True)
    b = torch.randn(50, generator=g, requires_grad=True)
    target = torch.randint(0, 50, (3, 7), generator=g)
    target[0, :4] = -100
    for reduction in ("mean", "sum"):
        kw = dict(reduction=reduction, label_smoothing=0.15)
        ref = F.cross_entropy(F.linear(x, w, b).reshape(-1, 50), target.reshape(-1), **kw)
        out = linear_cross_entropy(x, w, b, target, chunk_size=4, **kw)
        torch.testing.assert_close(out, ref)
        for a, e in zip(torch.autograd.grad(out, (x, w, b)),
                        torch.autograd.grad(ref, (x, w, b))):
            torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)


def test_linear_cross_entropy_errors_and_fallbacks():
    x = torch.randn(6, 8, requires_grad=True)
    w = torch.randn(10, 8, requires_grad=True)
    t = torch.randint(0, 10, (6,))
    with pytest.raises(NotImplementedError, match="reduction='none'"):
        linear_cross_entropy(x, w, None, t, reduction="none")
    with pytest.raises(ValueError, match="not a valid value for reduction"):
        linear_cross_entropy(x, w, None, t, reduction="avg")
    with pytest.raises(RuntimeError):  # torch's own message for mismatched dtypes
        linear_cross_entropy(x, w.detach().bfloat16(), None, t)
    with pytest.raises(RuntimeError, match="same reduction dim|shapes cannot be multiplied"):
        linear_cross_entropy(x, torch.randn(10, 5), None, t)
    with pytest.raises(ValueError, match="target shape"):
        linear_cross_entropy(x, w, None, t[:5])
    with pytest.raises((IndexError, RuntimeError), match="out of bounds"):
        linear_cross_entropy(x, w, None, torch.full((6,), 10))
    with pytest.raises(RuntimeError, match="label_smoothing"):
        linear_cross_entropy(x, w, None, t, label_smoothing=1.5)
    probs = torch.softmax(torch.randn(6, 10), 1)  # probability targets: plain torch
    torch.testing.assert_close(linear_cross_entropy(x, w, None, probs),
                               F.cross_entropy(F.linear(x, w), probs))
    x64, w64 = x.double(), w.double()
    torch.testing.assert_close(linear_cross_entropy(x64, w64, None, t),
                               F.cross_entropy(F.linear(x64, w64), t))
    with torch.no_grad():
        out = linear_cross_entropy(x, w, None, t)
    torch.testing.assert_close(out, F.cross_entropy(F.linear(x, w), t))
    assert out.grad_fn is None


# ----------------------------------------------------------------------------------------------
# Autograd behaviour shared by both
# ----------------------------------------------------------------------------------------------
def _both(x: Tensor, target: Tensor, w: Tensor, reduction: str = "mean"):
    """(cross_entropy on linear logits, fused) at 2 bits, as closures."""
    return [lambda: cross_entropy(F.linear(x, w), target, reduction=reduction),
            lambda: linear_cross_entropy(x, w, None, target, reduction=reduction)]


def test_retain_graph_twice_identical_and_create_graph_raises():
    torch.manual_seed(0)
    x = torch.randn(10, 16, requires_grad=True)
    w = torch.randn(30, 16, requires_grad=True)
    target = torch.randint(0, 30, (10,))
    for fn in _both(x, target, w):
        out = fn()
        first = torch.autograd.grad(out, (x, w), retain_graph=True)
        second = torch.autograd.grad(out, (x, w), retain_graph=True)
        for a, b in zip(first, second):
            assert torch.equal(a, b)
        with pytest.raises(NotImplementedError, match="double backward"):
            torch.autograd.grad(fn(), (x, w), create_graph=True)


def test_ignored_rows_get_exactly_zero_gradient():
    """At 2 bits: rows of ignore_index get exactly 0 (their compressed rows are all zero, and
    groups never span rows), for cross_entropy (also per position of a (N, C, d) input) and
    for the fused loss with (batch, tokens, hidden) input."""
    torch.manual_seed(0)
    x = torch.randn(8, 37, 3, requires_grad=True)
    target = torch.randint(0, 37, (8, 3))
    target[2] = -100
    target[5, 1] = -100
    (g,) = torch.autograd.grad(cross_entropy(x, target, label_smoothing=0.1, qconfig=Q2), x)
    assert torch.equal(g[2], torch.zeros_like(g[2])) and g[5, :, 1].abs().max() == 0
    assert g[5, :, 0].abs().max() > 0
    h = torch.randn(2, 5, 24, requires_grad=True)  # tokens of 24 values: groups would span
    w = torch.randn(40, 24, requires_grad=True)
    t = torch.randint(0, 40, (2, 5))
    t[1, 2] = -100
    gx, gw = torch.autograd.grad(linear_cross_entropy(h, w, None, t, qconfig=Q2), (h, w))
    assert torch.equal(gx[1, 2], torch.zeros(24)) and gx[1, 1].abs().max() > 0
    assert gw.abs().max() > 0


def test_target_gets_no_gradient_and_grad_fn_names():
    x = torch.randn(4, 6, requires_grad=True)
    t = torch.randint(0, 6, (4,))
    out = cross_entropy(x, t)
    assert type(out.grad_fn).__name__ == "CrossEntropyFunctionBackward"
    # target is an integer tensor: no gradient slot; autograd treats it as a constant
    assert all(f is None or "AccumulateGrad" in type(f).__name__
               for f, _ in out.grad_fn.next_functions)
    out.backward()
    assert t.grad is None


def test_autocast_cpu_like_torch():
    """Under CPU autocast (bfloat16) torch runs cross_entropy in float32 and the linear in
    bfloat16: losses (and their dtypes) and gradient dtypes match torch's."""
    torch.manual_seed(0)
    xb = (torch.randn(12, 50) * 3).bfloat16().requires_grad_(True)
    t = torch.randint(0, 50, (12,))
    h = torch.randn(12, 16, requires_grad=True)
    w = torch.randn(50, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = F.cross_entropy(xb, t, label_smoothing=0.1)
        out = cross_entropy(xb, t, label_smoothing=0.1, qconfig=Q8)
        ref_f = F.cross_entropy(F.linear(h, w), t)
        out_f = linear_cross_entropy(h, w, None, t, qconfig=Q8)
    assert out.dtype == ref.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert out_f.dtype == ref_f.dtype == torch.float32
    torch.testing.assert_close(out_f, ref_f, rtol=1e-3, atol=1e-3)
    g, g_ref = torch.autograd.grad(out, xb)[0], torch.autograd.grad(ref, xb)[0]
    assert g.dtype == torch.bfloat16 and cosine(g, g_ref) >= 0.9999
    gf = torch.autograd.grad(out_f, (h, w))
    gf_ref = torch.autograd.grad(ref_f, (h, w))
    for a, e in zip(gf, gf_ref):
        assert a.dtype == torch.float32 and cosine(a, e) >= 0.999


def test_per_sample_bits():
    """One width per sample of dim 0 (like the layers'): applied to all rows of the sample."""
    torch.manual_seed(0)
    x = torch.randn(4, 300, 2, requires_grad=True)
    t = torch.randint(0, 300, (4, 2))
    bits = torch.tensor([8, 8, 8, 8])
    (g,) = torch.autograd.grad(cross_entropy(x, t, bits=bits, chunk_size=3), x)
    (e,) = torch.autograd.grad(F.cross_entropy(x, t), x)
    assert cosine(g, e) >= 0.9999
    h = torch.randn(4, 3, 16, requires_grad=True)
    w = torch.randn(300, 16, requires_grad=True)
    t2 = torch.randint(0, 300, (4, 3))
    (gh,) = torch.autograd.grad(linear_cross_entropy(h, w, None, t2, bits=bits), h)
    (eh,) = torch.autograd.grad(F.cross_entropy(F.linear(h, w).reshape(-1, 300),
                                                t2.reshape(-1)), h)
    assert cosine(gh, eh) >= 0.9999


# ----------------------------------------------------------------------------------------------
# CUDA: the same code on the GPU
# ----------------------------------------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
class TestCUDA:
    def test_cross_entropy(self):
        torch.manual_seed(0)
        x = (torch.randn(64, 1000, device="cuda") * 3).requires_grad_(True)
        t = torch.randint(0, 1000, (64,), device="cuda")
        t[::5] = -100
        w = torch.rand(1000, device="cuda") + 0.5
        for reduction in ("mean", "sum", "none"):
            kw = dict(reduction=reduction, label_smoothing=0.1)
            ref = F.cross_entropy(x, t, w, **kw)
            out = cross_entropy(x, t, w, qconfig=Q8, chunk_size=7, **kw)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
            go = torch.randn(ref.shape, device="cuda")
            g, e = torch.autograd.grad(out, x, go)[0], torch.autograd.grad(ref, x, go)[0]
            assert cosine(g, e) >= 0.9999

    def test_linear_cross_entropy_and_memory(self):
        torch.manual_seed(0)
        n, h, c = 1024, 64, 32000
        x = torch.randn(n, h, device="cuda", requires_grad=True)
        w = (torch.randn(c, h, device="cuda") * 0.1).requires_grad_(True)
        t = torch.randint(0, c, (n,), device="cuda")
        ref = F.cross_entropy(F.linear(x, w), t)
        exact = torch.autograd.grad(ref, (x, w))
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = linear_cross_entropy(x, w, None, t, chunk_size=64, qconfig=Q8)
        got = torch.autograd.grad(out, (x, w))
        peak = torch.cuda.max_memory_allocated() - base
        assert peak < n * c * 4 // 2, peak  # never the [N, C] logits
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        for a, e in zip(got, exact):
            assert cosine(a, e) >= 0.9999

    def test_autocast(self):
        torch.manual_seed(0)
        x = torch.randn(32, 500, device="cuda").half().requires_grad_(True)
        t = torch.randint(0, 500, (32,), device="cuda")
        with torch.autocast("cuda", dtype=torch.float16):
            ref = F.cross_entropy(x, t)
            out = cross_entropy(x, t, qconfig=Q8)
        assert out.dtype == ref.dtype == torch.float32
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
        g = torch.autograd.grad(out, x)[0]
        assert g.dtype == torch.float16
        assert cosine(g, torch.autograd.grad(ref, x)[0]) >= 0.9999
