"""Every use of a private (leading-underscore) torch attribute in actnn_zoo, in one place.

torch 2.13 has no public equivalent for these; each may change in a torch release, so a torch
upgrade has this one file to check (tests/test_private_torch.py fails on a private torch name
anywhere else in the package). What has a public equivalent uses it instead: BatchNorm's
input-rank check and ConvTranspose's ``output_size`` are computed in the layers from public
attributes, QConv's padding widths come from ``padding`` / ``kernel_size`` / ``dilation``.
"""
from __future__ import annotations

import functools
import sys
from typing import Any, Callable, Optional, Tuple

import torch
import torch.utils.checkpoint
from torch import Tensor, nn

# The base class of a mode that sees every operator dispatched below autograd (torch's own
# FlopCounterMode and selective checkpointing subclass it); only actnn_zoo.bench.offcpu, which
# counts a step's operators, uses it.
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402,F401

# nn.Module keeps its parameters, buffers, submodules and the set of non-persistent buffer
# names in these containers; a Q-layer made from a torch layer needs its own copy of each
# (same objects inside) so that later additions to one module do not appear on the other.
_CONTAINERS = ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set")


def tensor_version(t: Tensor) -> int:
    """Autograd's in-place write counter of ``t`` (``Tensor._version``): the only way to tell
    that memory seen earlier in a forward was modified since (torch uses it to raise on
    saved tensors modified in place)."""
    return t._version


def tensor_base(t: Tensor) -> Optional[Tensor]:
    """The tensor whose memory view ``t`` shares (``Tensor._base``), None for a non-view:
    keeping it alive keeps the memory of ``t`` valid."""
    return t._base


def _is_hook_dict(key: str, value: object) -> bool:
    """torch keeps hooks in ``_*hooks*`` dicts (forward, pre, backward, state_dict, ...)."""
    return key.startswith("_") and "hooks" in key and isinstance(value, dict)


def clone_module_state(src: nn.Module, dst: nn.Module, skip: tuple = ()) -> None:
    """Give ``dst`` every attribute of ``src`` except ``skip``, sharing Parameters, buffers and
    submodules (torch has no public API that moves a module's whole state, hooks included,
    onto an object of another class).

    The parameter/buffer/module containers are copied so that later additions to one module do
    not appear on the other; the objects in them are shared, so state_dict keys and values, an
    optimizer built earlier and pretrained weights all stay valid.

    Hook dicts are copied too (new dicts holding the same hook entries, as
    ``torch.ao.quantization`` does): hooks registered before conversion keep firing on the
    Q-layer, but a hook registered on one module afterwards never fires on the other, and a
    hook on the Q-layer never receives the original torch layer (which has no ``quantizing``,
    ``qconfig``, ...). The price: a handle returned *before* conversion removes its hook from
    the original layer only; remove it from the converted layer with a new registration's
    handle, or register hooks after conversion.
    """
    state = vars(dst)
    for key, value in vars(src).items():
        if key in skip:
            continue
        copy = ((key in _CONTAINERS and isinstance(value, (dict, set)))
                or _is_hook_dict(key, value))
        state[key] = value.copy() if copy else value  # type: ignore[union-attr]


def saved_by_checkpoint(hook_files: Tuple[str, ...]) -> bool:
    """Whether the tensor a saved-tensor pack hook is packing now is one of the inputs torch's
    non-reentrant ``torch.utils.checkpoint`` saves for its segment (``_CheckpointFrame.
    save_inputs``), from which its recomputation runs: compressed, the recomputation would run
    from other values than the forward did (measured: 7% error in a conv bias gradient at 8
    bits).

    torch 2.13 saves them from Python through an internal helper of its own: no
    autograd Function, no torch call before the save that the capture mode could see, so the
    public signal tier 3 uses for custom Functions (their forward runs under no_grad; that is
    how a re-entrant checkpoint's inputs, torch's or another library's, are kept exact) does not
    apply. The one frame above the hook's own (those of ``hook_files``) does: it is
    torch/utils/checkpoint.py's when the checkpoint is saving, model code otherwise."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename in hook_files:
        frame = frame.f_back
    return frame is not None and frame.f_code.co_filename == _CHECKPOINT_FILE


def _checkpoint_frame_within(frame, depth: Optional[int]) -> bool:
    """Whether ``frame`` or one of the frames above it (at most ``depth`` in all; None: the
    whole stack) belongs to torch/utils/checkpoint.py."""
    while frame is not None and depth != 0:
        if frame.f_code.co_filename == _CHECKPOINT_FILE:
            return True
        frame = frame.f_back
        depth = None if depth is None else depth - 1
    return False


_CHECKPOINT_FILE = torch.utils.checkpoint.__file__


def inside_checkpoint() -> bool:
    """Whether the calling code runs inside the forward of a ``torch.utils.checkpoint``
    segment (a frame of torch/utils/checkpoint.py is on the Python stack; same reason as
    :func:`saved_by_checkpoint`). What such a segment saves is dropped and saved again by its
    recomputation, outside any capture session: a ReLU outside the segment must not share a
    payload made inside it (the forward and the recomputation would save different tensors)."""
    return _checkpoint_frame_within(sys._getframe(1), None)


@functools.lru_cache(maxsize=None)
def _hook_context_reader() -> Optional[Callable[[], Any]]:
    """torch's ``_get_saved_tensor_hook_context`` ("may change without backward
    compatibility"), or None where this torch has none; imported at the first need, not with
    the package (it loads AOTAutograd)."""
    try:
        from torch._functorch._aot_autograd.graph_compile import (
            _get_saved_tensor_hook_context)
    except ImportError:
        return None
    return _get_saved_tensor_hook_context


def _compiled_saved_node():
    """The forward-graph node whose value :func:`actnn_zoo.compile`'s pack hook is packing,
    None outside such a hook or where torch does not say (:func:`_hook_context_reader`)."""
    reader = _hook_context_reader()
    state = reader() if reader is not None else None
    node = state.get("_node", state.get("node")) if isinstance(state, dict) else None
    return node if getattr(node, "op", None) == "call_function" else None


def compiled_saved_hooks_supported() -> bool:
    """Whether this torch's AOTAutograd puts saved-tensor hooks into the compiled graph and
    tells them which node they pack: 2.11 and 2.13 do; 2.6 does not (its dynamo breaks the
    graph at the hooks, which then keep every tensor)."""
    return _hook_context_reader() is not None


def tracing_compiled_saves() -> bool:
    """Whether AOTAutograd is tracing a saved-tensor pack hook into a compiled graph. torch
    2.13 says so through ``torch.compiler.is_compiling()``; torch 2.11 answers False there (so
    :func:`actnn_zoo.compile` kept every save raw: a CNN held 3.9x the eager model's bytes)
    while it does give the hook the node being packed."""
    return torch.compiler.is_compiling() or _compiled_saved_node() is not None


def compiled_saved_output_index() -> Optional[int]:
    """Which output of its producing op the value being packed is (0 for a single-output op,
    ``k`` for ``getitem(op, k)``); None outside the hook or where torch does not say. Why it
    matters: the secondary outputs of multi-output ops are statistics (a norm's mean and
    inverse deviation, attention's log-sum-exp) that a backward reads exactly; only the
    primary output is an activation to compress."""
    node = _compiled_saved_node()
    if node is None:
        return None
    import operator

    if node.target is operator.getitem and isinstance(node.args[1], int):
        return node.args[1]
    return 0


def compiled_saved_input_cast() -> bool:
    """Whether the value being packed is a dtype cast of a graph input (through views only):
    under autocast, the bfloat16/float16 copy of a weight a matmul saves for the input
    gradient (or of the model's input). A weight is a weight even when cast: rounding the copy
    to 2 bits would make the input gradient inexact (cosine 0.8 with a raw Parameter). False
    outside the hook or where torch does not say."""
    node = _compiled_saved_node()
    if node is None:
        return False
    node = _through_views(node)
    casts = (torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype,
             torch.ops.prims.convert_element_type.default)
    if getattr(node, "op", None) != "call_function" or node.target not in casts:
        return False
    source = node.args[0] if node.args else None
    return getattr(_through_views(source), "op", None) == "placeholder"


def _through_views(node: Any) -> Any:
    """The first node up a chain of view ops (t, transpose, permute, view, expand, ...)."""
    while getattr(node, "op", None) == "call_function" and node.args \
            and getattr(node.target, "is_view", False):
        node = node.args[0]
    return node


def compiled_saved_from_float_input() -> Optional[bool]:
    """Whether the value being packed is computed from some floating-point graph input (a
    parameter, a float input); None outside the hook. False means it is made of indices and
    constants only -- an additive attention mask of zeros and ``finfo.min`` -- whose values a
    quantizer cannot keep (0 must stay exactly 0) and which costs what the model's own mask
    costs anyway."""
    node = _compiled_saved_node()
    if node is None:
        return None
    seen = {node}
    todo = [node]
    while todo:
        n = todo.pop()
        if n.op == "placeholder":
            val = n.meta.get("val")
            if isinstance(val, torch.Tensor) and val.dtype.is_floating_point:
                return True
            continue
        for m in n.all_input_nodes:
            if m not in seen:
                seen.add(m)
                todo.append(m)
    return False
