#!/usr/bin/env python
"""ResNet-50 (torchvision) and GPT-2 small (transformers), fp32 against compressed training.

    python scripts/bench_gpu_models.py --json results/gpu/models.json
    python scripts/bench_gpu_models.py --models resnet50 --quick      # a smoke run

Random initialisation and random data (nothing is downloaded). Four modes per model, every one
measured in this process on the same device:

* ``fp32``: the plain model.
* ``2-bit uniform``: ``convert_model(model, bits=2, strategy="uniform")``.
* ``2-bit default``: ``convert_model(model)`` (auto precision, a 2-bit average).
* ``checkpoint``: ``torch.utils.checkpoint`` (non-reentrant) per residual block (ResNet-50) or
  per transformer block (GPT-2, through ``transformers``' own switch).
* on request (``--modes "compiled fp32" "compiled default" "torch.compile default"``):
  ``torch.compile`` of the plain model, ``actnn_zoo.compile`` of ``convert_model(model)`` and
  ``torch.compile`` of ``convert_model(model)`` (the Q-layers' traced forms), inductor; no
  saved-bytes report for them (the graph saves what the hooks never see); their step peak
  says it.

For each: the bytes the allocator holds after one training forward plus the loss, the graph
alive (``memory_allocated``; the output and loss included), and the saved-activation bytes the
saved-tensor hooks see (``actnn_zoo.memory``; a converted model's compressed payloads are not
among them: an H200 run reported 0 there) -- both after the warm-up steps, so auto precision
has applied its first allocation --, the step's peak memory over what
is allocated between steps (``max_memory_allocated``), the median step time, every mode timed
round-robin in one process, and the largest batch whose step peak stays under a cap. The
largest batch is found from a linear fit of the peak at two batch sizes, then checked by
running steps at the predicted size and bisecting (each try one warm-up step plus one measured
step; an out-of-memory error counts as not fitting). For GPT-2 it also lists what is still
saved uncompressed (floating-point tensors) in the 2-bit default mode, per module.

Without a GPU it runs on the CPU only with ``--device cpu`` (for checking the script; the
figures mean nothing there).
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import actnn_zoo as az  # noqa: E402
from actnn_zoo.memory import saved_activation_bytes  # noqa: E402

MiB = 2 ** 20
MODES = ("fp32", "2-bit uniform", "2-bit default", "checkpoint")
# Asked for by name (--modes): each compiles for minutes, and their saves happen inside the
# graph, where the saved-bytes hooks do not see them (the step's peak does).
COMPILED_MODES = ("compiled fp32", "compiled default", "torch.compile default")
FLOAT_DTYPES = ("float32", "float16", "float64")


# ------------------------------------------------------------------------------- models ----
class _Checkpointed(nn.Module):
    """Runs ``block`` under non-reentrant torch.utils.checkpoint while training."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: Tensor) -> Tensor:
        if self.training and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)
        return self.block(x)


def _resnet50(quick: bool) -> nn.Module:
    import torchvision

    if quick:  # same block structure, far fewer blocks and channels
        from torchvision.models.resnet import Bottleneck, ResNet
        return ResNet(Bottleneck, [1, 1, 1, 1], num_classes=10, width_per_group=16)
    return torchvision.models.resnet50(weights=None)


def _resnet_checkpoint(model: nn.Module) -> nn.Module:
    for name in ("layer1", "layer2", "layer3", "layer4"):
        stage = getattr(model, name)
        for i, block in enumerate(list(stage)):
            stage[i] = _Checkpointed(block)
    return model


class _GPT2Logits(nn.Module):
    def __init__(self, quick: bool) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(use_cache=False) if not quick else GPT2Config(
            n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=128, use_cache=False)
        self.lm = GPT2LMHeadModel(cfg)

    def forward(self, idx: Tensor) -> Tensor:
        return self.lm(input_ids=idx).logits


def _gpt2_checkpoint(model: nn.Module) -> nn.Module:
    lm = model.lm
    if hasattr(lm, "activation_checkpointing_enable"):  # transformers >= 5
        lm.activation_checkpointing_enable({"use_reentrant": False})
    else:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _image_batch(n: int, side: int, classes: int, device: torch.device,
                 g: torch.Generator) -> Tuple[Tensor, Tensor]:
    x = torch.randn(n, 3, side, side, generator=g).to(device)
    return x, torch.randint(0, classes, (n,), generator=g).to(device)


def _token_batch(n: int, seq: int, vocab: int, device: torch.device,
                 g: torch.Generator) -> Tuple[Tensor, Tensor]:
    t = torch.randint(0, vocab, (n, seq + 1), generator=g)
    return t[:, :-1].contiguous().to(device), t[:, 1:].contiguous().to(device)


def _lm_loss(logits: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


class Workload:
    def __init__(self, name: str, quick: bool) -> None:
        self.name = name
        self.quick = quick
        if name == "resnet50":
            self.side, self.classes = (32, 10) if quick else (224, 1000)
            self.describe = (f"torchvision ResNet-50, {self.side}x{self.side} random images, "
                             f"{self.classes} classes, SGD momentum 0.9")
        elif name == "gpt2":
            self.seq, self.vocab = (64, 512) if quick else (1024, 50257)
            self.describe = (f"transformers GPT-2 small (124M, random init), sequence "
                             f"{self.seq}, SGD momentum 0.9")
        else:
            raise ValueError(f"unknown model {name!r}")

    def build(self, mode: str, device: torch.device) -> nn.Module:
        torch.manual_seed(0)
        model = _resnet50(self.quick) if self.name == "resnet50" else _GPT2Logits(self.quick)
        model = model.to(device).train()
        if mode == "2-bit uniform":
            model = az.convert_model(model, bits=2, strategy="uniform")
        elif mode == "2-bit default":
            model = az.convert_model(model)
        elif mode == "checkpoint":
            model = (_resnet_checkpoint if self.name == "resnet50" else _gpt2_checkpoint)(model)
        elif mode == "compiled fp32":
            model = torch.compile(model)
        elif mode == "compiled default":
            model = az.compile(az.convert_model(model))
        elif mode == "torch.compile default":
            model = torch.compile(az.convert_model(model))
        return model

    def batch(self, n: int, device: torch.device) -> Tuple[Tensor, Tensor]:
        g = torch.Generator().manual_seed(n)
        if self.name == "resnet50":
            return _image_batch(n, self.side, self.classes, device, g)
        return _token_batch(n, self.seq, self.vocab, device, g)

    def loss(self, out: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy(out, y) if self.name == "resnet50" else _lm_loss(out, y)


class Trainer:
    """One model in one mode with its optimizer; ``step(x, y)`` is one SGD step."""

    def __init__(self, work: Workload, mode: str, device: torch.device) -> None:
        self.work, self.mode, self.device = work, mode, device
        self.model = work.build(mode, device)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3, momentum=0.9)
        self.last_error: Optional[str] = None  # why the last step_peak returned None

    def step(self, x: Tensor, y: Tensor) -> None:
        self.opt.zero_grad(set_to_none=True)
        loss = self.work.loss(self.model(x), y)
        loss.backward()
        self.opt.step()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------- measurements ----
def step_peak(tr: Trainer, n: int) -> Optional[int]:
    """Peak bytes one step at batch ``n`` allocates over what is held between steps, or None
    when it runs out of memory. One warm-up step at that batch first (optimizer state,
    workspaces, allocator pools)."""
    dev = tr.device
    try:
        x, y = tr.work.batch(n, dev)
        tr.step(x, y)
        _sync(dev)
        gc.collect()
        if dev.type != "cuda":
            tr.step(x, y)
            return 0
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        tr.step(x, y)
        _sync(dev)
        return torch.cuda.max_memory_allocated(dev) - base
    except RuntimeError as exc:  # out of memory (CUDA or host), or a size the kernels refuse
        tr.last_error = f"{type(exc).__name__}: {str(exc)[:160]}"
        return None
    finally:
        tr.opt.zero_grad(set_to_none=True)
        x = y = None
        _free(dev)


def largest_batch(tr: Trainer, cap: int, n1: int, max_tries: int = 9,
                  seconds: Optional[float] = None) -> Dict[str, Any]:
    """Largest batch whose step peak is <= cap: linear prediction from batches n1 and 2 n1,
    then tries around the prediction and bisection to 2%. With ``seconds``, no new try starts
    after that long: the batch found so far is reported, marked ``"stopped": "time"`` (on an
    H200, GPT-2's search at 1.2 s a step took the GPU report's whole models phase)."""
    tries: List[Tuple[int, Optional[int]]] = []
    start = time.perf_counter()
    out_of_time = False

    def fits(n: int) -> bool:
        nonlocal out_of_time
        if seconds is not None and time.perf_counter() - start > seconds:
            out_of_time = True
            return False
        p = step_peak(tr, n)
        tries.append((n, p if p is not None else tr.last_error))
        return p is not None and p <= cap

    p1, p2 = step_peak(tr, n1), step_peak(tr, 2 * n1)
    tries += [(n1, p1), (2 * n1, p2)]
    if p1 is None or p2 is None or p1 > cap:
        return {"batch": None, "tries": tries, "note": "the fit batches do not fit the cap"}
    slope = max(1.0, (p2 - p1) / n1)
    pred = max(1, min(int(n1 + (cap - p1) / slope), 1 << 16))
    lo, hi = (2 * n1, None) if p2 <= cap else (n1, 2 * n1)
    cand = max(lo + 1, int(pred * 0.98))
    if hi is None or cand < hi:
        if fits(cand):
            lo = cand
            up = max(lo + 1, int(pred * 1.03))
            while hi is None and len(tries) < max_tries:
                if fits(up):
                    lo, up = up, int(up * 1.1) + 1
                else:
                    hi = up
        else:
            hi = cand
    while (hi is not None and hi - lo > max(1, int(lo * 0.02)) and len(tries) < max_tries
           and not out_of_time):
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    res = {"batch": lo, "upper_bound_failed": hi, "predicted": pred, "tries": tries,
           "fit_peaks_mib": [p1 / MiB, p2 / MiB]}
    if out_of_time:
        res["stopped"] = "time"
    return res


def saved_report(tr: Trainer, n: int) -> Dict[str, Any]:
    x, y = tr.work.batch(n, tr.device)
    rep = saved_activation_bytes(tr.model, x, loss_fn=lambda out: tr.work.loss(out, y))
    # bfloat16 is left out: in these fp32 models it is only the compressed groups' lo/step.
    float_bytes = sum(v for k, v in rep.dtype_bytes.items() if k in FLOAT_DTYPES)
    out = {"bytes": rep.total_bytes, "mib": rep.total_bytes / MiB,
           "float_mib": float_bytes / MiB, "dtype_mib": {k: v / MiB for k, v in
                                                         rep.dtype_bytes.items()},
           "top_modules_mib": [(m, b / MiB, c) for m, b, c in rep.top_modules(12)]}
    float_by_module = {m: sum(b for dt, b in d.items() if dt in FLOAT_DTYPES)
                       for m, d in rep.module_dtype_bytes.items()}
    rows = sorted(float_by_module.items(), key=lambda kv: -kv[1])
    out["float_by_module_mib"] = [(m, b / MiB) for m, b in rows[:15] if b]
    return out


def held_bytes(tr: Trainer, n: int) -> Optional[int]:
    """Bytes the allocator holds after a training forward plus the loss, the graph alive, over
    what it held before: everything kept for backward (the output and loss included), seen
    from the allocator, so a compressed payload the saved-tensor hooks never see counts too.
    None off CUDA."""
    dev = tr.device
    if dev.type != "cuda":
        return None
    x, y = tr.work.batch(n, dev)
    tr.opt.zero_grad(set_to_none=True)
    _free(dev)
    _sync(dev)
    base = torch.cuda.memory_allocated(dev)
    loss = tr.work.loss(tr.model(x), y)
    _sync(dev)
    held = torch.cuda.memory_allocated(dev) - base
    del loss
    _free(dev)
    return held


def step_times(trainers: Dict[str, Trainer], n: int, steps: int, rounds: int = 3
               ) -> Dict[str, List[float]]:
    batches = {m: tr.work.batch(n, tr.device) for m, tr in trainers.items()}
    times: Dict[str, List[float]] = {m: [] for m in trainers}
    for m, tr in trainers.items():  # warm-up (cuDNN autotuning, allocator pools)
        for _ in range(2):
            tr.step(*batches[m])
        _sync(tr.device)
    per_round = max(1, steps // rounds)
    for _ in range(rounds):
        for m, tr in trainers.items():
            for _ in range(per_round):
                _sync(tr.device)
                t0 = time.perf_counter()
                tr.step(*batches[m])
                _sync(tr.device)
                times[m].append(time.perf_counter() - t0)
    return times


def run_model(name: str, args: argparse.Namespace, device: torch.device) -> Dict[str, Any]:
    work = Workload(name, args.quick)
    n = args.batch.get(name) or (4 if args.quick else (64 if name == "resnet50" else 4))
    cap = int(args.cap_gib.get(name, 8.0) * 2 ** 30)
    res: Dict[str, Any] = {"model": name, "describe": work.describe, "batch": n,
                           "cap_gib": cap / 2 ** 30, "modes": {}}
    trainers = {}
    for mode in args.modes:
        t0 = time.perf_counter()
        try:
            tr = Trainer(work, mode, device)
            x, y = work.batch(n, device)
            for _ in range(3):  # auto precision solves at step 2 and applies at step 3
                tr.step(x, y)
            _sync(device)
            entry: Dict[str, Any] = {
                "saved": None if mode in COMPILED_MODES else saved_report(tr, n)}
            held = held_bytes(tr, n)
            entry["held_mib"] = None if held is None else held / MiB
            peak = step_peak(tr, n)
            entry["peak_mib"] = None if peak is None else peak / MiB
            trainers[mode] = tr
            res["modes"][mode] = entry
        except Exception as exc:  # keep measuring the other modes; the error is reported
            res["modes"][mode] = {"error": f"{type(exc).__name__}: {exc}",
                                  "trace": traceback.format_exc()[-3000:]}
            print(f"[{name}] {mode}: FAILED {type(exc).__name__}: {exc}", flush=True)
        finally:
            _free(device)
        print(f"[{name}] {mode}: saved/peak in {time.perf_counter() - t0:.1f}s", flush=True)
    if trainers and args.time_steps > 0:
        try:
            times = step_times(trainers, n, args.time_steps)
            for mode, ts in times.items():
                med = statistics.median(ts)
                res["modes"][mode]["step_ms"] = med * 1e3
                res["modes"][mode]["throughput"] = n / med
        except Exception as exc:
            res["timing_error"] = f"{type(exc).__name__}: {exc}"
            print(f"[{name}] timing FAILED: {exc}", flush=True)
        _free(device)
    if args.max_batch and device.type == "cuda":  # the CPU's step peak is not measured (0)
        n1 = args.fit_batch.get(name) or n
        for mode, tr in trainers.items():
            t0 = time.perf_counter()
            try:
                res["modes"][mode]["max_batch"] = largest_batch(tr, cap, n1,
                                                                seconds=args.max_batch_seconds)
            except Exception as exc:
                res["modes"][mode]["max_batch"] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"[{name}] {mode}: max batch {res['modes'][mode]['max_batch'].get('batch')} "
                  f"in {time.perf_counter() - t0:.1f}s", flush=True)
    for tr in trainers.values():
        del tr.model, tr.opt
    trainers.clear()
    _free(device)
    return res


# ------------------------------------------------------------------------------ output ----
def table(res: Dict[str, Any]) -> str:
    modes = res["modes"]
    fp = modes.get("fp32", {})
    lines = [f"### {res['describe']} (batch {res['batch']})", "",
             "| mode | held after forward MiB | vs fp32 | saved (hooks) MiB | step peak MiB | "
             f"peak vs fp32 | step ms | step vs fp32 | samples/s | largest batch (cap "
             f"{res['cap_gib']:g} GiB) | vs fp32 |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]

    def ratio(a: Optional[float], b: Optional[float], fmt: str = "{:.2f}x") -> str:
        return fmt.format(a / b) if a and b else "-"

    fp_held = fp.get("held_mib")
    fp_peak, fp_ms = fp.get("peak_mib"), fp.get("step_ms")
    fp_mb = (fp.get("max_batch") or {}).get("batch")
    for mode, e in modes.items():
        if "error" in e:
            lines.append(f"| {mode} | failed: {e['error'][:120]} ||||||||||")
            continue
        saved = (e.get("saved") or {}).get("mib")
        mb = (e.get("max_batch") or {}).get("batch")
        mb_text = "-" if not mb else (f">= {mb}" if (e.get("max_batch") or {}).get("stopped")
                                      else str(mb))
        held = e.get("held_mib")
        lines.append(
            f"| {mode} | {'-' if held is None else f'{held:.1f}'} | {ratio(fp_held, held)} | "
            f"{'-' if saved is None else f'{saved:.1f}'} | "
            f"{e.get('peak_mib') or float('nan'):.0f} | {ratio(fp_peak, e.get('peak_mib'))} | "
            f"{e.get('step_ms', float('nan')):.1f} | {ratio(e.get('step_ms'), fp_ms)} | "
            f"{e.get('throughput', float('nan')):.1f} | {mb_text} | "
            f"{ratio(mb, fp_mb)} |")
    d = modes.get("2-bit default", {}).get("saved")
    if d and res["model"] == "gpt2":
        lines += ["", f"Still saved in floating point at the 2-bit default: "
                      f"{d['float_mib']:.1f} of {d['mib']:.1f} MiB; largest modules:"]
        for m, b in d.get("float_by_module_mib", [])[:10]:
            lines.append(f"- `{m}`: {b:.1f} MiB")
    return "\n".join(lines)


def _kv(text: str, cast: Callable[[str], Any]) -> Dict[str, Any]:
    out = {}
    for part in filter(None, text.split(",")):
        k, v = part.split("=")
        out[k] = cast(v)
    return out


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["resnet50", "gpt2"])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES + COMPILED_MODES)
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=lambda s: _kv(s, int), default={},
                   help="per model batch for saved/peak/time, e.g. resnet50=64,gpt2=4")
    p.add_argument("--fit-batch", type=lambda s: _kv(s, int), default={},
                   help="per model first batch of the largest-batch fit (default: --batch)")
    p.add_argument("--cap-gib", type=lambda s: _kv(s, float),
                   default={"resnet50": 8.0, "gpt2": 16.0},
                   help="per model step-peak cap for the largest batch")
    p.add_argument("--time-steps", type=int, default=12)
    p.add_argument("--no-max-batch", dest="max_batch", action="store_false")
    p.add_argument("--max-batch-seconds", type=float, default=45.0,
                   help="per model and mode: no new largest-batch try after this long (the "
                        "batch found so far is reported as a lower bound)")
    p.add_argument("--quick", action="store_true", help="tiny models: checks the script")
    p.add_argument("--json", type=Path)
    p.add_argument("--markdown", type=Path)
    args = p.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_gpu_models: SKIPPED: no CUDA device. Nothing measured.")
        return 0
    info = {"torch": torch.__version__, "backend": az.backend_name(),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
            "tf32_cudnn": torch.backends.cudnn.allow_tf32}
    print(json.dumps(info), flush=True)
    results = {"info": info, "models": []}
    for name in args.models:
        results["models"].append(run_model(name, args, device))
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(results, indent=1, default=str))
    md = "\n\n".join(table(r) for r in results["models"])
    md = f"Device: {info['device']}, torch {info['torch']}, backend {info['backend']}\n\n" + md
    print(md)
    if args.markdown:
        args.markdown.write_text(md + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
