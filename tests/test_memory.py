"""Saved-activation accounting on hand-built cases, and the peak-memory child process."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from actnn_zoo.bench import (PeakReport, StepSpec, current_rss, find_max_batch, peak_rss,
                             spec_peak_memory)
from actnn_zoo.memory import OUTSIDE, ROOT, compression_ratio, saved_activation_bytes

F32 = 4


class Mul(nn.Module):
    def forward(self, x, y):
        return x * y


class SquareOfExp(nn.Module):
    """exp saves its result; a * a saves the same tensor twice more."""

    def forward(self, x):
        a = x.exp()
        return a * a


class Halves(nn.Module):
    """sin saves x; the product saves two views of one storage."""

    def forward(self, x):
        y = x.sin()
        return y[:, :5] * y[:, 5:]


class Parent(nn.Module):
    """Saves something in its own forward (x * x) besides its child Linear's input."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 3)

    def forward(self, x):
        return self.lin(x * x)


def test_mul_saves_both_operands():
    x = torch.randn(100, requires_grad=True)
    y = torch.randn(100, requires_grad=True)
    r = saved_activation_bytes(Mul(), x, y)
    assert r.total_bytes == 2 * 100 * F32
    assert r.num_tensors == 2
    assert r.dtype_bytes == {"float32": 800}
    assert r.module_bytes == {ROOT: 800}


def test_linear_saves_input_not_weight():
    lin = nn.Linear(64, 32)
    x = torch.randn(8, 64, requires_grad=True)  # then addmm also saves weight.t() (a param view)
    r = saved_activation_bytes(lin, x)
    assert r.total_bytes == 8 * 64 * F32
    assert r.num_tensors == 1
    assert r.num_param_refs >= 1


def test_same_storage_counted_once():
    x = torch.randn(10, 10, requires_grad=True)
    r = saved_activation_bytes(SquareOfExp(), x)
    assert r.total_bytes == 100 * F32 and r.num_tensors == 1 and r.num_duplicates >= 1
    r = saved_activation_bytes(Halves(), x)
    assert r.total_bytes == 2 * 100 * F32  # x, and y's whole storage once for both views
    assert r.num_tensors == 2


def test_per_module_attribution_innermost():
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
    x = torch.randn(5, 16)
    r = saved_activation_bytes(seq, x, loss_fn=lambda out: out.pow(2).sum())
    # Linear 0 saves x; ReLU saves its output, which Linear 2 saves again (counted once, to the
    # module that saved it first); the loss's pow saves the model output outside any module.
    assert r.module_bytes == {"0": 5 * 16 * F32, "1": 5 * 8 * F32, OUTSIDE: 5 * 4 * F32}
    assert r.total_bytes == sum(r.module_bytes.values())
    p = saved_activation_bytes(Parent(), torch.randn(2, 6, requires_grad=True))
    assert p.module_bytes == {ROOT: 2 * 6 * F32, "lin": 2 * 6 * F32}


def test_buffers_and_rng_preserved_and_repeatable():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Dropout(0.5)).train()
    x = torch.randn(4, 1, 8, 8)
    before = copy.deepcopy(m.state_dict())
    state = torch.get_rng_state()
    a = saved_activation_bytes(m, x)
    b = saved_activation_bytes(m, x)
    assert a.total_bytes == b.total_bytes > 0
    assert torch.equal(torch.get_rng_state(), state)
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert a.training
    # The tracker left nothing behind: a plain forward/backward still works.
    m(x).sum().backward()


def test_compression_ratio_hand_built():
    x = torch.randn(8, 64, requires_grad=True)
    # Mul on (x, x) saves one storage; Mul on (x, 2x) saves two: ratio 2.
    double = type("Double", (nn.Module,), {"forward": lambda self, a: a * (2 * a)})()
    single = type("Single", (nn.Module,), {"forward": lambda self, a: a * a})()
    assert compression_ratio(double, single, x) == pytest.approx(2.0)


def test_converted_cnn_compresses():
    from actnn_zoo.bench import apply_mode
    from actnn_zoo.models import build_model, example_batch

    torch.manual_seed(0)
    model = build_model("resnet", width=16).train()
    x, _ = example_batch("resnet", 32, {})
    q = apply_mode(copy.deepcopy(model), "bits", 2)
    rep = saved_activation_bytes(q, x)
    assert "uint8" in rep.dtype_bytes
    assert compression_ratio(model, q, x) > 8


def test_rss_counters():
    rss = current_rss()
    peak, method = peak_rss()
    assert rss is None or rss > 0
    assert peak > 0 and method in ("VmHWM", "ru_maxrss")


def test_find_max_batch_bisects_with_fake_measure():
    def measure(spec: StepSpec) -> PeakReport:
        return PeakReport(delta_bytes=spec.batch_size * 1000)

    res = find_max_batch(StepSpec("resnet", 1), 100_000, start=8, rel_tol=0.0, measure=measure)
    assert res.batch_size == 100
    assert not res.hit_limit
    assert all(ok == (b <= 100) for b, _, ok in res.tries)
    capped = find_max_batch(StepSpec("resnet", 1), 10 ** 9, start=8, limit=64, measure=measure)
    assert capped.batch_size == 64 and capped.hit_limit


def test_find_max_batch_stops_on_a_failed_try_and_counts_out_of_memory_as_too_big():
    """An out-of-memory try (or a child the OOM killer ended) is "too big"; any other failure
    raises, naming the batch and the error, instead of ending the search at a wrong size."""
    def measure(spec: StepSpec) -> PeakReport:
        if spec.batch_size > 40:
            return PeakReport(error="MemoryError: cannot allocate")
        if spec.batch_size > 20:
            return PeakReport(error="child exited with -9: Killed")
        return PeakReport(delta_bytes=spec.batch_size)

    res = find_max_batch(StepSpec("resnet", 1), 10 ** 9, start=8, rel_tol=0.0, measure=measure)
    assert res.batch_size == 20

    def broken(spec: StepSpec) -> PeakReport:
        if spec.batch_size > 16:
            return PeakReport(error="TypeError: quantize_affine(): incompatible arguments")
        return PeakReport(delta_bytes=spec.batch_size)

    with pytest.raises(RuntimeError, match="batch 32 failed: TypeError"):
        find_max_batch(StepSpec("resnet", 1), 10 ** 9, start=8, measure=broken)


def test_step_spec_names_a_bad_mode_before_any_child_runs():
    with pytest.raises(ValueError, match="mode must be one of"):
        StepSpec("resnet", 8, mode="2-bit")


def test_step_spec_names_a_bad_phase():
    with pytest.raises(ValueError, match="phase must be one of"):
        StepSpec("resnet", 8, phase="backward")


@pytest.mark.parametrize("mode", ["fp32", "bits"])
@pytest.mark.parametrize("phase", ["forward", "no_grad"])
def test_step_phases_run_part_of_a_step(monkeypatch, mode, phase):
    """"forward" records a graph and drops it, "no_grad" records none; neither runs backward
    or updates the weights, and both return the loss the full step computes first."""
    import actnn_zoo.bench as bench
    from actnn_zoo import models

    built = []
    real_build = models.build_model

    def spy(*args, **kwargs):
        built.append(real_build(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(models, "build_model", spy)
    kw = {"width": 8, "dropout": 0.0}  # no random stream: the Q-layers draw seeds from it
    part = bench.build_step(StepSpec("resnet", 8, mode=mode, model_kwargs=kw, phase=phase))
    model = built[0]
    before = [p.detach().clone() for p in model.parameters()]
    losses = [part() for _ in range(2)]
    first_step_loss = bench.build_step(StepSpec("resnet", 8, mode=mode, model_kwargs=kw))()
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert all(not loss.requires_grad for loss in losses)
    torch.testing.assert_close(losses[0], first_step_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(losses[1], first_step_loss, rtol=1e-5, atol=1e-5)


def test_step_spec_labels_name_the_phase():
    assert StepSpec("resnet", 8, phase="no_grad").label == "floor"
    assert StepSpec("resnet", 8, mode="bits", phase="forward").label == "2-bit forward"
    assert StepSpec("resnet", 8, mode="bits", bits=None, phase="no_grad").label == \
        "converted no-grad forward"
    assert StepSpec("resnet", 8, mode="bits").label == "2-bit"


def test_floor_peak_is_below_the_forward_and_the_step():
    """The no-grad forward keeps nothing for backward: at a batch where activations dominate,
    its peak is well below the forward that saves them, which is below the full step."""
    kw = {"width": 16}
    floor, forward, step = (spec_peak_memory(StepSpec("resnet", 512, model_kwargs=kw, steps=1,
                                                      phase=phase))
                            for phase in ("no_grad", "forward", "step"))
    assert floor.ok and forward.ok and step.ok, (floor.error, forward.error, step.error)
    # fp32 at 512, width 16: ~17 MiB saved; the floor holds a few 2 MiB maps
    assert floor.delta_bytes < forward.delta_bytes / 2
    assert forward.delta_bytes <= step.delta_bytes * 1.05


def test_peak_memory_child_grows_with_batch():
    small = spec_peak_memory(StepSpec("resnet", 32, model_kwargs={"width": 16}, steps=1))
    large = spec_peak_memory(StepSpec("resnet", 1024, model_kwargs={"width": 16}, steps=1))
    assert small.ok and large.ok, (small.error, large.error)
    assert small.delta_bytes > 0
    # ~35 MiB of fp32 activations at 1024 (saved_activation_bytes), ~1 MiB at 32.
    assert large.delta_bytes > small.delta_bytes + 16 * 2 ** 20
    assert "VmHWM" in large.method or "ru_maxrss" in large.method


def test_peak_memory_child_error_is_reported():
    rep = spec_peak_memory(StepSpec("no_such_model", 4))
    assert not rep.ok and "no_such_model" in rep.error


class Discards(nn.Module):
    """Computes a softmax with grad enabled and throws it away (like a statistics hook)."""

    def forward(self, x):
        x.softmax(-1).sum().item()  # saved by SoftmaxBackward, then discarded
        return x.exp()  # exp saves its own output: kept


def test_discarded_branches_not_counted():
    x = torch.randn(4, 10, requires_grad=True)
    r = saved_activation_bytes(Discards(), x)
    assert r.total_bytes == 40 * F32 and r.num_tensors == 1 and r.num_discarded == 1


def test_interleaved_step_times_use_the_given_clock_round_robin():
    """The clock is read around each step (a fake clock ticking once per read makes every step
    take 1), and the modes alternate in rounds rather than running one after the other, every
    other round in reverse order (no mode always follows the same one)."""
    from actnn_zoo.bench import interleaved_step_times

    reads, order = [0], []

    def clock() -> float:
        reads[0] += 1
        return float(reads[0])

    steps = {name: (lambda name=name: order.append(name)) for name in ("a", "b", "c")}
    times = interleaved_step_times(steps, n=6, warmup=1, rounds=3, clock=clock)
    assert times == {"a": [1.0] * 6, "b": [1.0] * 6, "c": [1.0] * 6}
    assert order == (["a", "b", "c"] + ["a"] * 2 + ["b"] * 2 + ["c"] * 2
                     + ["c"] * 2 + ["b"] * 2 + ["a"] * 2 + ["a"] * 2 + ["b"] * 2 + ["c"] * 2)


def test_max_batch_cli_floor_mode_and_unknown_modes(monkeypatch, capsys):
    """``--modes floor`` searches the plain no-grad forward (StepSpec phase); an unknown mode is
    named before any search starts."""
    import actnn_zoo.bench as bench
    from actnn_zoo.__main__ import main

    seen = []

    def fake_search(spec, cap, **kwargs):
        seen.append(spec)
        return bench.MaxBatchResult(64 if spec.phase == "no_grad" else 16, cap)

    monkeypatch.setattr(bench, "find_max_batch", fake_search)
    assert main(["max-batch", "--modes", "fp32,floor", "--cap-mib", "1"]) == 0
    assert [(s.mode, s.phase) for s in seen] == [("fp32", "step"), ("fp32", "no_grad")]
    assert "4.0x" in capsys.readouterr().out  # floor 64 against fp32 16
    with pytest.raises(SystemExit, match=r"unknown mode\(s\) \['bogus'\]"):
        main(["max-batch", "--modes", "fp32,bogus"])
