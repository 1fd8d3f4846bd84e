"""A training step at the default settings reads nothing back from the tensors it computes.

On a GPU any such read (``.item()``, ``bool(t)``, ``nonzero``, ``unique``, ...) waits for every
queued kernel: the host stops running ahead of the device and the step pays the whole queue's
latency. The step here runs on the CPU, so the test cannot see a device wait; instead it follows
which tensors the step computed (anything derived from the model's parameters and buffers, its
inputs, or their gradients) and fails on any op that would read such a tensor back on the host.
Reads of tensors the step did not compute -- a seed drawn from torch's CPU generator, a
constant scalar rounded to a dtype -- are host work and allowed: on a GPU they touch no device
memory. Device-to-host copies cannot be told apart on a CPU-only machine; the GPU report runs
the same step under ``torch.cuda.set_sync_debug_mode("error")``.
"""
from __future__ import annotations

import traceback
from typing import Callable, List, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakTensorKeyDictionary
from torch.utils._python_dispatch import TorchDispatchMode

import actnn_zoo as az

# Ops whose result depends on a tensor's values on the host (a device wait on CUDA).
_READS = {"_local_scalar_dense", "nonzero", "nonzero_static", "masked_select", "unique",
          "_unique", "_unique2", "unique_consecutive", "unique_dim", "is_nonzero", "equal",
          "allclose", "item"}


class _SyncSpy(TorchDispatchMode):
    """Marks every op output computed from a marked tensor; records reads of marked tensors
    with the library frames that made them."""

    def __init__(self, roots: List[torch.Tensor]) -> None:
        super().__init__()
        self.marked = WeakTensorKeyDictionary()
        for t in roots:
            self.marked[t] = True
        self.reads: List[Tuple[str, List[str]]] = []

    def _is_marked(self, t: object) -> bool:
        return isinstance(t, torch.Tensor) and t in self.marked

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        from_step = any(self._is_marked(t) for t in flat)
        name = func.overloadpacket.__name__
        if from_step and name in _READS:
            where = [f"{f.filename.rsplit('actnn_zoo/', 1)[-1]}:{f.lineno} {f.name}"
                     for f in traceback.extract_stack() if "actnn_zoo" in f.filename
                     and "test_sync_free" not in f.filename]
            self.reads.append((name, where[-4:]))
        out = func(*args, **kwargs)
        if from_step:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.marked[t] = True
        return out


def _cnn() -> Tuple[nn.Module, Callable[[nn.Module], torch.Tensor], List[torch.Tensor]]:
    from actnn_zoo.models import DigitsResNet

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 1, 28, 28, generator=g), torch.randint(0, 10, (8,), generator=g)
    return DigitsResNet(), lambda m: F.cross_entropy(m(x), y), [x, y]


def _gpt2() -> Tuple[nn.Module, Callable[[nn.Module], torch.Tensor], List[torch.Tensor]]:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100,
                                  n_positions=32)
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    return transformers.GPT2LMHeadModel(cfg), lambda m: m(ids, labels=ids).loss, [ids]


@pytest.mark.parametrize("build", [_cnn, _gpt2], ids=["digits-cnn", "gpt2"])
def test_default_step_reads_nothing_it_computed(build):
    torch.manual_seed(0)
    model, loss_of, inputs = build()
    model = az.convert_model(model.train())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step() -> None:
        loss_of(model).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(14):  # warm-up: past the default strategy's first re-allocations
        step()
    roots = list(model.parameters()) + list(model.buffers()) + inputs
    for _ in range(3):
        spy = _SyncSpy(roots)
        with spy:
            step()
        assert not spy.reads, "host reads of tensors the step computed:\n" + "\n".join(
            f"  {name} at {' <- '.join(reversed(where))}" for name, where in spy.reads)


def test_the_spy_sees_a_read():
    """The check can fail: a step that reads its loss is caught, with the place named."""
    w = nn.Parameter(torch.randn(4))
    spy = _SyncSpy([w])
    with spy:
        loss = (w * 2).sum()
        if loss.item() > 1e9:  # a data-dependent branch, as user code might write
            pass
        torch.randn(3).sum().item()  # a value the step did not compute: allowed
    assert [name for name, _ in spy.reads] == ["_local_scalar_dense"]
