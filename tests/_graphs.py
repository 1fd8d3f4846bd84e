"""Helpers shared by the torch.compile tests (tests/test_compile.py, tests/test_compiled.py):
graphs counted, bytes a forward leaves alive, gradient cosines, the nodes of a graph, a short
training run."""
from __future__ import annotations

from typing import Callable, Dict

import torch
import torch.nn.functional as F
from torch import nn

from actnn_zoo.bench import malloc_live_bytes

from _scripts import load_script


def counting(counts: Dict[str, int], tag: str) -> Callable:
    """aot_eager, counting the graphs it is given (scripts/bench_compile.py's)."""
    return load_script("bench_compile.py").counting_backend(counts, tag)


def held_bytes(step: Callable[[], torch.Tensor]) -> int:
    """Bytes a forward leaves alive (its output included), from the C allocator."""
    before = malloc_live_bytes()
    out = step()
    after = malloc_live_bytes()
    out.backward()
    return after - before


def held_bytes_events(step: Callable[[], torch.Tensor]) -> int:
    """Bytes a forward leaves alive (its output included), from torch.profiler's memory
    events: allocations minus frees inside ``step``. Unlike :func:`held_bytes` (glibc's count
    of live bytes) it does not move with the heap's history: the same forward gives the same
    count whatever ran before it in the process."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = step()
    held = sum(e.self_cpu_memory_usage for e in prof.events())
    out.backward()
    return held


def min_cosine(ref: nn.Module, other: nn.Module) -> float:
    """The smallest gradient cosine over parameters; one with an all-zero reference gradient
    must have an all-zero gradient too (a cosine is undefined there)."""
    cos = []
    for (name, a), b in zip(ref.named_parameters(), other.parameters()):
        if a.grad is None:
            assert b.grad is None, name
        elif not a.grad.any():
            assert not b.grad.any(), name
        else:
            cos.append(F.cosine_similarity(a.grad.flatten().double(),
                                           b.grad.flatten().double(), 0).item())
    return min(cos)


def no_dropout(m: nn.Module) -> nn.Module:
    """Dropout off, so that runs compare."""
    for mod in m.modules():
        if isinstance(mod, nn.Dropout):
            mod.p = 0.0
    return m


def grad_nodes(out: torch.Tensor) -> set:
    """The class names of the autograd nodes ``out`` was made by."""
    nodes, todo = set(), [out.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and node not in nodes:
            nodes.add(node)
            todo += [f for f, _ in node.next_functions]
    return {node_name(n) for n in nodes}


def node_name(node) -> str:
    """A Python node's class name; a C++ custom node's Function (``QLinearFunction`` of
    ``torch::autograd::CppNode<actnn_zoo::(anonymous namespace)::QLinearFunction>``)."""
    full = node.name()
    if "CppNode<" in full:
        return full.rsplit("::", 1)[-1].rstrip(">")
    return type(node).__name__


def train_30_steps(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
                   y: torch.Tensor) -> None:
    """30 steps of cross-entropy on one batch: finite, and the loss at least halved."""
    losses = []
    for _ in range(30):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < 0.5 * losses[0], losses
