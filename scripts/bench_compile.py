#!/usr/bin/env python
"""actnn_zoo.compile and torch.compile of a converted model against torch.compile of the plain
model and the eager converted model, in one process.

For each model (random init, nothing downloaded), with dropout off so that runs compare:

* graphs: how many graphs torch.compile makes of the plain model, of the converted one (the
  Q-layers' traced forms) and actnn_zoo.compile of the converted one (a graph break makes one
  more);
* held: the bytes a training forward leaves alive (glibc's allocator count around the forward,
  after warm-up), for fp32, the eager converted model (default settings), torch.compile of the
  plain model, torch.compile of the converted model and actnn_zoo.compile of it; and for the
  compiled ones the bytes their graph saves, parameters excluded (exact: with many small
  saves, as GPT-2's here, the allocator count runs low, the saves reusing chunks the previous
  backward freed);
* cosine: the smallest per-parameter gradient cosine against eager fp32 at 8 bits, for the
  eager converted model, torch.compile of it and actnn_zoo.compile.

    .venv/bin/python scripts/bench_compile.py                  # resnet50 and gpt2
    .venv/bin/python scripts/bench_compile.py --models gpt2

Backend aot_eager (the graph as traced, no code generation): what is measured here is what is
saved, not kernel speed (scripts/bench_host_cost.py times the compiled modes).

Models: resnet50 (torchvision, batch 8, 64x64, cross-entropy; torchvision from
``.bench_deps``, see scripts/third_party.py); gpt2 (transformers GPT-2, 12 layers of width
64, 4 heads, batch 4 x 32 tokens, the loss inside the model, ``use_cache=False``).
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Callable, Dict, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import actnn_zoo as az  # noqa: E402
from actnn_zoo.bench import malloc_live_bytes  # noqa: E402

import bench_host_cost  # noqa: E402  (its models, at other sizes)

Workload = Tuple[Callable[[], nn.Module], Callable[[nn.Module], torch.Tensor]]


def _resnet50() -> Workload:
    return bench_host_cost.resnet50(batch=8, side=64)[:2]


def _gpt2() -> Workload:
    # no key/value cache: it would be kept alive with the outputs and counted as held
    return bench_host_cost.gpt2(batch=4, tokens=32, use_cache=False)[:2]


MODELS: Dict[str, Callable[[], Workload]] = {"resnet50": _resnet50, "gpt2": _gpt2}


def counting_backend(counts: Dict[str, int], tag: str) -> Callable:
    """aot_eager, counting the graphs it is given."""
    aot_eager = torch._dynamo.lookup_backend("aot_eager")

    def backend(gm, example_inputs):
        counts[tag] = counts.get(tag, 0) + 1
        return aot_eager(gm, example_inputs)
    return backend


def held_bytes(loss_of: Callable[[nn.Module], torch.Tensor], model: nn.Module,
               steps: int = 3) -> int:
    """Bytes the last of ``steps`` forwards left alive (the first ones compile and warm up)."""
    held = 0
    for _ in range(steps):
        before = malloc_live_bytes()
        loss = loss_of(model)
        held = malloc_live_bytes() - before
        loss.backward()
        del loss  # its graph and outputs go now, not during the next forward's count
        model.zero_grad(set_to_none=True)
    return held


def graph_saved_bytes(loss_of: Callable[[nn.Module], torch.Tensor], model: nn.Module
                      ) -> Optional[int]:
    """Bytes a compiled graph saves for backward, parameters and buffers excluded: the saved
    tensors of the step's compiled autograd nodes (None for an eager model). Exact where the
    allocator count is not: many small saves reuse chunks the previous backward freed, which
    glibc still counts as in use."""
    own = {t.untyped_storage().data_ptr()
           for t in list(model.parameters()) + list(model.buffers())}
    loss = loss_of(model)
    seen, todo, total, compiled = set(), [loss.grad_fn], 0, False
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "CompiledFunctionBackward":
            compiled = True
            for t in node.saved_tensors:
                if t is not None and t.untyped_storage().data_ptr() not in own:
                    total += t.numel() * t.element_size()
        todo += [f for f, _ in node.next_functions]
    loss.backward()
    model.zero_grad(set_to_none=True)
    return total if compiled else None


def min_cosine(ref: nn.Module, other: nn.Module) -> Tuple[float, str]:
    worst = (2.0, "")
    for (name, a), b in zip(ref.named_parameters(), other.parameters()):
        if a.grad is not None and a.grad.any():
            cos = F.cosine_similarity(a.grad.flatten(), b.grad.flatten(), 0).item()
            worst = min(worst, (cos, name))
    return worst


def measure(name: str) -> str:
    make, loss_of = MODELS[name]()
    torch.manual_seed(0)
    base = make().train()
    for m in base.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    counts: Dict[str, int] = {}
    runs = {"fp32": base,
            "eager default": az.convert_model(copy.deepcopy(base)),
            "torch.compile fp32": torch.compile(copy.deepcopy(base),
                                                backend=counting_backend(counts, "plain")),
            "torch.compile default": torch.compile(az.convert_model(copy.deepcopy(base)),
                                                   backend=counting_backend(counts, "converted")),
            "actnn_zoo.compile": az.compile(az.convert_model(copy.deepcopy(base)),
                                            backend=counting_backend(counts, "zoo"))}
    held = {k: held_bytes(loss_of, m) for k, m in runs.items()}
    graph = {k: graph_saved_bytes(loss_of, m) for k, m in runs.items()}
    ref = copy.deepcopy(base)
    loss_of(ref).backward()
    eager8 = az.convert_model(copy.deepcopy(base), bits=8)
    loss_of(eager8).backward()
    zoo8 = az.convert_model(copy.deepcopy(base), bits=8)
    loss_of(az.compile(zoo8, backend="aot_eager")).backward()
    traced8 = az.convert_model(copy.deepcopy(base), bits=8)
    loss_of(torch.compile(traced8, backend="aot_eager")).backward()
    lines = [f"\n{name}: graphs torch.compile {counts.get('plain')} / of the converted model "
             f"{counts.get('converted')} / actnn_zoo.compile {counts.get('zoo')}",
             f"{'mode':21s} | {'held MiB':>9s} | {'x less than fp32':>16s} | "
             f"{'graph saves MiB':>15s}"]
    for k, v in held.items():
        saved = "" if graph[k] is None else f"{graph[k] / 2 ** 20:15.3f}"
        lines.append(f"{k:21s} | {v / 2 ** 20:9.3f} | {held['fp32'] / max(v, 1):16.1f} | "
                     f"{saved:>15s}")
    for k in ("torch.compile default", "actnn_zoo.compile"):
        lines.append(f"{k} held / eager default held: {held[k] / held['eager default']:.2f}")
    for tag, m in (("eager converted", eager8), ("torch.compile converted", traced8),
                   ("actnn_zoo.compile", zoo8)):
        cos, where = min_cosine(ref, m)
        lines.append(f"8-bit min gradient cosine vs fp32, {tag}: {cos:.6f} ({where})")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, backend aot_eager, 1 thread")
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        if name not in MODELS:
            p.error(f"unknown model {name!r}; known: {', '.join(MODELS)}")
        print(measure(name), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
