"""Shared checks for the conv/linear/norm layer tests (and the SyncBatchNorm worker process)."""
from __future__ import annotations

import copy
import math
import os
import socket
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from actnn_zoo.config import LayerQConfig


def cos(a: Tensor, b: Tensor) -> float:
    return F.cosine_similarity(a.detach().flatten().double(), b.detach().flatten().double(),
                               dim=0).item()


def rel_err(a: Tensor, ref: Tensor) -> float:
    return ((a.double() - ref.double()).norm() / ref.double().norm()).item()


def saved_bytes(fn: Callable[[], Tensor], exclude: Iterable[Tensor] = ()) -> Tuple[Tensor, int]:
    """Run ``fn`` and count the bytes of every distinct storage autograd saved for backward,
    leaving out the storages of ``exclude`` (the parameters). Returns (output, bytes)."""
    skip = {t.untyped_storage().data_ptr() for t in exclude if t is not None}
    seen: Dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def qbytes(shape: Sequence[int], bits: int, group_size: int = 256) -> int:
    """What the contract (docs/design.md) says a compressed tensor costs: dense codes per row plus a bf16
    (lo, step) pair per group of ``group_size`` values of a row (row = sample = dim 0)."""
    shape = torch.Size(shape)
    n = shape[0] if len(shape) >= 2 else 1
    d = shape.numel() // n if n else 0
    groups = math.ceil(d / group_size)
    return n * math.ceil(d * bits / 8) + 2 * 2 * n * groups


def params(m: nn.Module) -> List[Tensor]:
    return list(m.parameters())


def make_pair(layer: nn.Module, qcls, qconfig: Optional[LayerQConfig] = None):
    """(torch layer, Q layer) with identical, separate parameters (deep copies)."""
    ref = copy.deepcopy(layer).train()
    q = qcls.from_float(copy.deepcopy(layer), qconfig).train()
    return ref, q


def loss_grad(out: Tensor) -> Tensor:
    """grad_y of 0.5 * ||y - target||^2 for a random target: correlated with the output, as in
    training. (With an independent random grad_y a norm layer's weight gradient is a random walk
    of size sqrt(n) and the ~1% error of 8-bit values puts its cosine anywhere in
    0.99985-0.99999 depending on the draw.)"""
    return out.detach() - torch.randn_like(out)


def grads_of(m: nn.Module, x: Tensor, g: Tensor, **kw) -> Tuple[Tensor, List[Optional[Tensor]]]:
    """(input grad, parameter grads) of sum(m(x) * g), without touching .grad."""
    x = x.detach().clone().requires_grad_()
    out = m(x, **kw)
    ps = [p for p in m.parameters() if p.requires_grad]
    gs = torch.autograd.grad((out * g).sum(), [x] + ps)
    return gs[0], list(gs[1:])


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def syncbn_worker(rank: int, world: int, port: int, x: Tensor, g: Tensor,
                  state: Dict[str, Tensor], bits: int, out_dir: str) -> None:
    """One rank of the 2-process QSyncBatchNorm check (gloo on localhost)."""
    import torch.distributed as dist

    from actnn_zoo.nn import QSyncBatchNorm

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        torch.manual_seed(100 + rank)
        bn = QSyncBatchNorm(x.shape[1], qconfig=LayerQConfig(bits=bits))
        bn.load_state_dict(state)
        xs = x.chunk(world)[rank].clone().requires_grad_()
        out = bn(xs)
        (out * g.chunk(world)[rank]).sum().backward()
        torch.save({"out": out.detach(), "gx": xs.grad, "gw": bn.weight.grad,
                    "gb": bn.bias.grad, "running_mean": bn.running_mean,
                    "running_var": bn.running_var,
                    "num_batches_tracked": bn.num_batches_tracked},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
