"""The demo: train on real data three ways (fp32, compressed, checkpointed) and print one table.

``python -m actnn_zoo.demo [--full] [--seeds 3] [--bits 2] [--config 2bit]``

The default is the quick preset (a few minutes on 2 cores); ``--full`` is the run behind the
accuracy table in docs/results.md.

* digits (scikit-learn's bundled 8x8 images): the ResNet-style CNN, test accuracy;
* stdlib source (the Python files next to ``os``): a char-level transformer, validation loss.

Each task trains the same initial weights (same seed) on the same data order in every mode;
only the activation storage differs. The table adds, per mode: saved-activation MiB for one
training batch, compression vs fp32, peak memory of one step (fresh child process on CPU)
and the median step time relative to fp32 (all modes in this process).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, TextIO, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .data import (Digits, TextCorpus, iterate_minibatches, load_digits_data, load_text_corpus,
                   random_windows, sequential_windows)
from .bench import StepSpec, apply_mode, build_step, interleaved_step_times, spec_peak_memory
from .memory import saved_activation_bytes
from .models import CharTransformer, DigitsResNet

MODES = ("fp32", "bits", "checkpoint")


@dataclass
class TrainResult:
    """One training run: the final metric, per-step losses and per-step wall times."""

    metric: float
    losses: List[float]
    step_seconds: List[float]
    model: Optional[nn.Module] = field(default=None, repr=False)


@dataclass
class DigitsSetup:
    """Sizes of the digits run (``quick`` and full presets below)."""

    epochs: int = 30
    batch_size: int = 64
    width: int = 32
    lr: float = 0.05


@dataclass
class TextSetup:
    """Sizes of the text run."""

    steps: int = 1000
    batch_size: int = 32
    context: int = 64
    d_model: int = 128
    n_heads: int = 4
    n_layers: int = 2
    lr: float = 3e-3
    num_chars: int = 1_000_000
    eval_windows: int = 512

    def model_kwargs(self, vocab_size: int) -> Dict[str, Any]:
        return dict(vocab_size=vocab_size, d_model=self.d_model, n_heads=self.n_heads,
                    n_layers=self.n_layers, context=self.context)


QUICK_DIGITS = DigitsSetup(epochs=6)
QUICK_TEXT = TextSetup(steps=120, num_chars=300_000, eval_windows=128)


def mode_label(mode: str, bits: Optional[int], config: Any) -> str:
    if mode != "bits":
        return mode
    if bits is not None:
        return f"{bits}-bit"
    return "converted" if config is not None else "2-bit (default)"


class _LineProgress:
    """A phase's progress as one line on ``stream`` when the phase ends.

    Used where stderr is not a terminal (CI, ``demo.sh > log 2>&1``): a progress bar there
    writes hundreds of ``\r`` updates that a log keeps as one unreadable line. This prints
    ``[demo] <phase>: <n> steps in <s> s, loss <first> -> <last>`` once instead.
    """

    def __init__(self, total: int, desc: str, stream: TextIO) -> None:
        self.total, self.desc, self.stream = total, desc, stream
        self.n = 0
        self.first_loss: Optional[float] = None
        self.last_loss: Optional[float] = None
        self.start = time.perf_counter()

    def update(self, n: int = 1, loss: Optional[float] = None) -> None:
        self.n += n
        if loss is not None:
            self.first_loss = loss if self.first_loss is None else self.first_loss
            self.last_loss = loss

    def close(self) -> None:
        loss = ("" if self.first_loss is None
                else f", loss {self.first_loss:.4f} -> {self.last_loss:.4f}")
        _phase_line(self.stream, f"{self.desc}: {self.n}/{self.total} steps in "
                                 f"{time.perf_counter() - self.start:.1f} s{loss}")


class _BarProgress:
    """A tqdm bar (on a terminal); the same ``update``/``close`` as :class:`_LineProgress`."""

    def __init__(self, bar: Any) -> None:
        self.bar = bar

    def update(self, n: int = 1, loss: Optional[float] = None) -> None:
        if loss is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
        self.bar.update(n)

    def close(self) -> None:
        self.bar.close()


class _NoProgress:
    """``progress=False``: nothing printed."""

    def update(self, n: int = 1, loss: Optional[float] = None) -> None:
        pass

    def close(self) -> None:
        pass


def _is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


def _phase_line(stream: TextIO, text: str) -> None:
    """One line of progress for a finished phase (flushed, so a log shows it at once)."""
    print(f"[demo] {text}", file=stream, flush=True)


def _progress(total: int, desc: str, enabled: bool, stream: Optional[TextIO] = None):
    """A progress reporter for one phase: a tqdm bar on a terminal, one line per phase
    otherwise (or where tqdm is not installed), nothing when disabled."""
    if not enabled:
        return _NoProgress()
    stream = sys.stderr if stream is None else stream
    if _is_terminal(stream):
        try:
            from tqdm.auto import tqdm
        except ImportError:  # tqdm is a dev requirement, not the package's
            pass
        else:
            return _BarProgress(tqdm(total=total, desc=desc, leave=False, file=stream,
                                     dynamic_ncols=True))
    return _LineProgress(total, desc, stream)


def _cosine(step: int, total: int) -> float:
    return 0.5 * (1 + math.cos(math.pi * min(step, total) / max(1, total)))


# ------------------------------------------------------------------------------ digits ----
def make_digits_model(setup: DigitsSetup, mode: str, seed: int, bits: Optional[int] = None,
                      config: Any = None) -> nn.Module:
    """Same seed -> same initial weights in every mode (conversion shares the parameters)."""
    torch.manual_seed(seed)
    return apply_mode(DigitsResNet(width=setup.width).train(), mode, bits, config)


def digits_accuracy(model: nn.Module, x: Tensor, y: Tensor) -> float:
    model.eval()
    with torch.no_grad():
        pred = torch.cat([model(x[i:i + 512]).argmax(1) for i in range(0, len(x), 512)])
    model.train()
    return 100.0 * float((pred == y).float().mean())


def train_digits(mode: str, setup: DigitsSetup = DigitsSetup(), seed: int = 0,
                 data: Optional[Digits] = None, bits: Optional[int] = None, config: Any = None,
                 max_steps: Optional[int] = None, progress: bool = True) -> TrainResult:
    """Train the ResNet-style CNN on digits; metric = test accuracy in percent."""
    data = data or load_digits_data()
    model = make_digits_model(setup, mode, seed, bits, config)
    opt = torch.optim.SGD(model.parameters(), lr=setup.lr, momentum=0.9, nesterov=True,
                          weight_decay=5e-4)
    per_epoch = len(data.x_train) // setup.batch_size
    total = setup.epochs * per_epoch if max_steps is None else min(max_steps,
                                                                   setup.epochs * per_epoch)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _cosine(s, total))
    order = torch.Generator().manual_seed(seed)  # data order independent of model-side RNG
    losses: List[float] = []
    times: List[float] = []
    bar = _progress(total, f"digits {mode_label(mode, bits, config)}, seed {seed}", progress)
    while len(losses) < total:
        for xb, yb in iterate_minibatches(data.x_train, data.y_train, setup.batch_size, order):
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            opt.step()
            sched.step()
            times.append(time.perf_counter() - t0)
            losses.append(float(loss.detach()))
            bar.update(1, losses[-1])
            if len(losses) >= total:
                break
    bar.close()
    acc = digits_accuracy(model, data.x_test, data.y_test)
    return TrainResult(acc, losses, times, model)


# -------------------------------------------------------------------------------- text ----
def make_text_model(setup: TextSetup, vocab_size: int, mode: str, seed: int,
                    bits: Optional[int] = None, config: Any = None) -> nn.Module:
    torch.manual_seed(seed)
    model = CharTransformer(**setup.model_kwargs(vocab_size)).train()
    return apply_mode(model, mode, bits, config)


def text_val_loss(model: nn.Module, ids: Tensor, context: int, max_windows: int) -> float:
    """Mean next-character cross-entropy (nats) over fixed non-overlapping windows."""
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for xb, yb in sequential_windows(ids, context, 64, max_windows):
            logits = model(xb)
            total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), yb.reshape(-1),
                                           reduction="sum"))
            count += yb.numel()
    model.train()
    return total / count


def train_text(mode: str, setup: TextSetup = TextSetup(), seed: int = 0,
               corpus: Optional[TextCorpus] = None, bits: Optional[int] = None,
               config: Any = None, max_steps: Optional[int] = None,
               progress: bool = True) -> TrainResult:
    """Train the char-level transformer on stdlib source; metric = validation loss (nats)."""
    corpus = corpus or load_text_corpus(setup.num_chars)
    model = make_text_model(setup, corpus.vocab_size, mode, seed, bits, config)
    opt = torch.optim.AdamW(model.parameters(), lr=setup.lr, weight_decay=0.01)
    total = setup.steps if max_steps is None else min(max_steps, setup.steps)
    warm = max(1, total // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * _cosine(s, total))
    order = torch.Generator().manual_seed(seed)
    losses: List[float] = []
    times: List[float] = []
    bar = _progress(total, f"text {mode_label(mode, bits, config)}, seed {seed}", progress)
    for _ in range(total):
        xb, yb = random_windows(corpus.train, setup.context, setup.batch_size, order)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        logits = model(xb)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), yb.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
        bar.update(1, losses[-1])
    bar.close()
    val = text_val_loss(model, corpus.val, setup.context, setup.eval_windows)
    return TrainResult(val, losses, times, model)


# ------------------------------------------------------------------------------- table ----
@dataclass
class Row:
    """One line of the demo table (``metric`` averaged over seeds)."""

    model: str
    mode: str
    metric_name: str
    metric: float
    metric_std: float
    seeds: int
    saved_mib: float
    ratio: float
    peak_mib: Optional[float]
    step_ms: float
    step_ratio: float
    per_seed: List[float] = field(default_factory=list)
    curve: List[float] = field(default_factory=list)
    peak_note: str = ""


COLUMNS = ("model", "mode", "metric", "saved MiB", "vs fp32", "peak MiB", "step ms",
           "step vs fp32")


def format_table(rows: Sequence[Row]) -> str:
    """The demo's one table (plain text, aligned)."""
    cells = [COLUMNS]
    for r in rows:
        metric = f"{r.metric_name} {r.metric:.{2 if r.metric_name == 'acc%' else 4}f}"
        if r.seeds > 1:
            metric += f" ±{r.metric_std:.{2 if r.metric_name == 'acc%' else 4}f} (n={r.seeds})"
        peak = "n/a" if r.peak_mib is None else f"{r.peak_mib:.1f}"
        cells.append((r.model, r.mode, metric, f"{r.saved_mib:.3f}", f"{r.ratio:.1f}x", peak,
                      f"{r.step_ms:.1f}", f"{r.step_ratio:.2f}x"))
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(c[i].ljust(widths[i]) for i in range(len(COLUMNS))).rstrip()
             for c in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _median_ms(times: Sequence[float], skip: int = 5) -> float:
    kept = list(times[skip:]) or list(times)
    return 1000.0 * statistics.median(kept)


def _saved(model_fn: Callable[[], nn.Module], batch: Tuple[Tensor, Tensor],
           loss: Callable[[Tensor, Tensor], Tensor]) -> int:
    x, y = batch
    return saved_activation_bytes(model_fn(), x, loss_fn=lambda out: loss(out, y),
                                  warmup=1).total_bytes  # the steady state (relu_codes)


def _ce(logits: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def run_task(task: str, modes: Sequence[str], seeds: Sequence[int], bits: Optional[int],
             config: Any, digits: DigitsSetup, text: TextSetup, peak: bool, mem_batch:
             Optional[int], progress: bool, timing_steps: int = 30) -> List[Row]:
    """Train ``task`` in each mode for each seed, measure memory and step time; rows in
    ``modes`` order."""
    if task == "digits":
        data = load_digits_data()
        batch = (data.x_train[:digits.batch_size], data.y_train[:digits.batch_size])
        train = lambda m, s: train_digits(m, digits, s, data, bits, config, progress=progress)
        make = lambda m: make_digits_model(digits, m, 0, bits, config)
        spec = StepSpec("resnet", mem_batch or digits.batch_size,
                        model_kwargs=dict(width=digits.width), bits=bits, config=config)
        name, metric_name, loss = "ResNet (digits)", "acc%", _ce
    elif task == "text":
        corpus = load_text_corpus(text.num_chars)
        batch = random_windows(corpus.train, text.context, text.batch_size,
                               torch.Generator().manual_seed(0))
        train = lambda m, s: train_text(m, text, s, corpus, bits, config, progress=progress)
        make = lambda m: make_text_model(text, corpus.vocab_size, m, 0, bits, config)
        spec = StepSpec("transformer", mem_batch or text.batch_size,
                        model_kwargs=text.model_kwargs(corpus.vocab_size), bits=bits,
                        config=config)
        name, metric_name, loss = "Transformer (stdlib text)", "val loss", _ce
    else:
        raise ValueError(f"unknown task {task!r}")

    def phase(text: str, since: float) -> None:
        if progress:  # the bars cover training; these lines the phases between them
            _phase_line(sys.stderr, f"{task} {text} ({time.perf_counter() - since:.1f} s)")

    rows: List[Row] = []
    all_runs = []
    for mode in modes:
        label = mode_label(mode, bits, config)
        runs = [train(mode, s) for s in seeds]
        all_runs.append(runs)
        metrics = [r.metric for r in runs]
        t = time.perf_counter()
        saved = _saved(lambda: make(mode), batch, loss)
        phase(f"{label}: saved activations of one batch, {saved / 2 ** 20:.3f} MiB", t)
        peak_mib, note = None, ""
        if peak:
            t = time.perf_counter()
            rep = spec_peak_memory(dataclasses.replace(spec, mode=mode))
            peak_mib = rep.delta_mib if rep.ok else None
            note = rep.method if rep.ok else (rep.error or "")
            phase(f"{label}: one step's peak in a child process, " + (
                f"{peak_mib:.1f} MiB" if peak_mib is not None else f"failed: {note}"), t)
        rows.append(Row(name, mode_label(mode, bits, config), metric_name,
                        statistics.fmean(metrics),
                        statistics.stdev(metrics) if len(metrics) > 1 else 0.0, len(seeds),
                        saved / 2 ** 20, 0.0, peak_mib, 0.0, 0.0, metrics, runs[0].losses,
                        note))
    # Step time: all modes on one training-sized batch, timed round-robin in this process (the
    # training loops above ran one mode after another, so load changes would skew them).
    train_batch = digits.batch_size if task == "digits" else text.batch_size
    if timing_steps > 0:
        t = time.perf_counter()
        times = interleaved_step_times(
            {m: build_step(dataclasses.replace(spec, mode=m, batch_size=train_batch))
             for m in modes}, n=timing_steps, warmup=3, rounds=3)
        phase(f"step time: {timing_steps} steps per mode, modes interleaved", t)
    else:  # fall back on the training loops' own step times
        times = {m: [t for r in runs for t in r.step_seconds[5:]]
                 for m, runs in zip(modes, all_runs)}
    for r, m in zip(rows, modes):
        r.step_ms = _median_ms(times[m], skip=0)
    ref = next((r for r, m in zip(rows, modes) if m == "fp32"), None)
    for r in rows:
        r.ratio = (ref.saved_mib / r.saved_mib) if ref and r.saved_mib else float("nan")
        r.step_ratio = (r.step_ms / ref.step_ms) if ref and ref.step_ms else float("nan")
    return rows


def environment() -> Dict[str, Any]:
    """What the numbers depend on: versions, threads, quantization backend."""
    try:
        from . import backend_name

        backend = backend_name()
    except Exception as exc:  # the backend reports why it cannot load
        backend = f"unavailable ({exc})"
    return {"python": platform.python_version(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "backend": backend,
            "machine": platform.machine(), "argv": sys.argv}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m actnn_zoo.demo", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    size = p.add_mutually_exclusive_group()
    size.add_argument("--full", action="store_true",
                      help="the full run (digits 30 epochs, text 1000 steps) instead of the "
                           "quick preset")
    size.add_argument("--quick", action="store_true",
                      help="the quick preset (the default; kept for old command lines)")
    p.add_argument("--seeds", type=int, default=1, help="average the metric over seeds 0..n-1")
    p.add_argument("--first-seed", type=int, default=0,
                   help="start the seeds here (e.g. --first-seed 1 --seeds 2: seeds 1 and 2, "
                        "to add seeds to an earlier run)")
    p.add_argument("--bits", type=int, choices=(1, 2, 4, 8), default=None,
                   help="override the config's bit width (default: the config's, 2 bits)")
    p.add_argument("--config", default=None,
                   help="config for convert_model: a shipped config's name (2bit, 4bit, ...; "
                        "actnn_zoo.config.shipped_configs()) or a YAML path")
    p.add_argument("--tasks", default="digits,text", help="comma list of: digits, text")
    p.add_argument("--modes", default=",".join(MODES), help="comma list of: fp32, bits, "
                   "checkpoint (fp32 is the reference for the ratios)")
    p.add_argument("--epochs", type=int, default=None, help="digits epochs (overrides preset)")
    p.add_argument("--text-steps", type=int, default=None, help="text steps (overrides preset)")
    p.add_argument("--mem-batch", type=int, default=None,
                   help="batch size for the peak-memory column (default: the training batch)")
    p.add_argument("--no-peak", action="store_true", help="skip the child-process peak memory")
    p.add_argument("--timing-steps", type=int, default=None,
                   help="timed steps per mode for the step-time column, round-robin over "
                        "modes after training (default 15, 30 with --full; 0: use the "
                        "training loops' own step times)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--json", default=None, help="write rows, curves and environment here")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress on stderr (by default a bar per training run on a "
                        "terminal, else one line per phase)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> List[Row]:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    quick = not args.full
    digits = DigitsSetup(**asdict(QUICK_DIGITS if quick else DigitsSetup()))
    text = TextSetup(**asdict(QUICK_TEXT if quick else TextSetup()))
    if args.epochs:
        digits.epochs = args.epochs
    if args.text_steps:
        text.steps = args.text_steps
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise SystemExit(f"unknown mode(s) {bad}; choose from {MODES}")
    seeds = list(range(args.first_seed, args.first_seed + max(1, args.seeds)))
    if args.timing_steps is None:
        args.timing_steps = 15 if quick else 30
    t0 = time.perf_counter()
    rows: List[Row] = []
    with warnings.catch_warnings():
        warnings.simplefilter("once")
        for task in [t.strip() for t in args.tasks.split(",") if t.strip()]:
            rows += run_task(task, modes, seeds, args.bits, args.config, digits, text,
                             not args.no_peak, args.mem_batch, not args.no_progress,
                             args.timing_steps)
    env = environment()
    print(f"actnn_zoo demo  torch {env['torch']}  backend {env['backend']}  "
          f"threads {env['threads']}  seeds {len(seeds)}  "
          f"{'quick' if quick else 'full'}  ({time.perf_counter() - t0:.0f} s)")
    print(f"digits: {digits.epochs} epochs, batch {digits.batch_size}; text: {text.steps} steps,"
          f" batch {text.batch_size}x{text.context}; saved MiB for one training batch; peak MiB:"
          f" one step's peak RSS over the warmed-up child (batch "
          f"{args.mem_batch or 'as trained'}); step ms: " + (
              f"median of {args.timing_steps} steps per mode, modes interleaved"
              if args.timing_steps > 0 else "median of the training steps after 5"))
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "digits": asdict(digits), "text": asdict(text),
                       "rows": [asdict(r) for r in rows]}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
