#!/usr/bin/env python
"""Host cost of a converted model's training step: what the library adds on the host, per step
and per Q-module, at tensors so small that the arithmetic is negligible.

On a GPU the kernels run asynchronously and a step is as fast as its host side once the host
falls behind; on the CPU with tiny tensors the step is almost all host work, so its time here
is the host cost a GPU step would pay. Every mode of a model is timed in one process, round
robin (a machine that gets busier shifts every mode alike; every other round in reverse order,
so that no mode always runs after the same one), on one torch thread with this
thread's CPU time as the clock; the median step per mode is reported with its ratio to fp32's
and the extra microseconds per Q-module over fp32, and the mean step's ratio: the median
leaves out the steps a precision strategy re-allocates or records gradient statistics on
(2 in 10 at the default), which the mean, what a training run's length follows, includes.

    .venv/bin/python scripts/bench_host_cost.py                      # every model
    .venv/bin/python scripts/bench_host_cost.py --models gpt2 --steps 40 --rounds 5
    .venv/bin/python scripts/bench_host_cost.py --models resnet50 --count  # + calls and ops
    .venv/bin/python scripts/bench_host_cost.py --models resnet50 --callbacks  # + strategy's

Models (random init, nothing downloaded):
  resnet50  torchvision ResNet-50, batch 2, 32x32 images, cross-entropy (torchvision from
            ``.bench_deps``, see scripts/third_party.py)
  gpt2      transformers GPT-2, 12 layers of width 64, 4 heads, 16 tokens, batch 2, the loss
            inside the model (``labels=``)
  cnn       the project's DigitsResNet (actnn_zoo.models) at batch 128, 28x28
Modes: fp32 (the plain model), default (``convert_model(model)``: 2-bit average, actnn
strategy, capture on), uniform-2 (2 bits everywhere, no strategy), relu-masks (uniform-2 with
``relu_codes: false``: each ReLU keeps its own 1-bit mask instead of sharing its consumer's
sparse codes, to price that sharing), no-capture (uniform 2 bits, ``capture: false``); each
of these also with ``-python`` appended: the same conversion
with the layers' Python autograd Functions instead of their compiled nodes
(``cpp_ext/qlayers.cpp``) and the norms' and attention's fused calls (``COMPILED_PATHS``), so
one run measures what they save; checkpoint (the plain model, ``torch.utils.checkpoint`` per
block), compiled-fp32 (``torch.compile`` of the plain model), compiled (``actnn_zoo.compile`` of the
default conversion) and torch-compiled (``torch.compile`` of the default conversion: the
Q-layers' traced forms), all with ``--backend`` (default inductor); the ratio of the last two
to compiled-fp32 is the compiled target (``x c-fp32``). Compiled modes compile during the
warm-up steps. Two floors of what capture costs, on the plain model: fp32-mode (its forward
under a torch function mode that passes every call through, as tier 2's mode does for the calls
it does not route) and fp32-hooks (under saved-tensor hooks that keep every tensor as it is,
tier 3's mechanism): what any capture built on these mechanisms pays before doing anything.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, Iterator, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

import actnn_zoo as az  # noqa: E402
from actnn_zoo.bench import host_work, interleaved_step_times  # noqa: E402
from actnn_zoo.nn._base import QModule  # noqa: E402
from actnn_zoo.precision.base import WATCH_ATTR, LayerWatch  # noqa: E402

MODES = ("fp32", "default", "uniform-2", "relu-masks", "no-capture", "checkpoint",
         "compiled-fp32", "compiled", "torch-compiled", "default-python", "uniform-2-python",
         "no-capture-python", "fp32-mode", "fp32-hooks")
CONVERSIONS = {"default": {}, "uniform-2": {"bits": 2, "strategy": "uniform"},
               "relu-masks": {"bits": 2, "strategy": "uniform", "relu_codes": False},
               "no-capture": {"bits": 2, "strategy": "uniform", "capture": False}}
OVERRIDES = {**CONVERSIONS, **{k + "-python": v for k, v in CONVERSIONS.items()}}


# Every compiled node and fused call the layers take in the common case, by module and name:
# None makes the layer run its Python autograd Function (each is read at call time).
COMPILED_PATHS = (("linear", "_QLINEAR"), ("conv", "_QCONV"), ("dropout", "_QDROPOUT"),
                  ("activation", "_QDERIVATIVE"), ("activation", "_QMASK"),
                  ("activation", "_QCLAIM"),
                  ("norm", "_BN_FORWARD"), ("norm", "_LN_FORWARD"), ("norm", "_GN_FORWARD"),
                  ("norm", "_QNORM"),
                  ("attention", "_WHOLE_FORWARD"), ("attention", "_QATTENTION"))


@contextlib.contextmanager
def python_functions() -> Iterator[None]:
    """The layers run their Python autograd Functions, as without the compiled nodes and the
    norms' and attention's fused calls (``COMPILED_PATHS``), and the ``actnn`` strategy its
    three-step width choice: what the step costs in Python glue alone."""
    import importlib

    from actnn_zoo.precision import actnn

    slots = [(importlib.import_module(f"actnn_zoo.functional.{m}"), n) for m, n in COMPILED_PATHS]
    slots.append((actnn, "_CHOOSE"))
    saved = [getattr(mod, name) for mod, name in slots]
    for mod, name in slots:
        setattr(mod, name, None)
    try:
        yield
    finally:
        for (mod, name), value in zip(slots, saved):
            setattr(mod, name, value)


class _PassThrough(TorchFunctionMode):
    """A torch function mode that runs every call as it is (fp32-mode)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **kwargs) if kwargs else func(*args)


def _keep(t: torch.Tensor) -> torch.Tensor:
    return t


FLOORS: Dict[str, Callable[[], contextlib.AbstractContextManager]] = {
    "fp32-mode": _PassThrough,
    "fp32-hooks": lambda: torch.autograd.graph.saved_tensors_hooks(_keep, _keep),
}


class _Checkpointed(nn.Module):
    """A block run under non-reentrant ``torch.utils.checkpoint`` in training."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, *args, **kwargs):
        if self.training and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(self.block, *args, use_reentrant=False,
                                                     **kwargs)
        return self.block(*args, **kwargs)


Workload = Tuple[Callable[[], nn.Module], Callable[[nn.Module], torch.Tensor],
                 Callable[[nn.Module], nn.Module]]


def resnet50(batch: int = 2, side: int = 32) -> Workload:
    """torchvision ResNet-50 (10 classes), cross-entropy on ``batch`` random ``side``-square
    images; checkpointing per bottleneck block."""
    from third_party import import_vision

    tv, _, why = import_vision()
    if tv is None:
        raise SystemExit(f"resnet50 needs torchvision ({why}); see scripts/third_party.py")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 3, side, side, generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)

    def checkpointed(m: nn.Module) -> nn.Module:
        for stage in (m.layer1, m.layer2, m.layer3, m.layer4):
            for i in range(len(stage)):
                stage[i] = _Checkpointed(stage[i])
        return m
    return (lambda: tv.models.resnet50(weights=None, num_classes=10),
            lambda m: F.cross_entropy(m(x), y), checkpointed)


def gpt2(batch: int = 2, tokens: int = 16, use_cache: bool = True) -> Workload:
    """transformers GPT-2, 12 layers of width 64, the loss inside (``labels=``), on ``batch``
    random sequences of ``tokens``; checkpointing through transformers' own switch."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=12, n_embd=64, n_head=4, vocab_size=512, n_positions=64,
                     use_cache=use_cache)
    ids = torch.randint(0, 512, (batch, tokens), generator=torch.Generator().manual_seed(0))

    def checkpointed(m: nn.Module) -> nn.Module:
        # transformers >= 5 renamed gradient_checkpointing_* to activation_checkpointing_*
        enable = getattr(m, "activation_checkpointing_enable", None)
        if enable is not None:
            enable({"use_reentrant": False})
        else:
            m.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        return m
    return (lambda: GPT2LMHeadModel(cfg), lambda m: m(ids, labels=ids).loss, checkpointed)


def _cnn() -> Workload:
    from actnn_zoo.models import DigitsResNet, set_checkpointing

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(128, 1, 28, 28, generator=g), torch.randint(0, 10, (128,), generator=g)
    return (lambda: DigitsResNet(), lambda m: F.cross_entropy(m(x), y),
            lambda m: set_checkpointing(m, True))


MODELS: Dict[str, Callable[[], Workload]] = {"resnet50": resnet50, "gpt2": gpt2,
                                             "cnn": _cnn}


def build_steps(name: str, modes: Sequence[str], backend: str = "inductor"
                ) -> Tuple[Dict[str, Callable[[], None]], int]:
    """One step function per mode (forward, loss, backward, gradients dropped) and the number
    of Q-modules of the converted model."""
    make, loss_of, checkpointed = MODELS[name]()
    torch.manual_seed(0)
    base = make().train()
    steps: Dict[str, Callable[[], None]] = {}
    n_q = 0
    for mode in modes:
        model = copy.deepcopy(base)
        if mode in OVERRIDES:
            model = az.convert_model(model, **OVERRIDES[mode])
            n_q = max(n_q, sum(isinstance(m, QModule) for m in model.modules()))
        elif mode == "checkpoint":
            model = checkpointed(model)
        elif mode == "compiled-fp32":
            model = torch.compile(model, backend=backend)
        elif mode == "compiled":
            model = az.compile(az.convert_model(model), backend=backend)
        elif mode == "torch-compiled":
            model = torch.compile(az.convert_model(model), backend=backend)
        elif mode != "fp32" and mode not in FLOORS:
            raise SystemExit(f"unknown mode {mode!r}; known: {', '.join(MODES)}")

        forwards: list = []  # each step's forward (and loss), thread CPU seconds

        def step(model: nn.Module = model, python: bool = mode.endswith("-python"),
                 floor: Optional[Callable[[], contextlib.AbstractContextManager]] =
                 FLOORS.get(mode), forwards: list = forwards) -> None:
            with python_functions() if python else contextlib.nullcontext():
                t0 = time.thread_time()
                if floor is None:
                    loss = loss_of(model)
                else:
                    with floor():  # the forward only, as capture's session
                        loss = loss_of(model)
                forwards.append(time.thread_time() - t0)
                loss.backward()
            for p in model.parameters():
                p.grad = None
        step.forwards = forwards  # type: ignore[attr-defined]
        step.model = model  # type: ignore[attr-defined]
        steps[mode] = step
    return steps, n_q


# glibc's malloc settings for --steady-malloc: never give freed memory back to the system (no
# trim, no mmap'ed blocks), so that a step's allocations reuse pages instead of faulting in
# fresh ones. Whether a step faults otherwise depends on the process's heap history: on
# ResNet-50 every mode's step took ~5,500 minor faults (5-9 ms of kernel time) in some
# processes and none in others.
STEADY_MALLOC = ("glibc.malloc.trim_threshold=4294967296:glibc.malloc.mmap_threshold=33554432:"
                 "glibc.malloc.top_pad=67108864")


class _Faults:
    """A step function that also counts the minor page faults of its calls after the first
    ``skip`` (the warm-up), from ``getrusage``: the kernel time a step spends mapping fresh
    pages, which thread CPU time includes and a GPU step's host side does not pay."""

    def __init__(self, step: Callable[[], None], skip: int) -> None:
        self.step, self.skip, self.calls, self.faults = step, skip, 0, 0

    def __call__(self) -> None:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        self.step()
        self.calls += 1
        if self.calls > self.skip:
            self.faults += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    def per_step(self) -> float:
        return self.faults / max(1, self.calls - self.skip)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--steps", type=int, default=20, help="timed steps per mode and round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--backend", default="inductor", help="torch.compile backend of the "
                   "compiled modes")
    p.add_argument("--warmup", type=int, default=15,
                   help="untimed steps per mode first (past the strategy's first allocations)")
    p.add_argument("--count", action="store_true",
                   help="also count each mode's Python calls and torch operators per step "
                        "(actnn_zoo.bench.host_work: the same in every run, unlike the time)")
    p.add_argument("--split", action="store_true",
                   help="also the median forward (with the loss) and backward (with the "
                        "gradients' release) per mode: where the extra time is spent")
    p.add_argument("--callbacks", action="store_true",
                   help="also time the precision strategy's per-layer callbacks inside the "
                        "step (thread CPU time around each LayerWatch pre and post call, "
                        "--steps steps per mode that has them)")
    p.add_argument("--steady-malloc", action="store_true",
                   help="run with glibc's malloc keeping freed memory (GLIBC_TUNABLES, "
                        "STEADY_MALLOC; the script restarts itself with it): no page faults "
                        "in the timed steps, as a GPU step's host side")
    args = p.parse_args(argv)
    if args.steady_malloc and os.environ.get("GLIBC_TUNABLES") != STEADY_MALLOC:
        if argv is not None:
            p.error("--steady-malloc restarts the process: run the script itself")
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, *sys.argv],
                  {**os.environ, "GLIBC_TUNABLES": STEADY_MALLOC})
    torch.set_num_threads(1)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if "fp32" not in modes:
        modes.insert(0, "fp32")
    print(f"torch {torch.__version__}, 1 thread, thread CPU time; median ms per step "
          f"({args.steps} steps x {args.rounds} rounds per mode, {args.warmup} warm-up); the "
          f"last column: mean step over fp32's (with the strategies' periodic steps); "
          f"faults: minor page faults per timed step; malloc: "
          f"{'steady (' + STEADY_MALLOC + ')' if args.steady_malloc else 'glibc default'}")
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        if name not in MODELS:
            p.error(f"unknown model {name!r}; known: {', '.join(MODELS)}")
        steps, n_q = build_steps(name, modes, args.backend)
        counted = {k: _Faults(v, args.warmup) for k, v in steps.items()}
        times = interleaved_step_times(counted, n=args.steps * args.rounds, warmup=args.warmup,
                                       rounds=args.rounds, clock=time.thread_time)
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        mean = {k: statistics.mean(v) * 1e3 for k, v in times.items()}
        print(f"\n{name}: {n_q} Q-modules when converted")
        print(f"{'mode':17s} | {'ms/step':>8s} | {'x fp32':>7s} | {'extra us per Q-module':>22s}"
              f" | {'x c-fp32':>8s} | {'mean x fp32':>11s} | {'faults':>7s}")
        for k in modes:
            extra = (med[k] - med["fp32"]) * 1e3 / n_q if n_q and k in OVERRIDES else None
            cell = f"{extra:22.0f}" if extra is not None else " " * 22
            vs = (f"{med[k] / med['compiled-fp32']:8.2f}" if k in ("compiled", "torch-compiled")
                  and "compiled-fp32" in med else "")
            print(f"{k:17s} | {med[k]:8.2f} | {med[k] / med['fp32']:7.2f} | {cell} | {vs:8s} | "
                  f"{mean[k] / mean['fp32']:11.2f} | {counted[k].per_step():7.0f}")
        if args.split:
            _print_split(steps, times, modes)
        if args.count:
            _print_work(steps, modes, n_q)
        if args.callbacks:
            _print_callbacks(steps, modes, args.steps)
    return 0


def _print_split(steps: Dict[str, Callable[[], None]], times: Dict[str, list],
                 modes: Sequence[str]) -> None:
    """Median forward and rest-of-step (backward) per mode, and their ratios to fp32's."""
    split = {}
    for k in modes:
        # the timed steps were the last ones run (after the warm-up), in order
        fw = steps[k].forwards[-len(times[k]):]  # type: ignore[attr-defined]
        split[k] = (statistics.median(fw) * 1e3,
                    statistics.median(t - f for t, f in zip(times[k], fw)) * 1e3)
    f0, b0 = split["fp32"]
    print(f"{'mode':17s} | {'forward ms':>10s} | {'x fp32':>7s} | {'backward ms':>11s} | "
          f"{'x fp32':>7s}")
    for k in modes:
        f, b = split[k]
        print(f"{k:17s} | {f:10.2f} | {f / f0:7.2f} | {b:11.2f} | {b / b0:7.2f}")


class _Timed:
    """A callback that adds its thread CPU time and its calls to ``acc`` ([ns, calls])."""

    __slots__ = ("fn", "acc")

    def __init__(self, fn: Callable[..., None], acc: list) -> None:
        self.fn, self.acc = fn, acc

    def __call__(self, *args: object) -> None:
        t0 = time.thread_time_ns()
        self.fn(*args)
        self.acc[0] += time.thread_time_ns() - t0
        self.acc[1] += 1


def callback_times(step: Callable[[], None], n: int) -> Optional[Dict[str, Tuple[float, float]]]:
    """{"pre"/"post": (ms per step, calls per step)} of the precision strategy's per-layer
    callbacks (``LayerWatch``, which the Q-layers call around themselves) over ``n`` calls of
    ``step``, timed inside the step; None when its model has none. The callbacks are the
    strategy's own again afterwards. The strategy's root hooks (its step count) are not
    included."""
    watches = [w for m in step.model.modules()  # type: ignore[attr-defined]
               if isinstance(w := m.__dict__.get(WATCH_ATTR), LayerWatch)]
    if not watches:
        return None
    acc: Dict[str, list] = {"pre": [0, 0], "post": [0, 0]}
    own = [(w, w.pre, w.post) for w in watches]
    for w, pre, post in own:
        w.pre = _Timed(pre, acc["pre"])
        if post is not None:
            w.post = _Timed(post, acc["post"])
    try:
        for _ in range(n):
            step()
    finally:
        for w, pre, post in own:
            w.pre, w.post = pre, post
    return {k: (ns / n / 1e6, calls / n) for k, (ns, calls) in acc.items()}


def _print_callbacks(steps: Dict[str, Callable[[], None]], modes: Sequence[str],
                     n: int) -> None:
    """The strategy's per-layer callbacks per step and per call, for each mode that has them."""
    print(f"{'mode':17s} | {'pre ms/step':>11s} | {'calls':>5s} | {'us/call':>7s} | "
          f"{'post ms/step':>12s} | {'calls':>5s} | {'us/call':>7s}")
    for k in modes:
        got = callback_times(steps[k], n)
        if got is None:
            continue
        (pre, n_pre), (post, n_post) = got["pre"], got["post"]
        print(f"{k:17s} | {pre:11.3f} | {n_pre:5.0f} | {_per_call(pre, n_pre):7.1f} | "
              f"{post:12.3f} | {n_post:5.0f} | {_per_call(post, n_post):7.1f}")


def _per_call(ms: float, calls: float) -> float:
    """Microseconds per call (0 without calls)."""
    return ms * 1e3 / calls if calls else 0.0


def _print_work(steps: Dict[str, Callable[[], None]], modes: Sequence[str], n_q: int) -> None:
    """Python calls and torch operators per step, and per Q-module over fp32's."""
    work = {k: host_work(steps[k]) for k in modes}
    base = work["fp32"]
    print(f"{'mode':17s} | {'Python calls':>12s} | {'extra/Q-module':>14s} | {'aten ops':>8s} | "
          f"{'extra/Q-module':>14s}")
    for k in modes:
        w = work[k]
        per = (lambda a, b: f"{(a - b) / n_q:14.0f}") if n_q and k in OVERRIDES else \
            (lambda a, b: " " * 14)
        print(f"{k:17s} | {w.python_calls:12.0f} | {per(w.python_calls, base.python_calls)} | "
              f"{w.aten_ops:8.0f} | {per(w.aten_ops, base.aten_ops)}")


if __name__ == "__main__":
    sys.exit(main())
