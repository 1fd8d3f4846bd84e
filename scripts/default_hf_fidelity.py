#!/usr/bin/env python
"""Gradient fidelity and compression of the default on Hugging Face models, whose layers are
transformers' own classes (GPT-2's ``Conv1D``, Llama's ``LlamaRMSNorm``) rather than torch's.

The model-aware default (``convert_model(model)``: a 3.375-bit budget, the ``actnn`` strategy)
can only spread its budget over layers its strategy sees (``precision.stats.layer_kind``); a
Q-layer it does not see saves at its config's fixed width and is not counted in the budget.
This script measures what the default does on such a model: a small GPT-2 (or Llama) is trained
in fp32 for ``--pretrain`` steps on the project's text corpus (so that the gradients are those
of a model in training, not of random weights), then, on one fixed batch, the exact fp32
gradient is compared with ``--passes`` compressed gradients of each config:

* ``rel err``: the summed squared error of the weight matrices' gradients over the squared
  norm of the exact ones, averaged over passes (by group: attention, MLP, all);
* ``cosine``: of the whole flattened gradient with the exact one, averaged over passes;
* ``saved x``: fp32's saved-activation bytes over the config's, one forward with the loss
  (``actnn_zoo.memory.compression_ratio``);
* the ``actnn`` strategy's width per free layer class (its ``layer_budgets``).

With ``--train STEPS`` it trains instead: from the same random init, on the same batches
(AdamW, lr 1e-3), fp32 and each config for STEPS steps, and reports the validation loss over
16 fixed batches at the end and its ratio to fp32's.

One thread per process (``torch.set_num_threads``), deterministic seeds::

    PYTHONPATH=. .venv/bin/python scripts/default_hf_fidelity.py --model gpt2
    PYTHONPATH=. .venv/bin/python scripts/default_hf_fidelity.py --model llama --passes 8
    PYTHONPATH=. .venv/bin/python scripts/default_hf_fidelity.py --train 400 --configs default
"""
from __future__ import annotations

import argparse
import collections
import copy
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor, nn  # noqa: E402

import actnn_zoo as az  # noqa: E402
from actnn_zoo.convert import precision_strategy  # noqa: E402
from actnn_zoo.data import load_text_corpus, random_windows  # noqa: E402
from actnn_zoo.memory import compression_ratio  # noqa: E402

CONFIGS: Dict[str, dict] = {"default": {}, "uniform-2": {"bits": 2, "strategy": "uniform"},
                            "uniform-4": {"bits": 4, "strategy": "uniform"},
                            "actnn-2": {"bits": 2, "strategy": "actnn"},
                            "gact-2": {"bits": 2, "strategy": "gact"}}
DEFAULT_CONFIGS = "default,uniform-2,uniform-4"


class _Loss(nn.Module):
    """A causal LM whose forward returns its own loss (``labels=``): the loss is inside the
    model, as in the host-cost bench."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: Tensor) -> Tensor:
        return self.lm(input_ids=ids, labels=ids).loss


def build(name: str, vocab: int, width: int, layers: int) -> nn.Module:
    """A randomly initialised GPT-2 or Llama, dropout off."""
    if name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(n_layer=layers, n_embd=width, n_head=width // 32, vocab_size=vocab,
                         n_positions=256, use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0,
                         attn_pdrop=0.0)
        return _Loss(GPT2LMHeadModel(cfg))
    if name == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(num_hidden_layers=layers, hidden_size=width,
                          intermediate_size=width * 8 // 3, num_attention_heads=width // 32,
                          num_key_value_heads=width // 32, vocab_size=vocab,
                          max_position_embeddings=256, use_cache=False)
        return _Loss(LlamaForCausalLM(cfg))
    raise SystemExit(f"unknown model {name!r}: gpt2 or llama")


def gradients(model: nn.Module, ids: Tensor) -> Dict[str, Tensor]:
    model.zero_grad(set_to_none=True)
    model(ids).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()
            if p.grad is not None}


def group_of(name: str) -> str:
    """attention / mlp / other, by Hugging Face's module names."""
    if ".attn." in name or ".self_attn." in name:
        return "attention"
    if ".mlp." in name:
        return "mlp"
    return "other"


def is_matrix(name: str, g: Tensor) -> bool:
    """Weight matrices except the embeddings (and the tied head, which is the embedding)."""
    return name.endswith("weight") and g.dim() >= 2 and "wte" not in name \
        and "embed_tokens" not in name


def measure(base: nn.Module, cfg: dict, ids: Tensor, exact: Dict[str, Tensor], passes: int,
            seed: int) -> Tuple[Dict[str, float], float, float, Dict[str, float]]:
    """(relative error by group, cosine, saved x, mean width per free layer class)."""
    torch.manual_seed(seed)
    model = az.convert_model(copy.deepcopy(base), **cfg)
    for _ in range(4):  # past the strategy's first re-allocation
        gradients(model, ids)
    groups = sorted({group_of(n) for n in exact} | {"all"})
    err = dict.fromkeys(groups, 0.0)
    norm = dict.fromkeys(groups, 0.0)
    for n, g in exact.items():
        if is_matrix(n, g):
            sq = float(g.double().square().sum())
            norm[group_of(n)] += sq
            norm["all"] += sq
    flat_exact = torch.cat([g.flatten() for g in exact.values()]).double()
    cos = 0.0
    for _ in range(passes):
        g = gradients(model, ids)
        for n, e in exact.items():
            if is_matrix(n, e):
                sq = float((g[n] - e).double().square().sum()) / passes
                err[group_of(n)] += sq
                err["all"] += sq
        flat = torch.cat([g[n].flatten() for n in exact]).double()
        cos += float(F.cosine_similarity(flat, flat_exact, dim=0)) / passes
    rel = {k: err[k] / norm[k] for k in groups if norm[k]}
    saved = compression_ratio(base, model, ids)
    widths: Dict[str, List[float]] = collections.defaultdict(list)
    budgets = getattr(precision_strategy(model), "layer_budgets", None)
    for name, b in (budgets() if budgets is not None else {}).items():
        widths[name.rsplit(".", 1)[-1]].append(b)
    return rel, cos, saved, {k: sum(v) / len(v) for k, v in sorted(widths.items())}


def train(init: nn.Module, cfg: Optional[dict], corpus: Any, steps: int, batch: int,
          context: int, seed: int) -> float:
    """Validation loss (16 fixed batches) after ``steps`` AdamW steps from ``init`` (converted
    with ``cfg``; None: fp32), on the batches seed ``seed`` draws."""
    torch.manual_seed(seed)
    model = copy.deepcopy(init).train()
    if cfg is not None:
        model = az.convert_model(model, **cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, _y = random_windows(corpus.train, context, batch, gen)
        opt.zero_grad(set_to_none=True)
        model(x).backward()
        opt.step()
    model.eval()
    val = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        losses = [float(model(random_windows(corpus.val, context, batch, val)[0]))
                  for _ in range(16)]
    return sum(losses) / len(losses)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt2", choices=("gpt2", "llama"))
    ap.add_argument("--configs", default=DEFAULT_CONFIGS,
                    help=f"any of {', '.join(CONFIGS)} (the last two: a plain 2-bit budget)")
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--pretrain", type=int, default=150, help="fp32 AdamW steps first")
    ap.add_argument("--passes", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--train", type=int, default=0, metavar="STEPS",
                    help="train fp32 and each config for STEPS steps instead (see above)")
    args = ap.parse_args(argv)
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        ap.error(f"unknown config(s) {unknown}; known: {', '.join(CONFIGS)}")
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    corpus = load_text_corpus(300_000)
    gen = torch.Generator().manual_seed(args.seed)
    torch.manual_seed(args.seed)
    base = build(args.model, corpus.vocab_size, args.width, args.layers).train()
    if args.train:
        print(f"{args.model}: {args.layers} layers of width {args.width}, batch {args.batch} x "
              f"{args.context} tokens, {args.train} AdamW steps from one init; validation "
              f"loss over 16 batches; torch {torch.__version__}")
        ref = train(base, None, corpus, args.train, args.batch, args.context, args.seed)
        print(f"{'fp32':10s} | {ref:.4f}", flush=True)
        for name in names:
            loss = train(base, CONFIGS[name], corpus, args.train, args.batch, args.context,
                         args.seed)
            print(f"{name:10s} | {loss:.4f} | {100 * (loss / ref - 1):+.2f}% vs fp32",
                  flush=True)
        print(f"({time.perf_counter() - t0:.0f} s)")
        return 0
    opt = torch.optim.AdamW(base.parameters(), lr=1e-3)
    for _ in range(args.pretrain):
        x, _y = random_windows(corpus.train, args.context, args.batch, gen)
        opt.zero_grad(set_to_none=True)
        loss = base(x)
        loss.backward()
        opt.step()
        loss = loss.detach()
    ids, _ = random_windows(corpus.val, args.context, args.batch, gen)
    exact = gradients(base, ids)
    print(f"{args.model}: {args.layers} layers of width {args.width}, batch {args.batch} x "
          f"{args.context} tokens, {args.pretrain} fp32 steps first (loss {loss.item():.3f}); "
          f"{args.passes} passes per config; torch {torch.__version__}")
    print(f"{'config':10s} | {'rel err all':>11s} | {'attention':>9s} | {'mlp':>9s} | "
          f"{'cosine':>8s} | {'saved x':>7s} | free layers' widths")
    for name in names:
        rel, cos, saved, widths = measure(base, CONFIGS[name], ids, exact, args.passes,
                                          args.seed)
        w = ", ".join(f"{k} {v:.2f}" for k, v in widths.items()) or "-"
        print(f"{name:10s} | {rel['all']:11.5f} | {rel.get('attention', 0):9.5f} | "
              f"{rel.get('mlp', 0):9.5f} | {cos:8.5f} | {saved:7.2f} | {w}", flush=True)
    print(f"({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
