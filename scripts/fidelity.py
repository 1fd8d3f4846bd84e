#!/usr/bin/env python
"""Does compressed training follow fp32? Side-by-side training, per-step gradient fidelity.

    .venv/bin/python scripts/fidelity.py --models tv-inception_v3 tv-mobilenet_v2 --steps 10
    .venv/bin/python scripts/fidelity.py --models hf-gpt2 hf-llama --bits 2 --strategy uniform

For each model (random init, random data, dropout off, SGD lr 0.01 momentum 0.9) it trains an
fp32 copy and a converted copy from the same initial weights on the same batches. Per step it
reports both losses and, for the converted model, the cosine and the norm ratio of its gradient
against the exact fp32 gradient at the same weights (a plain twin that loads the converted
model's state each step). Divergence is flagged when the converted run's loss or gradient is
not finite, or its gradient norm exceeds 100x the exact one, while fp32 stays finite.
Vision models need torchvision/timm in ``.bench_deps`` (see ``scripts/third_party.py``).
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import actnn_zoo as az  # noqa: E402

Batch = Callable[[int, torch.Generator], Tuple[Tensor, Tensor]]


def _images(side: int, classes: int = 10) -> Batch:
    def make(n: int, g: torch.Generator) -> Tuple[Tensor, Tensor]:
        return torch.randn(n, 3, side, side, generator=g), torch.randint(0, classes, (n,),
                                                                         generator=g)
    return make


def _tokens(vocab: int = 500, seq: int = 64) -> Batch:
    def make(n: int, g: torch.Generator) -> Tuple[Tensor, Tensor]:
        t = torch.randint(0, vocab, (n, seq + 1), generator=g)
        return t[:, :-1], t[:, 1:]
    return make


class _Logits(nn.Module):
    """Hugging Face models return an output object: keep the logits."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x).logits


def model_zoo() -> Dict[str, Tuple[Callable[[], nn.Module], Batch]]:
    zoo: Dict[str, Tuple[Callable[[], nn.Module], Batch]] = {}
    from third_party import import_vision

    tv, timm, _ = import_vision()
    if tv is not None:
        M = tv.models
        zoo.update({
            "tv-resnet18": (lambda: M.resnet18(num_classes=10), _images(64)),
            "tv-mobilenet_v2": (lambda: M.mobilenet_v2(num_classes=10, dropout=0.0), _images(64)),
            "tv-inception_v3": (lambda: M.inception_v3(num_classes=10, aux_logits=False,
                                                       init_weights=True, dropout=0.0),
                                _images(80)),
            "tv-googlenet": (lambda: M.googlenet(num_classes=10, aux_logits=False,
                                                 init_weights=True, dropout=0.0), _images(64)),
            "tv-densenet121": (lambda: M.densenet121(num_classes=10), _images(64)),
            "tv-efficientnet_b0": (lambda: M.efficientnet_b0(num_classes=10, dropout=0.0),
                                   _images(64)),
            "tv-shufflenet_v2": (lambda: M.shufflenet_v2_x0_5(num_classes=10), _images(64)),
        })
    if timm is not None:
        zoo["timm-convnext_atto"] = (lambda: timm.create_model("convnext_atto", num_classes=10),
                                     _images(64))
        zoo["timm-vit_tiny"] = (lambda: timm.create_model(
            "vit_tiny_patch16_224", img_size=64, num_classes=10), _images(64))
    try:
        import transformers as T
    except ImportError:
        return zoo
    small = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    off = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    zoo.update({
        "hf-gpt2": (lambda: _Logits(T.GPT2LMHeadModel(T.GPT2Config(
            n_layer=2, n_embd=64, n_head=4, vocab_size=500, n_positions=64, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))), _tokens()),
        "hf-bert": (lambda: _Logits(T.BertForMaskedLM(T.BertConfig(
            intermediate_size=256, vocab_size=500, max_position_embeddings=64, **off,
            **small))), _tokens()),
        "hf-llama": (lambda: _Logits(T.LlamaForCausalLM(T.LlamaConfig(
            intermediate_size=192, num_key_value_heads=2, vocab_size=500,
            max_position_embeddings=64, **small))), _tokens()),
    })
    return zoo


def _loss(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def _grad_vector(model: nn.Module) -> Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten()
                      for p in model.parameters()])


def _step(model: nn.Module, x: Tensor, y: Tensor, opt: Optional[torch.optim.Optimizer]
          ) -> Tuple[float, Tensor]:
    model.zero_grad(set_to_none=True)
    capture = "actnn_zoo_capture" in vars(model)
    with az.capturing(model) if capture else _nothing():
        loss = _loss(model(x), y)
    loss.backward()
    grad = _grad_vector(model)
    if opt is not None:
        opt.step()
    return float(loss.detach()), grad


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def run(name: str, build: Callable[[], nn.Module], batch: Batch, steps: int, n: int,
        convert_kw: Dict[str, Any], lr: float) -> Dict[str, Any]:
    torch.manual_seed(0)
    ref = build().train()
    for m in ref.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    twin = copy.deepcopy(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = az.convert_model(copy.deepcopy(ref), **convert_kw)
    opt_r = torch.optim.SGD(ref.parameters(), lr=lr, momentum=0.9)
    opt_q = torch.optim.SGD(q.parameters(), lr=lr, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    rows: List[Dict[str, Any]] = []
    diverged_at = None
    for step in range(steps):
        x, y = batch(n, g)
        loss_r, _ = _step(ref, x, y, opt_r)
        twin.load_state_dict(q.state_dict())
        _, exact = _step(twin, x, y, None)
        loss_q, grad_q = _step(q, x, y, opt_q)
        finite_r = math.isfinite(loss_r)
        ok = math.isfinite(loss_q) and bool(torch.isfinite(grad_q).all())
        norm_ratio = float(grad_q.norm() / exact.norm().clamp_min(1e-30)) if ok else float("nan")
        cosine = float(F.cosine_similarity(grad_q.double(), exact.double(), dim=0)) if ok \
            else float("nan")
        rows.append({"step": step + 1, "loss_fp32": loss_r, "loss_q": loss_q,
                     "grad_cos": cosine, "grad_norm_ratio": norm_ratio})
        if diverged_at is None and finite_r and (not ok or norm_ratio > 100):
            diverged_at = step + 1
    print(f"\n{name}: " + ("DIVERGED at step %d" % diverged_at if diverged_at else "ok"))
    print(f"{'step':>4} {'loss fp32':>10} {'loss conv':>10} {'grad cos':>9} {'norm ratio':>10}")
    for r in rows:
        print(f"{r['step']:>4} {r['loss_fp32']:>10.4f} {r['loss_q']:>10.4f} {r['grad_cos']:>9.4f}"
              f" {r['grad_norm_ratio']:>10.3f}")
    return {"steps": rows, "diverged_at": diverged_at}


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=None, help="default: every available model")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--bits", type=float, default=None, help="override the config's bits")
    p.add_argument("--strategy", default=None)
    p.add_argument("--config", default=None, help="YAML config for convert_model")
    p.add_argument("--transform", choices=("none", "hadamard"), default=None,
                   help="override the config's transform (per-group rotation before quantizing)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    zoo = model_zoo()
    names = args.models or sorted(zoo)
    missing = [m for m in names if m not in zoo]
    if missing:
        p.error(f"unknown or unavailable model(s) {missing}; available: {sorted(zoo)}")
    kw: Dict[str, Any] = {}
    if args.config:
        kw["config"] = args.config
    if args.bits is not None:
        kw["bits"] = int(args.bits) if float(args.bits).is_integer() else args.bits
    if args.strategy:
        kw["strategy"] = args.strategy
    if args.transform:
        kw["transform"] = args.transform
    results = {name: run(name, *zoo[name], args.steps, args.batch, kw, args.lr) for name in names}
    print("\nsummary: " + ", ".join(
        f"{k}: {'diverged at %d' % v['diverged_at'] if v['diverged_at'] else 'ok'} "
        f"(mean grad cos {sum(r['grad_cos'] for r in v['steps']) / len(v['steps']):.3f})"
        for k, v in results.items()))
    means = sorted(sum(r["grad_cos"] for r in v["steps"]) / len(v["steps"])
                   for v in results.values())
    mid = len(means) // 2
    median = means[mid] if len(means) % 2 else (means[mid - 1] + means[mid]) / 2
    print(f"median over models of the mean grad cos: {median:.3f}; diverged: "
          f"{sum(1 for v in results.values() if v['diverged_at'])} of {len(results)}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)},
                                         "results": results}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
