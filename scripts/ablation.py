#!/usr/bin/env python
"""Where the text transformer's 2-bit gradient error comes from: a per-layer-group ablation.

After ``--warm`` fp32 training steps of the demo's char transformer (stdlib text, dropout off
so that only quantization differs), the exact fp32 gradient of one batch is compared with
``--draws`` compressed gradients under each configuration:

* ``only G at 2 bits``: every layer at 8 bits (capture tiers too) except group G at 2 bits:
  the error G alone adds. Stochastic rounding errors of different tensors are independent and
  unbiased, so these add up to about the error of everything at 2 bits (the sum is printed).
* ``all 2-bit but G at 8``: the uniform 2-bit model with G raised to 8 bits: what pinning G
  would buy.

Reported per configuration: relative squared error E||g_q - g||^2 / ||g||^2 (mean over draws)
and the cosine of one draw with g (mean over draws). E.g.
    .venv/bin/python scripts/ablation.py --json results/ablation_text.json
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import actnn_zoo as az  # noqa: E402
from actnn_zoo.data import load_text_corpus, random_windows  # noqa: E402
from actnn_zoo.demo import TextSetup  # noqa: E402
from actnn_zoo.models import CharTransformer  # noqa: E402

# group -> the rule that selects its Q-layers (None: the capture tiers, set by capture_bits)
GROUPS: Dict[str, Optional[Dict[str, Any]]] = {
    "qkv Linear (input: ln1 output)": {"pattern": "*.attn.qkv"},
    "attn proj Linear (input: attention output)": {"pattern": "*.attn.proj"},
    "mlp fc1 Linear (input: ln2 output)": {"pattern": "*.mlp.0"},
    "mlp fc2 Linear (input: GELU output)": {"pattern": "*.mlp.2"},
    "head Linear (input: ln_f output)": {"name": "head"},
    "LayerNorm (normalized input)": {"type": "LayerNorm"},
    "Softmax (output)": {"type": "Softmax"},
    "GELU (derivative)": {"type": "GELU"},
    "capture tiers (q, k, v, attention matmuls, loss)": None,
}


def _loss(model: nn.Module, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
    with az.capturing(model):
        logits = model(xb)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), yb.reshape(-1))


def _grad(model: nn.Module, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    _loss(model, xb, yb).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def _config(low: Optional[str], high: Optional[str]) -> Dict[str, Any]:
    """uniform config: everything at 2 bits with group ``high`` at 8, or everything at 8 with
    group ``low`` at 2."""
    base = 8 if low is not None else 2
    rules: List[Dict[str, Any]] = []
    capture_bits = base
    for group, width in ((low, 2), (high, 8)):
        if group is None:
            continue
        if GROUPS[group] is None:
            capture_bits = width
        else:
            rules.append({**GROUPS[group], "bits": width})
    return {"strategy": "uniform", "bits": base, "capture_bits": capture_bits, "rules": rules}


def measure(fp32: nn.Module, config: Any, xb: torch.Tensor, yb: torch.Tensor, exact: torch.Tensor,
            draws: int, seed: int) -> Dict[str, float]:
    model = az.convert_model(copy.deepcopy(fp32), config)
    errs, coss = [], []
    for k in range(draws):
        torch.manual_seed(seed + k)
        g = _grad(model, xb, yb)
        errs.append(float((g - exact).square().sum() / exact.square().sum()))
        coss.append(float(F.cosine_similarity(g, exact, dim=0)))
    return {"rel_sq_error": sum(errs) / draws, "cosine": sum(coss) / draws}


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--warm", type=int, default=150, help="fp32 training steps first")
    p.add_argument("--draws", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    setup = TextSetup()
    corpus = load_text_corpus(300_000)
    torch.manual_seed(args.seed)
    model = CharTransformer(**setup.model_kwargs(corpus.vocab_size)).train()
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    opt = torch.optim.AdamW(model.parameters(), lr=setup.lr, weight_decay=0.01)
    order = torch.Generator().manual_seed(args.seed)
    for _ in range(args.warm):
        xb, yb = random_windows(corpus.train, setup.context, setup.batch_size, order)
        opt.zero_grad(set_to_none=True)
        logits = model(xb)
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), yb.reshape(-1)).backward()
        opt.step()
    xb, yb = random_windows(corpus.train, setup.context, setup.batch_size, order)
    model.zero_grad(set_to_none=True)
    logits = model(xb)
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), yb.reshape(-1)).backward()
    exact = torch.cat([q.grad.flatten() for q in model.parameters()])
    model.zero_grad(set_to_none=True)

    rows: List[Dict[str, Any]] = []

    def run(label: str, config: Any) -> Dict[str, float]:
        r = measure(model, config, xb, yb, exact, args.draws, args.seed)
        rows.append({"config": label, **r})
        print(f"  {label:<62} rel. sq. error {r['rel_sq_error']:8.4f}   cosine {r['cosine']:.4f}",
              flush=True)
        return r

    print(f"text transformer after {args.warm} fp32 steps, {args.draws} draws per row")
    run("uniform 8 bits (everything)", {"strategy": "uniform", "bits": 8})
    total = run("uniform 2 bits (everything)", _config(None, None))
    run("default (actnn, 2-bit average, capture at 2)", None)
    only = {g: run(f"only {g} at 2 bits", _config(g, None)) for g in GROUPS}
    share_sum = sum(r["rel_sq_error"] for r in only.values())
    print(f"  sum of the 'only G' errors: {share_sum:.4f} (uniform 2 bits: "
          f"{total['rel_sq_error']:.4f})")
    for g, r in sorted(only.items(), key=lambda kv: -kv[1]["rel_sq_error"]):
        print(f"    {100 * r['rel_sq_error'] / share_sum:5.1f}%  {g}")
    for g in sorted(only, key=lambda g: -only[g]["rel_sq_error"])[:3]:
        run(f"all 2-bit but {g} at 8", _config(None, g))
    if args.json:
        Path(args.json).write_text(json.dumps({"warm": args.warm, "draws": args.draws,
                                               "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
