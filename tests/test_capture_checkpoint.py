"""Checkpoint implementations under capture (issue 30, "Checkpointing without frame walks").

A checkpointed segment keeps its inputs and recomputes its forward from them in backward. If
tier 3 compressed those inputs, the recomputation would run from other values than the forward
did: masks and statistics that no longer match the loss, silently. Each implementation must be
detected or harmless (its inputs kept exact):

* ``torch.utils.checkpoint`` with ``use_reentrant=True``: a custom autograd Function whose
  forward runs the segment under no_grad, then saves the inputs. Tier 2's mode sees those
  no_grad calls: the saves that follow are a custom Function's and stay exact (public API).
* a re-entrant ``autograd.Function`` checkpoint written here (as DeepSpeed's and Megatron's
  are): the same rule, no file names involved.
* ``torch.utils.checkpoint`` with ``use_reentrant=False`` (and Hugging Face's
  ``gradient_checkpointing_enable``, which calls it): torch 2.13 saves the inputs from Python
  without a Function; the one frame above the pack hook tells (``_torch_private``).

In each case the gradients at 8 bits have cosine >= 0.9999 with fp32, and the segment input's
exactness is checked directly: a bias gradient that reads only the recomputed ReLU mask and
the exact output gradient matches fp32 to float rounding.
"""
from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import actnn_zoo as az

pytestmark = pytest.mark.usefixtures("one_thread")


class ReentrantCheckpoint(torch.autograd.Function):
    """A minimal re-entrant checkpoint, as third-party libraries write them: forward runs the
    segment under no_grad and saves its inputs; backward re-runs it with grad and
    back-propagates through the recomputation."""

    @staticmethod
    def forward(ctx: Any, run: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
        ctx.run = run
        ctx.save_for_backward(x)
        with torch.no_grad():
            return run(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_()
        with torch.enable_grad():
            y = ctx.run(x)
        torch.autograd.backward(y, grad)
        return None, x.grad


def _run_segment(kind: str, fn: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    if kind == "function":
        return ReentrantCheckpoint.apply(fn, x)
    return torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=(kind == "reentrant"))


class _Net(nn.Module):
    """A product (tier 3 compresses its operands) feeding a checkpointed conv + ReLU segment
    (its input is the product: tier 3 would compress it if it did not know better), then a
    Linear."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.pre = nn.Conv2d(8, 8, 1)
        self.block = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())
        self.fc = nn.Linear(8 * 64, 10)
        self.kind = kind

    def forward(self, x: Tensor) -> Tensor:
        h = self.pre(x)
        h = h * (h + 1.0)
        y = _run_segment(self.kind, self.block, h)
        return self.fc(y.flatten(1))


def _cos(a: Tensor, b: Tensor) -> float:
    return float(F.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))


@pytest.mark.parametrize("kind", ["reentrant", "nonreentrant", "function"])
def test_segment_inputs_are_kept_exact(kind):
    torch.manual_seed(0)
    ref = _Net(kind)
    q = az.convert_model(copy.deepcopy(ref), bits=8, strategy="uniform")
    x = torch.randn(16, 8, 8, 8, requires_grad=True)
    w = torch.randn(16, 10, generator=torch.Generator().manual_seed(1))
    for m in (ref, q):
        (m(x) * w).sum().backward()  # an exact output gradient (a loss on the output is routed)
    rel = (ref.block[0].bias.grad - q.block[0].bias.grad).norm() / ref.block[0].bias.grad.norm()
    assert rel < 1e-5, float(rel)
    for (name, a), b in zip(ref.named_parameters(), q.parameters()):
        assert _cos(a.grad, b.grad) >= 0.9999, name
    assert _cos(x.grad, x.grad) == pytest.approx(1.0)
    stats = az.capture_report(q)
    assert "checkpoint input" in stats.passed, str(stats)
    assert stats.compressed >= 1  # the product's operands outside the segment still are


def test_a_custom_function_after_grad_enabled_calls_is_still_compressed_around_it():
    """The no_grad rule is local: ops after the custom Function compress as before (the
    product after the checkpoint is compressed, the Function's own save is not)."""
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(64, 64)

        def forward(self, x: Tensor) -> Tensor:
            h = ReentrantCheckpoint.apply(lambda t: torch.tanh(t) * 2, self.a(x))
            return h * (h + 1.0)

    q = az.convert_model(Net(), bits=8, strategy="uniform")
    q(torch.randn(128, 64)).sum().backward()
    stats = az.capture_report(q)
    assert stats.passed["checkpoint input"][0] == 1
    assert stats.compressed == 2  # h and h + 1


def _gpt2(**kw: Any):
    T = pytest.importorskip("transformers")
    return T.GPT2LMHeadModel(T.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=500,
                                          n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                          attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                                          **kw)).train()


@pytest.mark.parametrize("reentrant", [True, False])
def test_hugging_face_gradient_checkpointing(reentrant):
    """HF's gradient checkpointing (torch.utils.checkpoint around each block, either mode) on
    a converted GPT-2 at 8 bits: every gradient has cosine >= 0.9999 with fp32's, and the
    blocks' inputs were kept exact."""
    torch.manual_seed(0)
    ref = _gpt2()
    x = torch.randint(0, 500, (4, 32), generator=torch.Generator().manual_seed(0))
    q = az.convert_model(copy.deepcopy(ref), bits=8, strategy="uniform")
    q.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    q.config.use_cache = False
    for m in (ref, q):
        F.cross_entropy(m(x).logits.flatten(0, 1), x.flatten()).backward()
    g_r = torch.cat([p.grad.flatten() for p in ref.parameters()])
    g_q = torch.cat([p.grad.flatten() for p in q.parameters()])
    assert _cos(g_r, g_q) >= 0.9999
    assert "checkpoint input" in az.capture_report(q).passed
