"""The loss written outside ``model.forward``: routed without a ``capturing`` block.

Most training loops compute the loss from the model's output in the loop itself
(``F.cross_entropy(model(ids).logits.flatten(0, 1), labels.flatten())``, Lightning's
``training_step``). The capture session covers only ``model.forward``, so that loss's
log-softmax over the vocabulary -- [tokens, vocab] fp32, about half of what a converted
language model saves -- was stored as torch saves it.

Keeping the session open after ``forward`` until backward starts is not safe: the tier-2 mode
and the tier-3 hooks sit on thread-local stacks, and whatever runs in between (an optimizer
step, eval code, another model's forward, a context the user enters and leaves) would run
inside them or unbalance the stacks; backward itself may run on other threads. Instead the
converted root returns its floating outputs as :class:`CapturedOutput`, a tensor subclass
whose ``__torch_function__`` (the public override protocol) does two things:

* the softmax family and ``cross_entropy`` called on it with grad enabled go to the same
  handlers tier 2 uses in the forward (the compressed probabilities instead of the fp32
  log-softmax; the forward values are torch's), so the loss is compressed with no block;
* shape and dtype changes on the way to the loss (``view``, ``flatten``, slicing,
  ``contiguous``, ``float``, ``transpose``...) return a :class:`CapturedOutput` again; every
  other call runs as torch's on the tensor itself and returns plain tensors.

Only what consumes this model's output is affected: nothing is left on any stack, so other
models, optimizers and eval code never see it; hooks and ``retain_grad`` act on the output
itself (calls run on the object, not on a copy). A converted root given a
:class:`CapturedOutput` as input (one model feeding another) takes it as a plain tensor.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..config import LayerQConfig
from .handlers import HANDLERS
from .store import CaptureStats

__all__ = ["CapturedOutput", "TailRouting", "wrap_outputs", "plain_inputs"]

# Calls routed on a CapturedOutput (grad enabled): the loss family of tier 2.
_ROUTED = frozenset({F.cross_entropy, F.softmax, torch.softmax, Tensor.softmax,
                     F.log_softmax, torch.log_softmax, Tensor.log_softmax})

# Calls whose result is still "the model's output" on its way to the loss.
_KEEP = frozenset({
    Tensor.view, Tensor.view_as, Tensor.reshape, Tensor.reshape_as, Tensor.flatten,
    torch.flatten, Tensor.unflatten, Tensor.contiguous, Tensor.float, Tensor.to,
    Tensor.type_as, Tensor.__getitem__, Tensor.transpose, torch.transpose, Tensor.permute,
    torch.permute, Tensor.squeeze, torch.squeeze, Tensor.unsqueeze, torch.unsqueeze,
    Tensor.narrow, torch.narrow, Tensor.select, Tensor.movedim, torch.movedim, Tensor.t,
    Tensor.mT})


class TailRouting:
    """What a routed handler reads of a session: the root's settings, and the statistics of
    the forward whose output this is (``capture_report`` then names the loss too)."""

    __slots__ = ("qconfig", "stats")

    def __init__(self, qconfig: LayerQConfig, stats: CaptureStats) -> None:
        self.qconfig, self.stats = qconfig, stats

    def relu_slot(self, x: Tensor) -> None:
        return None


class CapturedOutput(Tensor):
    """A converted root's floating output (see the module docstring). ``_az_tail`` holds the
    :class:`TailRouting` of the forward that made it."""

    _az_tail: TailRouting

    @classmethod
    def __torch_function__(cls, func: Callable, types: Tuple, args: Tuple = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _ROUTED and torch.is_grad_enabled():
            routing = _routing(args, kwargs)
            plain_args = tuple(plain(a) for a in args)
            plain_kwargs = {k: plain(v) for k, v in kwargs.items()}
            return HANDLERS[func](routing, func, plain_args, plain_kwargs)
        # torch's own handling on the objects themselves, subclass dispatch off: hooks,
        # retain_grad and in-place ops act on this tensor; results come back plain
        out = Tensor.__torch_function__(func, (Tensor,), args, kwargs)
        if func in _KEEP and type(out) is Tensor:
            return _wrap(out, _routing(args, kwargs))
        return out

    def __reduce_ex__(self, proto: Any) -> Any:  # pickling / torch.save: a plain tensor
        return plain(self).__reduce_ex__(proto)


def _routing(args: Tuple, kwargs: Dict[str, Any]) -> TailRouting:
    for a in (*args, *kwargs.values()):
        if isinstance(a, CapturedOutput):
            return a._az_tail
    raise AssertionError("no CapturedOutput among the arguments")  # pragma: no cover


def plain(x: Any) -> Any:
    """``x`` as a plain tensor when it is a :class:`CapturedOutput` (an alias of the same
    memory, attached to the same graph), else ``x``."""
    return x.as_subclass(Tensor) if isinstance(x, CapturedOutput) else x


def _wrap(t: Tensor, routing: TailRouting) -> CapturedOutput:
    w = t.as_subclass(CapturedOutput)
    w._az_tail = routing
    return w


def _wrappable(x: Any) -> bool:
    return (type(x) is Tensor and x.requires_grad and x.is_floating_point()
            and x.layout == torch.strided and x.dim() >= 1)


def wrap_outputs(output: Any, routing: TailRouting) -> Any:
    """``output`` with its floating tensors that require grad as :class:`CapturedOutput`: a
    tensor, or one level into a tuple, list or mapping (Hugging Face's ``ModelOutput`` is
    updated in place, which also updates its attributes). Anything else is returned as is."""
    if _wrappable(output):
        return _wrap(output, routing)
    if isinstance(output, dict):  # ModelOutput: an OrderedDict whose items mirror attributes
        for k, v in list(output.items()):
            if _wrappable(v):
                output[k] = _wrap(v, routing)
        return output
    if type(output) in (tuple, list):
        items = [_wrap(v, routing) if _wrappable(v) else v for v in output]
        return type(output)(items)
    return output


def plain_inputs(args: Tuple) -> Optional[Tuple]:
    """A converted root's positional inputs with :class:`CapturedOutput` made plain (one
    model's output feeding another: the session's tiers must see an ordinary tensor); None
    when every input is plain already (what a forward pre-hook returns to change nothing:
    no identity test of the tuple, which dynamo 2.6 traced as a comparison of its tensors and
    refused as data-dependent control flow)."""
    if not any(isinstance(a, CapturedOutput) for a in args):
        return None
    return tuple(plain(a) for a in args)
