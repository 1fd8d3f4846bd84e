"""Auto precision (``strategy: actnn``) against uniform widths, on a real CNN and real data.

1. Gradient variance. A ResNet-style CNN (actnn_zoo.models.DigitsResNet, dropout off) is
   trained in fp32 on scikit-learn's digits for a few steps, so that its gradients are those of
   a network in training. On one fixed minibatch, the exact fp32 gradient is compared with K
   compressed backward passes: variance = mean over the passes of the squared deviation from
   the exact gradient, summed over the conv / linear weights (also shown: the first conv
   alone, and every parameter). Each converted model first runs a few passes on the batch so
   the strategy has gradient statistics (its first two steps use the uniform budget).
   Uniform 1.5 bits is not a width: auto at a 1.5-bit average is compared with uniform 2 and
   with uniform 1 bit.
2. Overhead. Median training-step time of the same CNN converted with ``strategy: actnn`` and
   with ``strategy: uniform`` at the same 2-bit budget, measured in one run with the two
   models' steps interleaved (so machine load hits both alike).
3. (--saved-after-training) Bytes saved for backward after a few training steps, when the
   re-allocation has applied: auto precision against uniform 2 bits on the benchmark CNNs.

    .venv/bin/python scripts/bench_precision.py              # both parts
    .venv/bin/python scripts/bench_precision.py --quick      # fewer passes / steps
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import actnn_zoo as az  # noqa: E402
from actnn_zoo.convert import precision_strategy  # noqa: E402
from actnn_zoo.data import iterate_minibatches, load_digits_data  # noqa: E402
from actnn_zoo.models import DigitsResNet  # noqa: E402
from actnn_zoo.quant import SampleBits  # noqa: E402

CONFIGS = {
    "uniform 2": {"strategy": "uniform", "bits": 2},
    "uniform 1": {"strategy": "uniform", "bits": 1},
    "auto 2": {"strategy": "actnn", "bits": 2},
    "auto 1.5": {"strategy": "actnn", "bits": 1.5},
}


def train_fp32(steps: int, seed: int) -> nn.Module:
    """DigitsResNet after ``steps`` fp32 SGD steps (batch 64) on the digits training split."""
    torch.manual_seed(seed)
    data = load_digits_data()
    model = DigitsResNet(dropout=0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(seed)
    done = 0
    while done < steps:
        for x, y in iterate_minibatches(data.x_train, data.y_train, 64, gen):
            if done == steps:
                break
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            done += 1
    return model


def gradients(model: nn.Module, x: Tensor, y: Tensor) -> Dict[str, Tensor]:
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def is_weight(name: str, model: nn.Module) -> bool:
    """conv / linear weights (what 'the weight gradient' means here)."""
    mod = model.get_submodule(name.rpartition(".")[0])
    return name.endswith("weight") and isinstance(mod, (nn.Conv2d, nn.Linear))


def realised_bits(model: nn.Module) -> float:
    """Average width over every value the last forward compressed (fixed-width layers too)."""
    bits = values = 0.0
    for w in precision_strategy(model).watched:  # type: ignore[attr-defined]
        st = w.stats
        if not st.numel:
            continue
        n = st.numel * st.samples
        b = (float(st.bits.double().mean()) if st.bits is not None  # noqa: E501
             else float(w.pinned_bits or w.module.qconfig.bits))
        bits += b * n
        values += n
    return bits / values


def variance(base: nn.Module, cfg: dict, x: Tensor, y: Tensor, exact: Dict[str, Tensor],
             passes: int, warmup: int, seed: int) -> Tuple[Dict[str, float], float]:
    """Mean squared deviation from ``exact`` per parameter group, over ``passes`` compressed
    backward passes; ``"weights se"`` is the standard error of the weights' value (from the
    spread of the per-pass deviations). Returns (that dict, realised average bits)."""
    torch.manual_seed(seed)
    model = az.convert_model(copy.deepcopy(base), cfg)
    for _ in range(warmup):
        gradients(model, x, y)
    sums = {n: 0.0 for n in exact}
    bits: List[float] = []
    per_pass: List[float] = []  # the conv / linear weights' squared deviation, each pass
    for _ in range(passes):
        g = gradients(model, x, y)
        dev = {n: float((g[n] - exact[n]).double().square().sum()) for n in g}
        for n in g:
            sums[n] += dev[n] / passes
        per_pass.append(sum(v for n, v in dev.items() if is_weight(n, base)))
        if cfg["strategy"] == "actnn":
            bits.append(realised_bits(model))
    first = next(n for n in exact if is_weight(n, base))
    out = {"weights": sum(v for n, v in sums.items() if is_weight(n, base)),
           "first conv": sums[first], "all params": sum(sums.values()),
           "weights se": statistics.stdev(per_pass) / passes ** 0.5}
    return out, (statistics.mean(bits) if bits else float(cfg["bits"]))


def variance_report(train_steps: List[int], passes: int, seed: int) -> None:
    data = load_digits_data()
    x, y = data.x_test[:128], data.y_test[:128]
    print(f"gradient variance, DigitsResNet on sklearn digits, fixed batch of {len(y)} test "
          f"images, {passes} compressed passes each (sum of squared deviations from the exact "
          f"fp32 gradient)")
    for steps in train_steps:
        base = train_fp32(steps, seed)
        exact = gradients(copy.deepcopy(base), x, y)
        res = {name: variance(base, cfg, x, y, exact, passes, 3, seed + 1)
               for name, cfg in CONFIGS.items()}
        print(f"\nafter {steps} fp32 training steps:")
        print(f"  {'config':10s} {'avg bits':>8s} {'weights':>10s} {'first conv':>11s} "
              f"{'all params':>11s}")
        for name, (v, b) in res.items():
            print(f"  {name:10s} {b:8.3f} {v['weights']:10.4g} {v['first conv']:11.4g} "
                  f"{v['all params']:11.4g}")
        u2, u1 = res["uniform 2"][0], res["uniform 1"][0]
        a2, a15 = res["auto 2"][0], res["auto 1.5"][0]

        def se(a: Dict[str, float], u: Dict[str, float]) -> float:
            """Standard error of a / u (independent passes, first-order propagation)."""
            return a["weights"] / u["weights"] * ((a["weights se"] / a["weights"]) ** 2 + (
                u["weights se"] / u["weights"]) ** 2) ** 0.5

        print(f"  ratio [weights] +- standard error: auto 2 / uniform 2 = "
              f"{a2['weights'] / u2['weights']:.3f} +- {se(a2, u2):.3f};  auto 1.5 / uniform 2 "
              f"= {a15['weights'] / u2['weights']:.3f} +- {se(a15, u2):.3f};  auto 1.5 / "
              f"uniform 1 = {a15['weights'] / u1['weights']:.3f} +- {se(a15, u1):.3f}")
        for key in ("weights", "first conv", "all params"):
            print(f"  ratio [{key}]: auto 2 / uniform 2 = {a2[key] / u2[key]:.3f};  "
                  f"auto 1.5 / uniform 2 = {a15[key] / u2[key]:.3f};  "
                  f"auto 1.5 / uniform 1 = {a15[key] / u1[key]:.3f}")


def _two_bits_per_sample(mod: nn.Module, args: Tuple) -> None:
    n = args[0].shape[0]
    mod.sample_bits = SampleBits(torch.full((n,), 2, dtype=torch.uint8), 2 * n)


def overhead_report(steps: int, batch: int, seed: int, interval: int) -> None:
    torch.manual_seed(seed)
    data = load_digits_data()
    x, y = data.x_train[:batch], data.y_train[:batch]
    base = DigitsResNet()
    models = {name: az.convert_model(copy.deepcopy(base), strategy=name, bits=2,
                                     update_interval=interval)
              for name in ("uniform", "actnn")}
    # Uniform 2 bits given as per-sample widths (SampleBits, as the strategy passes them): the
    # cost of the mixed-precision storage path alone (quant/api.py), without allocation work.
    mixed = az.convert_model(copy.deepcopy(base), strategy="uniform", bits=2)
    for mod in mixed.modules():
        if isinstance(mod, (nn.Conv2d, nn.Linear)):
            mod.register_forward_pre_hook(_two_bits_per_sample)
    models["per-sample path"] = mixed
    opts = {n: torch.optim.SGD(m.parameters(), lr=0.01) for n, m in models.items()}

    def step(name: str) -> Tuple[float, float]:
        """(wall seconds, CPU seconds of this thread) of one training step. With one torch
        thread all the work runs on this thread, so its CPU time does not count the time
        the OS gives to other processes: the robust measure on a shared machine."""
        m, opt = models[name], opts[name]
        t, c = time.perf_counter(), time.thread_time()
        opt.zero_grad()
        F.cross_entropy(m(x), y).backward()
        opt.step()
        return time.perf_counter() - t, time.thread_time() - c

    for _ in range(5):
        for name in models:
            step(name)
    times: Dict[str, List[Tuple[float, float]]] = {n: [] for n in models}
    for i in range(steps):
        order = list(models) if i % 2 == 0 else list(models)[::-1]  # alternate who goes first
        for name in order:
            times[name].append(step(name))
    print(f"\nstep time, DigitsResNet, batch {batch}, {steps} interleaved rounds, "
          f"{torch.get_num_threads()} thread(s), CPU, update_interval {interval}:")
    for k, what in ((0, "wall"), (1, "thread CPU")):
        med = {n: statistics.median(t[k] for t in ts) for n, ts in times.items()}
        for name, label in (("uniform", "uniform 2 bits"), ("actnn", "actnn, 2-bit average"),
                            ("per-sample path", "uniform 2 bits as per-sample widths")):
            pairs = statistics.median(a[k] / u[k] for a, u in zip(times[name],
                                                                   times["uniform"]))
            print(f"  {what:10s} {label:36s} median {med[name] * 1e3:8.2f} ms   ratio of "
                  f"medians {med[name] / med['uniform']:.3f}, median per-round ratio "
                  f"{pairs:.3f}")


def saved_after_training(steps: int = 4) -> None:
    """Saved-activation bytes of uniform 2 bits and auto precision (2-bit average) after
    ``steps`` SGD steps on one synthetic batch (actnn_zoo.models' benchmark workloads)."""
    from actnn_zoo.memory import saved_activation_bytes
    from actnn_zoo.models import build_model, example_batch, workload

    print(f"\nsaved for backward after {steps} training steps (MiB):")
    for name, batch in (("resnet", 256), ("unet", 32), ("conv1d", 256)):
        x, y = example_batch(name, batch)
        saved = {}
        for strategy in ("uniform", "actnn"):
            torch.manual_seed(0)
            model = az.convert_model(build_model(name), strategy=strategy, bits=2)
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            for _ in range(steps):
                opt.zero_grad()
                workload(name).loss(model(x), y).backward()
                opt.step()
            saved[strategy] = saved_activation_bytes(model, x).total_bytes / 2 ** 20
        print(f"  {name:8s} batch {batch:4d}: uniform 2 bits {saved['uniform']:.3f}, actnn "
              f"{saved['actnn']:.3f}, ratio {saved['actnn'] / saved['uniform']:.4f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer passes and steps")
    ap.add_argument("--train-steps", type=int, nargs="+", default=[5, 22, 110],
                    help="fp32 steps before measuring (22 = one epoch at batch 64)")
    ap.add_argument("--passes", type=int, default=40)
    ap.add_argument("--timing-steps", type=int, default=60)
    ap.add_argument("--batch", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, nargs="+", default=[0],
                    help="torch threads for the timing (0: torch's default)")
    ap.add_argument("--update-interval", type=int, default=1)
    ap.add_argument("--skip-variance", action="store_true")
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--saved-after-training", action="store_true",
                    help="only part 3: saved bytes after a few steps, actnn vs uniform")
    args = ap.parse_args()
    if args.saved_after_training:
        saved_after_training()
        return
    if args.quick:
        args.passes, args.timing_steps, args.train_steps, args.batch = 10, 20, [22], [128]
    if not args.skip_variance:
        variance_report(args.train_steps, args.passes, args.seed)
    if not args.skip_timing:
        default_threads = torch.get_num_threads()
        for threads in args.threads:
            torch.set_num_threads(threads or default_threads)
            for batch in args.batch:
                overhead_report(args.timing_steps, batch, args.seed, args.update_interval)


if __name__ == "__main__":
    main()
