#!/usr/bin/env python
"""How much of what a model saves for backward the converted model compresses, loss included.

    .venv/bin/python scripts/bench_capture.py --json results/bench_capture.json
    .venv/bin/python scripts/bench_capture.py --groups hf --no-timing      # transformers only

For each model (random init, nothing downloaded) it counts the bytes one training forward plus
the loss keeps for backward (the second forward of the converted model: the first is where
ReLUs learn their consumers) (``actnn_zoo.memory.saved_activation_bytes``) in fp32, converted
with the Q-layers only (``capture: false``) and converted with capture (the default: tiers 2
and 3), all at the 2-bit default (auto precision at a 2-bit average), and lists what still stays
in float32 and where. Groups: ``project`` (the models of ``actnn_zoo.models``), ``hf``
(``transformers`` models from small configs, default attention implementation, dropout on),
``vision`` (torchvision and timm models, if installed: see ``scripts/third_party.py``).
With timing (default) it also measures, for the project's GPT-2 and transformer encoder, the
step time of fp32 / Q-layers only / capture, round-robin in one process, and the step's peak
memory (fresh child processes).
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
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
from actnn_zoo.bench import StepSpec, interleaved_step_times, spec_peak_memory  # noqa: E402
from actnn_zoo.memory import saved_activation_bytes  # noqa: E402

MiB = 2 ** 20
Case = Tuple[Callable[[], nn.Module], Tensor, Callable[[Any], Tensor], str]


def project_cases() -> Dict[str, Case]:
    from actnn_zoo.models import build_model, example_batch, workload

    out = {}
    for name, n, label in (("resnet", 256, "ResNet-style CNN, 8x8 (256)"),
                           ("transformer_encoder", 32, "transformer encoder 2x128, T=64 (32)"),
                           ("gpt2", 32, "GPT-2 (project wrapper, 2x128, T=64) (32)")):
        x, y = example_batch(name, n)
        loss = workload(name).loss
        out[name] = (lambda name=name: build_model(name), x,
                     lambda o, y=y, loss=loss: loss(o, y), label)
    return out


class _EncoderDecoder(nn.Module):
    """T5 takes the same tokens as encoder and decoder input (a shape-only benchmark)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: Tensor) -> Any:
        return self.model(input_ids=tokens, decoder_input_ids=tokens)


def hf_cases(batch: int = 8, seq: int = 64) -> Dict[str, Case]:
    import transformers as T

    def lm(o: Any, y: Tensor) -> Tensor:
        return F.cross_entropy(o.logits.flatten(0, 1), y.flatten())

    tok = torch.randint(0, 1000, (batch, seq), generator=torch.Generator().manual_seed(0))
    tgt = torch.randint(0, 1000, (batch, seq), generator=torch.Generator().manual_seed(1))
    img = torch.randn(batch, 3, 64, 64, generator=torch.Generator().manual_seed(2))
    lab = torch.randint(0, 10, (batch,), generator=torch.Generator().manual_seed(3))
    small = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4)
    cfgs = {
        "hf-gpt2": (lambda: T.GPT2LMHeadModel(T.GPT2Config(
            n_layer=2, n_embd=128, n_head=4, vocab_size=1000, n_positions=128,
            bos_token_id=0, eos_token_id=0)), tok, lambda o: lm(o, tgt)),
        "hf-bert": (lambda: T.BertForMaskedLM(T.BertConfig(
            intermediate_size=512, vocab_size=1000, max_position_embeddings=128, **small)),
                    tok, lambda o: lm(o, tgt)),
        "hf-llama": (lambda: T.LlamaForCausalLM(T.LlamaConfig(
            intermediate_size=384, num_key_value_heads=2, vocab_size=1000,
            max_position_embeddings=128, **small)), tok, lambda o: lm(o, tgt)),
        "hf-t5": (lambda: _EncoderDecoder(T.T5ForConditionalGeneration(T.T5Config(
            d_model=128, d_ff=384, num_layers=2, num_heads=4, d_kv=32, vocab_size=1000,
            decoder_start_token_id=0))), tok, lambda o: lm(o, tgt)),
        "hf-vit": (lambda: T.ViTForImageClassification(T.ViTConfig(
            intermediate_size=512, image_size=64, patch_size=8, num_labels=10, **small)),
                   img, lambda o: F.cross_entropy(o.logits, lab)),
    }
    return {name: (build, x, loss, f"{name} (batch {batch}, T={seq})")
            for name, (build, x, loss) in cfgs.items()}


def vision_cases(batch: int = 4) -> Tuple[Dict[str, Case], str]:
    from third_party import import_vision

    tv, timm, why = import_vision()
    out: Dict[str, Case] = {}
    x64 = torch.randn(batch, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    x80 = torch.randn(batch, 3, 80, 80, generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 10, (batch,), generator=torch.Generator().manual_seed(1))

    def loss(o: Any) -> Tensor:
        return F.cross_entropy(o, y)

    if tv is not None:
        M = tv.models
        for name, build, x in (
                ("tv-resnet18", lambda: M.resnet18(num_classes=10), x64),
                ("tv-resnet50", lambda: M.resnet50(num_classes=10), x64),
                ("tv-vgg11", lambda: M.vgg11(num_classes=10), x64),
                ("tv-densenet121", lambda: M.densenet121(num_classes=10), x64),
                ("tv-mobilenet_v2", lambda: M.mobilenet_v2(num_classes=10), x64),
                ("tv-efficientnet_b0", lambda: M.efficientnet_b0(num_classes=10), x64),
                ("tv-convnext_tiny", lambda: M.convnext_tiny(num_classes=10), x64),
                ("tv-inception_v3", lambda: M.inception_v3(num_classes=10, aux_logits=False,
                                                           init_weights=False), x80),
                ("tv-googlenet", lambda: M.googlenet(num_classes=10, aux_logits=False,
                                                     init_weights=False), x64),
                ("tv-vit_b_16", lambda: M.vit_b_16(num_classes=10, image_size=64), x64),
                ("tv-swin_t", lambda: M.swin_t(num_classes=10), x64)):
            out[name] = (build, x, loss, f"{name} ({tuple(x.shape)})")
    if timm is not None:
        for name in ("efficientnet_b0", "convnext_atto"):
            out[f"timm-{name}"] = (lambda name=name: timm.create_model(name, num_classes=10),
                                   x64, loss, f"timm-{name} ({tuple(x64.shape)})")
    return out, why


def measure(name: str, case: Case) -> Dict[str, Any]:
    build, x, loss, label = case
    torch.manual_seed(0)
    model = build().train()
    res: Dict[str, Any] = {"label": label}
    fp32 = saved_activation_bytes(model, x, loss_fn=loss)
    res["fp32_mib"] = fp32.total_bytes / MiB
    for tag, kw in (("qlayers", {"capture": False}), ("capture", {})):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            q = az.convert_model(copy.deepcopy(model), **kw)
        # the steady state of training: in its first forward a ReLU learns whether its
        # consumer compresses its output (relu_codes), so the second forward is the one counted
        rep = saved_activation_bytes(q, x, loss_fn=loss, warmup=1)
        res[f"{tag}_mib"] = rep.total_bytes / MiB
        res[f"{tag}_ratio"] = fp32.total_bytes / max(rep.total_bytes, 1)
        if tag == "capture":
            left = sorted(((m, d.get("float32", 0) + d.get("float16", 0))
                           for m, d in rep.module_dtype_bytes.items()), key=lambda r: -r[1])
            res["float_left_mib"] = sum(b for _, b in left) / MiB
            res["float_left_top"] = [(m, b / MiB) for m, b in left[:3] if b]
            stats = az.capture_report(q)
            res["routed"] = dict(stats.routed) if stats else {}
    print(f"{name:<22} fp32 {res['fp32_mib']:8.2f} MiB | Q-layers only {res['qlayers_ratio']:5.1f}x"
          f" | capture {res['capture_ratio']:5.1f}x | float left {res['float_left_mib']:.3f} MiB "
          f"{[(m, round(b, 3)) for m, b in res['float_left_top']]}", flush=True)
    return res


def timing(steps: int) -> Dict[str, Any]:
    from actnn_zoo.bench import build_step

    out: Dict[str, Any] = {}
    for model, n in (("gpt2", 32), ("transformer_encoder", 32)):
        specs = {"fp32": StepSpec(model, n, "fp32"),
                 "Q-layers only": StepSpec(model, n, "bits", bits=None,
                                           config={"capture": False}),
                 "capture": StepSpec(model, n, "bits", bits=None)}
        times = interleaved_step_times({k: build_step(s) for k, s in specs.items()}, n=steps)
        med = {k: statistics.median(v) for k, v in times.items()}
        peaks = {k: spec_peak_memory(s) for k, s in specs.items()}
        out[model] = {k: {"step_ms": med[k] * 1e3, "vs_fp32": med[k] / med["fp32"],
                          "peak_mib": peaks[k].delta_mib if peaks[k].ok else None}
                      for k in specs}
        print(model, {k: f"{v['step_ms']:.1f} ms {v['vs_fp32']:.2f}x, peak "
                         f"{v['peak_mib'] if v['peak_mib'] is None else round(v['peak_mib'], 1)}"
                         f" MiB" for k, v in out[model].items()}, flush=True)
    return out


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", nargs="+", default=["project", "hf", "vision"],
                   choices=("project", "hf", "vision"))
    p.add_argument("--no-timing", dest="timing", action="store_false")
    p.add_argument("--timing-steps", type=int, default=30)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    results: Dict[str, Any] = {"torch": torch.__version__, "models": {}}
    cases: Dict[str, Case] = {}
    if "project" in args.groups:
        cases.update(project_cases())
    if "hf" in args.groups:
        cases.update(hf_cases())
    if "vision" in args.groups:
        vision, why = vision_cases()
        cases.update(vision)
        if why:
            print(f"vision models missing: {why}")
            results["vision_missing"] = why
    for name, case in cases.items():
        try:
            results["models"][name] = measure(name, case)
        except Exception as exc:  # report and go on: one broken model must not hide the rest
            results["models"][name] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"{name}: FAILED {type(exc).__name__}: {exc}", flush=True)
    if args.timing:
        results["timing"] = timing(args.timing_steps)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
