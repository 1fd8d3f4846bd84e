"""Command line: ``python -m actnn_zoo report|bench|max-batch --help``.

* ``report``: what one forward saves for backward, per module, fp32 vs converted.
* ``bench``: saved-activation compression and peak memory per model and bit width
  (``scripts/bench_memory.py`` is this command).
* ``max-batch``: the largest batch under a memory cap for fp32, compressed and checkpointed
  training (``scripts/max_batch.py`` is this command).
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

MiB = 2 ** 20

# Batch sizes at which activations dominate the footprint of each reference model.
DEFAULT_BATCH = {"resnet": 256, "unet": 32, "conv1d": 256, "transformer": 32,
                 "transformer_encoder": 32, "gpt2": 32}
BENCH_MODELS = ("resnet", "unet", "conv1d", "transformer_encoder", "gpt2")


def _ints(text: str) -> List[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def _names(text: str) -> List[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _model_kwargs(text: Optional[str]) -> Dict[str, Any]:
    return json.loads(text) if text else {}


def _write_json(path: Optional[str], payload: Dict[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            json.dump(payload, f, indent=1, default=str)
        print(f"wrote {path}")


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    cells = [list(header)] + [list(r) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
    out = ["  ".join(c[i].ljust(widths[i]) for i in range(len(header))).rstrip()
           for c in cells]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


def _environment() -> Dict[str, Any]:
    from .demo import environment

    return environment()


# ----------------------------------------------------------------------------- report ----
def cmd_report(args: argparse.Namespace) -> int:
    from .bench import apply_mode
    from .memory import saved_activation_bytes
    from .models import build_model, example_batch, workload

    import torch

    kwargs = _model_kwargs(args.model_kwargs)
    torch.manual_seed(0)
    if ":" in args.model:
        model, x, loss, y = _imported_workload(args, kwargs)
        batch = x.shape[0]
    else:
        batch = args.batch or DEFAULT_BATCH.get(args.model, 32)
        model = build_model(args.model, **kwargs).train()
        x, y = example_batch(args.model, batch, kwargs)
        loss = workload(args.model).loss
    ref = saved_activation_bytes(model, x, loss_fn=lambda o: loss(o, y))
    print(f"{args.model}, batch {batch}: fp32 saves {ref.mib:.3f} MiB in {ref.num_tensors} "
          f"tensors ({', '.join(ref.dtypes)}); {ref.num_param_refs} parameter references "
          f"excluded, {ref.num_duplicates} repeated storages counted once")
    print(ref.table(args.top))
    if args.mode == "fp32":
        return 0
    other = apply_mode(copy.deepcopy(model), args.mode, args.bits, args.config, args.strategy)
    rep = saved_activation_bytes(other, x, loss_fn=lambda o: loss(o, y), warmup=1)
    label = args.mode if args.mode != "bits" else f"converted (bits={args.bits or 'config'})"
    ratio = ref.total_bytes / max(1, rep.total_bytes)
    print(f"\n{label}: {rep.mib:.3f} MiB in {rep.num_tensors} tensors "
          f"({', '.join(rep.dtypes)}); compression {ratio:.2f}x")
    if args.mode != "bits":
        print(rep.table(args.top))
        return 0
    print(_capture_table(other, ref, rep, args.top))
    from .capture import capture_report

    stats = capture_report(other)
    if stats is not None:
        print("\n" + str(stats))
    return 0


def _imported_workload(args: argparse.Namespace, kwargs: Dict[str, Any]) -> Tuple[Any, ...]:
    """``--model module:callable``: any importable model factory, a random batch of
    ``--input-shape`` (floats, or token ids below ``--vocab``) and cross-entropy on its
    output's last dimension (``.logits`` when the output has it) against random targets."""
    import importlib

    import torch
    import torch.nn.functional as F

    module_name, _, attr = args.model.partition(":")
    try:
        factory = importlib.import_module(module_name)
        for part in attr.split("."):
            factory = getattr(factory, part)
    except (ImportError, AttributeError) as exc:
        raise SystemExit(f"--model {args.model}: cannot import it ({exc})") from None
    if not callable(factory):
        raise SystemExit(f"--model {args.model}: {attr} is not callable")
    model = factory(**kwargs).train()
    shape = _ints(args.input_shape) if args.input_shape else None
    if not shape:
        raise SystemExit("--model module:callable needs --input-shape, e.g. 8,3,224,224")
    if args.batch:
        shape[0] = args.batch
    x = (torch.randint(0, args.vocab, shape) if args.vocab else torch.randn(shape))

    def logits(out: Any) -> Any:
        out = getattr(out, "logits", out)
        return out[0] if isinstance(out, (tuple, list)) else out

    with torch.no_grad():
        classes = logits(model(x)).shape[-1]
    y = torch.randint(0, classes, logits(model(x)).shape[:-1])

    def loss(out: Any, target: Any) -> Any:
        o = logits(out)
        return F.cross_entropy(o.reshape(-1, o.shape[-1]).float(), target.reshape(-1))
    return model, x, loss, y


def _capture_table(model: Any, ref: Any, rep: Any, top: int) -> str:
    """Per module: fp32 bytes, converted bytes, what is still floating point, and which tier
    compressed it (a Q-layer, or tiers 2-3 for what the module saves through functional calls
    and plain ops)."""
    from .nn import QModule

    modules = dict(model.named_modules())
    rows = []
    for name in sorted(set(ref.module_bytes) | set(rep.module_bytes),
                       key=lambda n: -ref.module_bytes.get(n, 0))[:top]:
        mod = modules.get(name if name != "(model)" else "")
        left = sum(v for k, v in rep.module_dtype_bytes.get(name, {}).items()
                   if k in ("float32", "float16", "float64"))
        tier = (f"Q-layer {type(mod).__name__}" if isinstance(mod, QModule)
                else "tiers 2-3" if rep.module_bytes.get(name) else "-")
        rows.append((name, f"{ref.module_bytes.get(name, 0) / 1024:.1f}",
                     f"{rep.module_bytes.get(name, 0) / 1024:.1f}", f"{left / 1024:.1f}", tier))
    return _table(("module", "fp32 KiB", "converted KiB", "still float KiB", "compressed by"),
                  rows)


# ------------------------------------------------------------------------------ bench ----
def _ratio(reference: Optional[float], value: Optional[float]) -> Optional[float]:
    """reference / value (how many times smaller than fp32), None when either is unknown."""
    return reference / value if reference and value else None


def bench_rows(models: Sequence[str], bits_list: Sequence[int], strategy: Optional[str],
               config: Any, batch: Optional[int], peak: bool, checkpoint: bool,
               model_kwargs: Dict[str, Any], device: str, bits_strategy: Optional[str] =
               "uniform", log=print) -> List[Dict[str, Any]]:
    """One dict per (model, mode): saved-activation bytes and ratio, peak delta and ratio.

    The k-bit rows use ``bits_strategy`` (uniform widths by default; None: the config's);
    ``strategy`` adds a row with that strategy at the config's budget."""
    import torch

    from .bench import StepSpec, apply_mode, spec_peak_memory
    from .memory import saved_activation_bytes
    from .models import build_model, example_batch, workload

    rows: List[Dict[str, Any]] = []
    for name in models:
        b = batch or DEFAULT_BATCH.get(name, 32)
        kw = dict(model_kwargs)
        torch.manual_seed(0)
        try:
            base_model = build_model(name, **kw).to(device).train()
        except Exception as exc:  # e.g. transformers missing
            rows.append({"model": name, "mode": "fp32", "batch": b,
                         "error": f"{type(exc).__name__}: {exc}"})
            log(f"{name}: cannot build ({exc})")
            continue
        x, y = (t.to(device) for t in example_batch(name, b, kw))
        loss = workload(name).loss
        variants = [("fp32", dict(mode="fp32"))]
        variants += [(f"{k}-bit", dict(mode="bits", bits=k, strategy=bits_strategy))
                     for k in bits_list]
        if strategy:
            variants.append((f"{strategy}", dict(mode="bits", bits=None, strategy=strategy)))
        if checkpoint:
            variants.append(("checkpoint", dict(mode="checkpoint")))
        ref_saved = ref_peak = None
        for label, opts in variants:
            row: Dict[str, Any] = {"model": name, "mode": label, "batch": b}
            spec = StepSpec(name, b, config=config, model_kwargs=kw, device=device,
                            **{"bits": None, **opts})
            try:
                m = apply_mode(copy.deepcopy(base_model), spec.mode, spec.bits, config,
                               spec.strategy)
                rep = saved_activation_bytes(m, x, loss_fn=lambda o: loss(o, y))
                row.update(saved_bytes=rep.total_bytes, saved_tensors=rep.num_tensors,
                           dtypes=rep.dtypes)
                if label == "fp32":
                    ref_saved = rep.total_bytes
                row["saved_ratio"] = _ratio(ref_saved, rep.total_bytes)
            except Exception as exc:  # unknown strategy, unsupported layer: report, go on
                row["error"] = f"{type(exc).__name__}: {exc}"
                rows.append(row)
                log(f"{name:<20} {label:<11} error: {row['error']}")
                continue
            if peak:
                pr = spec_peak_memory(spec)
                if pr.ok:
                    row.update(peak_bytes=pr.delta_bytes, peak_method=pr.method,
                               step_seconds=pr.step_seconds)
                    if label == "fp32":
                        ref_peak = pr.delta_bytes
                    row["peak_ratio"] = _ratio(ref_peak, pr.delta_bytes)
                else:
                    row["peak_error"] = pr.error
            rows.append(row)
            log(_bench_line(row))
    return rows


def _fmt(v: Optional[float], spec: str, scale: float = 1.0) -> str:
    return "-" if v is None else format(v / scale, spec)


def _bench_line(r: Dict[str, Any]) -> str:
    if "error" in r:
        return f"{r['model']:<20} {r['mode']:<11} error: {r['error']}"
    return (f"{r['model']:<20} {r['mode']:<11} batch {r['batch']:<5} saved "
            f"{_fmt(r.get('saved_bytes'), '.3f', MiB)} MiB ({_fmt(r.get('saved_ratio'), '.1f')}x)"
            f"  peak {_fmt(r.get('peak_bytes'), '.1f', MiB)} MiB "
            f"({_fmt(r.get('peak_ratio'), '.1f')}x)" + (f"  peak error: {r['peak_error']}"
                                                         if r.get("peak_error") else ""))


def bench_table(rows: Sequence[Dict[str, Any]]) -> str:
    header = ("model", "mode", "batch", "saved MiB", "saved vs fp32", "peak MiB",
              "peak vs fp32", "note")
    out = []
    for r in rows:
        note = r.get("error") or r.get("peak_error") or ""
        out.append((r["model"], r["mode"], str(r["batch"]),
                    _fmt(r.get("saved_bytes"), ".3f", MiB),
                    _fmt(r.get("saved_ratio"), ".1f") + ("x" if r.get("saved_ratio") else ""),
                    _fmt(r.get("peak_bytes"), ".1f", MiB),
                    _fmt(r.get("peak_ratio"), ".1f") + ("x" if r.get("peak_ratio") else ""),
                    note[:60]))
    return _table(header, out)


def peak_sweep(model: str, batches: Sequence[int], bits: int, config: Any,
               model_kwargs: Dict[str, Any], device: str, log=print) -> List[Dict[str, Any]]:
    """Peak memory per batch size for fp32, ``bits`` and checkpointing (for the plot)."""
    from .bench import StepSpec, spec_peak_memory

    out = []
    for b in batches:
        for label, opts in (("fp32", {"mode": "fp32"}), (f"{bits}-bit", {"mode": "bits"}),
                            ("checkpoint", {"mode": "checkpoint"})):
            spec = StepSpec(model, b, bits=bits, config=config, model_kwargs=model_kwargs,
                            device=device, **opts)
            pr = spec_peak_memory(spec)
            row = {"model": model, "mode": label, "batch": b, "peak_bytes": pr.delta_bytes,
                   "error": pr.error, "step_seconds": pr.step_seconds}
            out.append(row)
            log(f"sweep {model} batch {b:<6} {label:<10} "
                + (f"{pr.delta_mib:.1f} MiB" if pr.ok else f"error: {pr.error}"))
    return out


def cmd_bench(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    kw = _model_kwargs(args.model_kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("once")
        rows = bench_rows(_names(args.models), _ints(args.bits), args.strategy, args.config,
                          args.batch, not args.no_peak, not args.no_checkpoint, kw, args.device,
                          args.bits_strategy or None)
        sweep = (peak_sweep(args.sweep_model, _ints(args.sweep), args.sweep_bits, args.config,
                            kw if args.sweep_model in _names(args.models) else {}, args.device)
                 if args.sweep else [])
    print()
    print(bench_table(rows))
    print(f"({time.perf_counter() - t0:.0f} s; saved = distinct storages kept for backward by "
          f"one forward + loss; peak = one step's peak over the warmed-up state, fresh child "
          f"process on CPU)")
    _write_json(args.json, {"environment": _environment(), "rows": rows, "sweep": sweep})
    return 0


# -------------------------------------------------------------------------- max-batch ----
def cmd_max_batch(args: argparse.Namespace) -> int:
    from .bench import MODES, StepSpec, find_max_batch

    cap = int(args.cap_mib * MiB) if args.cap_mib else None
    kw = _model_kwargs(args.model_kwargs)
    results = []
    t0 = time.perf_counter()
    modes, known = _names(args.modes), MODES + ("floor",)
    unknown = [m for m in modes if m not in known]
    if unknown:
        raise SystemExit(f"max-batch: unknown mode(s) {unknown}; choose from "
                         f"{', '.join(known)}")
    for mode in modes:
        # floor: the plain forward under no_grad, the bound of every method (StepSpec.phase)
        phase = "no_grad" if mode == "floor" else "step"
        spec = StepSpec(args.model, args.start, mode="fp32" if mode == "floor" else mode,
                        bits=args.bits, config=args.config, strategy=args.strategy or None,
                        model_kwargs=kw, device=args.device, steps=args.steps, phase=phase)

        def log(b: int, rep, ok: bool, label: str = spec.label) -> None:
            what = f"{rep.delta_mib:.1f} MiB" if rep.ok else f"error {rep.error}"
            print(f"  {label:<11} batch {b:<7} {what:<28} {'fits' if ok else 'too big'}",
                  flush=True)

        res = find_max_batch(spec, cap, start=args.start, limit=args.limit,
                             rel_tol=args.tolerance, on_try=log)
        results.append({"mode": spec.label, "max_batch": res.batch_size,
                        "hit_limit": res.hit_limit,
                        "tries": [{"batch": b, "peak_bytes": r.delta_bytes, "fits": ok,
                                   "error": r.error} for b, r, ok in res.tries]})
        print(f"{spec.label}: largest batch {res.batch_size}"
              + (" (search limit reached)" if res.hit_limit else ""), flush=True)
    ref = next((r["max_batch"] for r in results if r["mode"] == "fp32"), None)
    rows = [(r["mode"], str(r["max_batch"]) + ("+" if r["hit_limit"] else ""),
             f"{r['max_batch'] / ref:.1f}x" if ref else "-") for r in results]
    print()
    print(f"{args.model}, cap {args.cap_mib} MiB of peak memory over the warmed-up state "
          f"({args.device}); bracket tolerance {args.tolerance:.0%}; "
          f"{time.perf_counter() - t0:.0f} s")
    print(_table(("mode", "max batch", "vs fp32"), rows))
    _write_json(args.json, {"environment": _environment(), "model": args.model,
                            "cap_mib": args.cap_mib, "results": results})
    return 0


# ----------------------------------------------------------------------------- parser ----
def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None,
                   help="config for convert_model: a shipped name (4bit, ...) or a YAML path")
    p.add_argument("--model-kwargs", default=None, help='JSON, e.g. \'{"width": 64}\'')
    p.add_argument("--device", default="cpu", help="cpu or cuda")


def _model_name(models: Sequence[str]) -> Callable[[str], str]:
    def check(text: str) -> str:
        if text in models or ":" in text:
            return text
        raise argparse.ArgumentTypeError(
            f"unknown model {text!r}: one of {', '.join(models)}, or module:callable")
    return check


def build_parser() -> argparse.ArgumentParser:
    from .config import STRATEGIES
    from .models import WORKLOADS

    models = sorted(WORKLOADS)
    parser = argparse.ArgumentParser(prog="python -m actnn_zoo", description=__doc__.split(
        "\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("report", help="saved-activation bytes per module, fp32 vs converted")
    p.add_argument("--model", default="resnet", type=_model_name(models),
                   help=f"one of {', '.join(models)}, or module:callable (any importable "
                        "model factory, e.g. torchvision.models:resnet18; with --input-shape)")
    p.add_argument("--input-shape", default=None,
                   help="module:callable models: comma list, e.g. 8,3,224,224")
    p.add_argument("--vocab", type=int, default=0,
                   help="module:callable models: token ids below this instead of floats")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--mode", default="bits", choices=("fp32", "bits", "checkpoint"))
    p.add_argument("--bits", type=int, default=None, help="override the config's width")
    p.add_argument("--strategy", default=None, choices=STRATEGIES,
                   help="precision strategy for convert_model")
    p.add_argument("--top", type=int, default=20, help="modules to list")
    _common(p)
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("bench", help="compression and peak memory per model and bit width")
    p.add_argument("--models", default=",".join(BENCH_MODELS),
                   help=f"comma list of {', '.join(models)}")
    p.add_argument("--bits", default="1,2,4,8", help="comma list of bit widths")
    p.add_argument("--strategy", default=None, choices=STRATEGIES,
                   help="also a row with convert_model(strategy=...), e.g. actnn")
    p.add_argument("--bits-strategy", default="uniform", choices=("",) + STRATEGIES,
                   help="strategy for the --bits rows ('' = the config's default)")
    p.add_argument("--batch", type=int, default=None, help="one batch for all models "
                   f"(default per model: {DEFAULT_BATCH})")
    p.add_argument("--no-peak", action="store_true", help="skip the child-process peaks")
    p.add_argument("--no-checkpoint", action="store_true", help="skip checkpointing rows")
    p.add_argument("--sweep", default=None,
                   help="comma list of batch sizes: peak memory of fp32 / bits / checkpoint "
                        "for --sweep-model at each (for scripts/plots.py)")
    p.add_argument("--sweep-model", default="resnet", choices=models)
    p.add_argument("--sweep-bits", type=int, default=2)
    p.add_argument("--json", default=None, help="write rows and sweep as JSON")
    _common(p)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("max-batch", help="largest batch under a peak-memory cap")
    p.add_argument("--model", default="resnet", choices=models)
    p.add_argument("--cap-mib", type=float, default=256.0,
                   help="cap on a step's peak over the warmed-up state (MiB); on cuda 0 "
                        "means: until a real out-of-memory error")
    p.add_argument("--modes", default="fp32,bits,checkpoint",
                   help="comma list of fp32, bits, checkpoint and floor (not a training "
                        "step: the plain forward under no_grad, which bounds every method)")
    p.add_argument("--bits", type=int, default=2)
    p.add_argument("--strategy", default="uniform", choices=("",) + STRATEGIES,
                   help="precision strategy for the bits mode ('' = the config's default)")
    p.add_argument("--start", type=int, default=64, help="first batch tried (then doubling)")
    p.add_argument("--limit", type=int, default=1 << 17, help="largest batch tried")
    p.add_argument("--tolerance", type=float, default=0.05,
                   help="stop bisecting when the bracket is within this fraction")
    p.add_argument("--steps", type=int, default=2, help="measured steps per try")
    p.add_argument("--json", default=None)
    _common(p)
    p.set_defaults(func=cmd_max_batch)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
