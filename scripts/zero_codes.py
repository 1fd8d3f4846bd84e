"""What ReLU codes buy and cost on the ResNet-style CNN (docs/design.md, "ReLU reads its
consumer's codes").

For each config (the 2-bit default, uniform 2 bits) and each mode (``codes``: ``relu_codes:
true``, the default, ReLUs read their backward from the mask of the consumer's sparse codes;
``masks``: ``relu_codes: false``, every ReLU keeps its own 1-bit mask), on one fixed batch of
DigitsResNet at batch 256:

* the saved-activation compression against fp32 (one training forward plus the loss, measured
  on the second forward, once the ReLUs have learned their consumers);
* the weight-gradient error over ``--passes`` compressed backward passes against the exact
  fp32 gradient: mean squared deviation summed over the conv/linear weights, relative to the
  ``masks`` mode's, and the mean cosine;
* the median step time (forward + backward) relative to ``masks``, both timed round-robin.

    PYTHONPATH=. .venv/bin/python scripts/zero_codes.py [--passes 40] [--steps 20]
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path
from typing import Dict

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import actnn_zoo as az  # noqa: E402
from actnn_zoo.bench import interleaved_step_times  # noqa: E402
from actnn_zoo.memory import saved_activation_bytes  # noqa: E402
from actnn_zoo.models import build_model, example_batch, workload  # noqa: E402

def weight_grads(model: nn.Module) -> Dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()
            if p.grad is not None and n.endswith("weight") and p.dim() > 1}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--passes", type=int, default=40)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=256)
    args = ap.parse_args()
    torch.manual_seed(0)
    x, y = example_batch("resnet", args.batch)
    lossf = workload("resnet").loss
    base = build_model("resnet").train()
    base.dropout.p = 0.0
    fp32 = saved_activation_bytes(base, x, loss_fn=lambda o: lossf(o, y)).total_bytes
    base.zero_grad()
    lossf(base(x), y).backward()
    exact = weight_grads(base)
    print(f"DigitsResNet batch {args.batch}; {args.passes} passes; threads "
          f"{torch.get_num_threads()}")
    print(f"{'config':<12} {'mode':<6} {'compression':>11} {'grad MSE vs masks':>18} "
          f"{'cosine':>7} {'step vs masks':>14}")
    for label, kw in (("default", {}), ("uniform 2", {"strategy": "uniform", "bits": 2})):
        models, rows = {}, {}
        for mode in ("masks", "codes"):
            torch.manual_seed(1)
            model = az.convert_model(copy.deepcopy(base), relu_codes=mode == "codes", **kw)
            model.zero_grad()
            lossf(model(x), y).backward()  # the ReLUs learn their consumers
            saved = saved_activation_bytes(model, x, loss_fn=lambda o: lossf(o, y)).total_bytes
            mse, cos = 0.0, 0.0
            for _ in range(args.passes):
                model.zero_grad()
                lossf(model(x), y).backward()
                g = weight_grads(model)
                mse += sum(float((g[k] - exact[k]).square().sum()) for k in exact)
                flat = torch.cat([g[k].flatten() for k in exact])
                ref = torch.cat([exact[k].flatten() for k in exact])
                cos += float(F.cosine_similarity(flat, ref, dim=0))
            rows[mode] = (fp32 / saved, mse / args.passes, cos / args.passes)
            models[mode] = model
        steps = {}
        for mode, model in models.items():
            def step(model=model):
                model.zero_grad()
                lossf(model(x), y).backward()
            steps[mode] = step
        times = {k: statistics.median(v)
                 for k, v in interleaved_step_times(steps, n=args.steps).items()}
        for mode in ("masks", "codes"):
            ratio, mse, cos = rows[mode]
            print(f"{label:<12} {mode:<6} {ratio:>10.2f}x {mse / rows['masks'][1]:>18.3f} "
                  f"{cos:>7.4f} {times[mode] / times['masks']:>13.3f}x", flush=True)


if __name__ == "__main__":
    main()
