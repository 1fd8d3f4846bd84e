#!/usr/bin/env python
"""Host cost counted in CPU instructions: the step of ``scripts/bench_host_cost.py``, run under
valgrind's callgrind, reported as instructions per step, deterministic to the instruction.

Why: the host cost is what the library adds on the host per step, and on this project's
shared 2-core machines a step's time moves by 10-30% between runs of the same code (thread
CPU time included: the neighbours share caches and cores), more than most changes to the glue
move it. Instructions executed barely move (a small loop counted twice gave the same count;
GPT-2's fp32 step in two checkouts 78.62M and 78.64M), so a change of a few percent is read
off one run of each side. They are a proxy
of time, not time: a cache miss costs one instruction's count, and the Python interpreter's
instructions are cheaper on average than a kernel's. Use them for A/B of host-side changes;
report time from ``bench_host_cost.py``.

Each (model, mode) runs in its own process under ``valgrind --tool=callgrind --cache-sim=no``
(about 50x slower than native: ~4 minutes for GPT-2 and ~10 for ResNet-50 a mode, mostly
importing torch). The process builds the step as ``bench_host_cost.build_steps`` does (one
torch thread, OpenMP and MKL at one thread so that no worker spins), runs ``--warmup`` steps,
calls ``os.getppid()`` -- callgrind zeroes its counters on entering ``getppid``
(``--zero-before``) -- runs ``--steps`` steps and leaves with ``os._exit``, so the count at exit
is the timed steps' alone (plus a few thousand instructions of the exit). With the default
strategy, 10 steps are one whole cycle of its periodic steps (a recording and a
re-allocation), so the count is that of the mean step.

    .venv/bin/python scripts/bench_host_instructions.py --models gpt2 --modes fp32,default
    .venv/bin/python scripts/bench_host_instructions.py --jobs 2      # two processes at once
    .venv/bin/python scripts/bench_host_instructions.py --models resnet50 --modes default --split

``--split`` also divides each step's instructions between the library's compression loops and
the rest (``callgrind_annotate``, self cost per function): the loops are the functions of the
extension's kernel files (``cpp_ext/``, not its bindings, stacks or autograd-node glue) and
every function the kernels' task runners (``run_avx2``, ``run_fast``, ``parallel_tasks``)
inline. On a GPU those loops are device work that runs asynchronously; what a mode adds over
fp32 outside them -- Python, the bindings, torch's dispatch, autograd and allocator -- is host
work a GPU step pays too ("host extra", also per Q-module). At the host-cost sizes the loops
are a large part of ResNet-50's extra: its tensors are not tiny enough for the arithmetic of
compression to vanish, so its step-time ratio on the CPU is not all host cost.

Needs ``valgrind`` on the PATH (``callgrind_annotate`` too for ``--split``).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

HERE = Path(__file__).resolve().parent
DEFAULT_MODELS = ("gpt2", "resnet50")
DEFAULT_MODES = ("fp32", "default", "uniform-2", "no-capture")
# One thread everywhere: a spinning OpenMP or MKL worker would add instructions that depend on
# scheduling; a fixed hash seed fixes dict and set layouts.
WORKER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}


def worker(model: str, mode: str, warmup: int, steps: int) -> None:
    """Build the step, warm up, mark the start (``os.getppid``), run ``steps`` steps, exit."""
    sys.path.insert(0, str(HERE))
    import torch

    import bench_host_cost as b

    torch.set_num_threads(1)
    step = b.build_steps(model, [mode])[0][mode]
    for _ in range(warmup):
        step()
    os.getppid()  # callgrind: --zero-before=getppid
    for _ in range(steps):
        step()
    sys.stdout.flush()
    os._exit(0)  # the count at exit is the steps' (no interpreter shutdown)


# The extension's files that are glue (argument parsing, the autograd nodes, the mode stack),
# not compression loops; and the task runners every kernel loop runs inside (cpp_ext/isa_cpu.h,
# tasks_cpu.h), whose names the functions they inline carry.
_GLUE_FILES = ("bindings.cpp", "stacks.cpp", "qlayers.cpp")
_LOOP_MARKS = ("run_avx2", "run_fast", "parallel_tasks")
_LINE = re.compile(r"^\s*([\d,]+)\s+(?:\([^)]*\)\s+)?(.*)$")


def loop_instructions(annotated: str) -> int:
    """The instructions ``callgrind_annotate --inclusive=no`` attributes to the library's
    compression loops (see the module docstring), from its function lines."""
    total = 0
    for line in annotated.splitlines():
        m = _LINE.match(line)
        if m is None or "(100.0%)" in line:
            continue
        where = m.group(2)
        path, _, symbol = where.partition(":")
        ours = "/cpp_ext/" in path and not path.endswith(_GLUE_FILES)
        if ours or ("actnn_zoo" in symbol and any(k in symbol for k in _LOOP_MARKS)):
            total += int(m.group(1).replace(",", ""))
    return total


def split(out: Path) -> int:
    """The compression loops' instructions in the callgrind output ``out``."""
    annotate = shutil.which("callgrind_annotate")
    if annotate is None:
        raise RuntimeError("--split needs callgrind_annotate on the PATH")
    run = subprocess.run([annotate, "--inclusive=no", "--tree=none", "--auto=no",
                          "--threshold=100", str(out)], capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"callgrind_annotate failed: {run.stderr[-2000:]}")
    return loop_instructions(run.stdout)


def count(model: str, mode: str, warmup: int, steps: int, python: str,
          valgrind: str, loops: bool = False) -> Tuple[int, str, Optional[int]]:
    """(instructions of ``steps`` steps, the worker's output, and with ``loops`` those of the
    compression loops among them) for one (model, mode)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        cmd = [valgrind, "--tool=callgrind", "--cache-sim=no", "--zero-before=getppid",
               f"--callgrind-out-file={out}", python, str(Path(__file__).resolve()), "--worker",
               "--models", model, "--modes", mode, "--warmup", str(warmup), "--steps",
               str(steps)]
        env = {**os.environ, **WORKER_ENV}
        run = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if run.returncode != 0 or not out.exists():
            raise RuntimeError(f"{model}/{mode}: the worker failed (rc {run.returncode}):\n"
                               f"{run.stdout[-2000:]}\n{run.stderr[-2000:]}")
        match = re.search(r"^summary:\s*(\d+)", out.read_text(), re.MULTILINE)
        if match is None:
            raise RuntimeError(f"{model}/{mode}: no summary line in callgrind's output")
        return int(match.group(1)), run.stdout, split(out) if loops else None


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(DEFAULT_MODELS))
    p.add_argument("--modes", default=",".join(DEFAULT_MODES),
                   help="modes of scripts/bench_host_cost.py (fp32 is always counted)")
    p.add_argument("--warmup", type=int, default=15, help="steps before counting")
    p.add_argument("--steps", type=int, default=10, help="counted steps")
    p.add_argument("--jobs", type=int, default=1, help="processes at once")
    p.add_argument("--split", action="store_true",
                   help="also the compression loops' instructions and the rest's (the host "
                        "side a GPU step would feel; see the module docstring)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if args.worker:
        worker(models[0], modes[0], args.warmup, args.steps)
        return 0  # not reached: the worker leaves with os._exit
    if args.steps < 1 or args.warmup < 0 or args.jobs < 1:
        p.error("--steps and --jobs must be >= 1 and --warmup >= 0")
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        p.error("valgrind is not on the PATH (Debian: apt-get install valgrind)")
    sys.path.insert(0, str(HERE))
    import bench_host_cost as b

    for m in models:
        if m not in b.MODELS:
            p.error(f"unknown model {m!r}; known: {', '.join(b.MODELS)}")
    for m in modes:
        if m not in b.MODES:
            p.error(f"unknown mode {m!r}; known: {', '.join(b.MODES)}")
    if "fp32" not in modes:
        modes.insert(0, "fp32")
    jobs = [(model, mode) for model in models for mode in modes]
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(lambda job: count(*job, args.warmup, args.steps,
                                                  sys.executable, valgrind, args.split),
                                jobs))
    counts: Dict[Tuple[str, str], int] = {job: n for job, (n, _, _) in zip(jobs, results)}
    loops: Dict[Tuple[str, str], int] = {job: k or 0 for job, (_, _, k) in zip(jobs, results)}
    print(f"instructions per step (callgrind, {args.steps} steps after {args.warmup}), "
          f"and over fp32's")
    for model in models:
        base = counts[(model, "fp32")] / args.steps
        rest0 = base - loops[(model, "fp32")] / args.steps
        n_q = b.build_steps(model, ["default"])[1] if args.split else 0
        head = (f"{'mode':18s}| {'M instr/step':>12s} | {'x fp32':>7s} | "
                f"{'extra M/step':>12s}")
        if args.split:
            head += f" | {'loops M':>8s} | {'host extra M':>12s} | {'K/Q-module':>10s}"
        rows: List[str] = [f"\n{model}" + (f" ({n_q} Q-modules)" if n_q else ""), head]
        for mode in modes:
            per = counts[(model, mode)] / args.steps
            row = (f"{mode:18s}| {per / 1e6:12.2f} | {per / base:7.3f} | "
                   f"{(per - base) / 1e6:12.2f}")
            if args.split:
                k = loops[(model, mode)] / args.steps
                host = per - k - rest0
                row += (f" | {k / 1e6:8.2f} | {host / 1e6:12.2f} | "
                        f"{host / n_q / 1e3 if mode != 'fp32' else 0:10.0f}")
            rows.append(row)
        print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
