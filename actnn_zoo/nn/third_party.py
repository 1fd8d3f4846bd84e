"""Mappings for classes of other libraries (Hugging Face transformers, timm, torchvision).

Everything here is keyed by dotted class path (``f"{cls.__module__}.{cls.__qualname__}"``), so
actnn_zoo never imports those libraries: a rule is only looked at for a class a model really
contains. Each :class:`ThirdPartyRule` names the Q class built, a ``check`` that confirms the
instance computes what the Q class reproduces (an attribute that selects another formula, e.g.
``GELUActivation(use_gelu_python=True)``, means "do not convert", with the reason in the
conversion report) and the attributes to set on the Q-layer (the Q class's names for the
original's settings). The Q-layer keeps all of the original's attributes and records its class,
so ``to_float`` / ``restore_model`` give the original class back.

Hugging Face copies LlamaRMSNorm and T5LayerNorm into many model files under other names
(Qwen2RMSNorm, MistralRMSNorm, MT5LayerNorm, ...). :func:`find_rule` accepts such a class when
its ``forward`` has exactly the reference's code (bytecode, names and constants), so a copy
that changes the formula (Gemma's ``1 + weight``) is not matched.
"""
from __future__ import annotations

import functools
import importlib
import sys
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Dict, Mapping, Optional, Tuple, Type

import torch.nn.functional as F
from torch import Tensor, nn

from ..config import LayerQConfig
from ..functional.linear import linear, traced_linear
from ..functional.norm import layer_norm_train
from ._base import QModule
from .activation import QGELU, QMish, QSiLU
from .linear import traced_width, use_function
from .norm import QLayerNorm, _QBatchNorm
from .rmsnorm import QRMSNorm

__all__ = ["ThirdPartyRule", "THIRD_PARTY", "dotted_name", "find_rule", "QHFConv1D",
           "QLayerNorm2d", "QBatchNormAct2d"]


def dotted_name(cls: type) -> str:
    """``module.qualname`` of a class: the key of :data:`THIRD_PARTY`."""
    return f"{cls.__module__}.{cls.__qualname__}"


def _load(path: str) -> Optional[type]:
    """The class at ``path`` when its package is already imported (never imports one)."""
    module, _, name = path.rpartition(".")
    if module.split(".")[0] not in sys.modules:
        return None
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


def _code_key(fn: Any) -> Optional[Tuple[bytes, Tuple[str, ...], Tuple[Any, ...]]]:
    code = getattr(fn, "__code__", None)
    return None if code is None else (code.co_code, code.co_names, code.co_consts)


# ----------------------------------------------------------------------------- Q classes
class _ForeignOnly(QModule):
    """A Q class for third-party classes only: no ``_FLOAT_MODULE`` (so the type mapping does
    not list it); ``from_float`` accepts the classes :data:`THIRD_PARTY` maps to it."""

    @classmethod
    def from_float(cls, mod: nn.Module, qconfig: Optional[LayerQConfig] = None):
        rule, why = find_rule(type(mod))
        if rule is None or rule.q_cls is not cls:
            raise TypeError(f"{cls.__name__}.from_float does not accept {type(mod).__name__}"
                            + (f" ({why})" if why else ""))
        return rule.build(mod, qconfig)


class QHFConv1D(_ForeignOnly, nn.Module):
    """Hugging Face ``transformers.pytorch_utils.Conv1D`` (GPT-2's linear layer, weight stored
    [in, out]: ``y = addmm(b, x, W)``) saving its input compressed, like QLinear: the same
    :func:`~actnn_zoo.functional.linear.linear` with ``W.t()`` (a view, so the
    Parameter, its shape and the state_dict are unchanged). Without it GPT-2's addmm inputs
    are left to capture tier 3."""

    nf: int
    nx: int

    def forward(self, x: Tensor) -> Tensor:
        weight, bias = self.weight, self.bias  # (each read is an nn.Module.__getattr__ call)
        if not use_function(self, x, weight, bias):
            width = traced_width(self, x, weight, bias)
            if width is None:
                return self.plain_forward(None, x)
            return traced_linear(x, weight.t(), bias, *width)
        return linear(x, weight.t(), bias, self.qconfig, self.bits_for(x))

    def extra_repr(self) -> str:
        return f"nf={self.nf}, nx={self.nx}, " + QModule.extra_repr(self)


class QLayerNorm2d(_ForeignOnly, nn.LayerNorm):
    """LayerNorm over the channels of NCHW input (timm / torchvision ``LayerNorm2d``: permute
    to NHWC, layer_norm, permute back) saving its normalized input compressed with exact
    per-position statistics, like QLayerNorm."""

    def forward(self, input: Tensor) -> Tensor:
        if not use_function(self, input, self.weight, self.bias):
            return self.plain_forward(None, input)
        x = input.permute(0, 2, 3, 1)
        x = layer_norm_train(x, self.normalized_shape, self.weight, self.bias, self.eps,
                             self.qconfig, self.bits_for(input))
        return x.permute(0, 3, 1, 2)


class QBatchNormAct2d(_ForeignOnly, _QBatchNorm, nn.BatchNorm2d):
    """timm ``BatchNormAct2d``: QBatchNorm2d's compressed batch norm, then the module's own
    ``drop`` and ``act`` children (which the converter replaces by their Q-layers when it has
    them: a ReLU saves a 1-bit mask, a SiLU its compressed derivative)."""

    _INPUT_RANKS = (4,)

    def forward(self, input: Tensor) -> Tensor:
        if not use_function(self, input, self.weight, self.bias) and self.graph_saves() is None:
            return self.plain_forward(None, input)
        x = _QBatchNorm.forward(self, input)  # its traced form under torch.compile
        return self.act(self.drop(x))


# ----------------------------------------------------------------------------- rules
Check = Callable[[nn.Module], Optional[str]]


def _ok(mod: nn.Module) -> Optional[str]:
    return None


@dataclass(frozen=True)
class ThirdPartyRule:
    """How to convert one third-party class: ``check(mod)`` returns why not (None: fine);
    ``attrs(mod)`` the attributes the Q-layer needs under its own names."""

    q_cls: Type[nn.Module]
    check: Check = _ok
    attrs: Callable[[nn.Module], Dict[str, Any]] = field(default=lambda mod: {})

    def build(self, mod: nn.Module, qconfig: Optional[LayerQConfig]) -> nn.Module:
        why = self.check(mod)
        if why is not None:
            raise TypeError(f"cannot convert {type(mod).__name__}: {why}")
        return self.q_cls._build_from(mod, qconfig, self.attrs(mod))  # type: ignore[attr-defined]


def _check_conv1d(mod: nn.Module) -> Optional[str]:
    w, b = getattr(mod, "weight", None), getattr(mod, "bias", None)
    nf, nx = getattr(mod, "nf", None), getattr(mod, "nx", None)
    if not isinstance(w, nn.Parameter) or tuple(w.shape) != (nx, nf):
        return "weight is not an [nx, nf] Parameter"
    if b is not None and tuple(b.shape) != (nf,):
        return "bias is not an [nf] Parameter"
    return None


def _check_act(expected: Callable[[Any], bool], what: str) -> Check:
    def check(mod: nn.Module) -> Optional[str]:
        return None if expected(getattr(mod, "act", None)) else f"its act is not {what}"
    return check


def _is_gelu_tanh(act: Any) -> bool:
    return (isinstance(act, functools.partial) and act.func is F.gelu and not act.args
            and act.keywords == {"approximate": "tanh"})


def _check_rmsnorm(mod: nn.Module) -> Optional[str]:
    w, eps = getattr(mod, "weight", None), getattr(mod, "variance_epsilon", None)
    if not isinstance(w, nn.Parameter) or w.dim() != 1:
        return "weight is not a 1-d Parameter"
    if not isinstance(eps, (int, float)):
        return "variance_epsilon is not a number"
    if list(mod.parameters(recurse=False)) != [w] or list(mod.buffers(recurse=False)):
        return "it has parameters or buffers besides weight"
    return None


def _rms_attrs(style: str) -> Callable[[nn.Module], Dict[str, Any]]:
    def attrs(mod: nn.Module) -> Dict[str, Any]:
        return {"normalized_shape": (mod.weight.shape[0],), "eps": float(mod.variance_epsilon),
                "elementwise_affine": True, "rms_style": style}
    return attrs


def _check_not_fast_norm(mod: nn.Module) -> Optional[str]:
    return "it uses timm's fast_norm kernels" if getattr(mod, "_fast_norm", False) else None


def _check_bn_act(mod: nn.Module) -> Optional[str]:
    if not (isinstance(getattr(mod, "act", None), nn.Module)
            and isinstance(getattr(mod, "drop", None), nn.Module)):
        return "it has no act / drop submodules"
    return None


_LLAMA_RMS = "transformers.models.llama.modeling_llama.LlamaRMSNorm"
_T5_RMS = "transformers.models.t5.modeling_t5.T5LayerNorm"

#: dotted class path -> rule. Read-only; pass changes to ``convert_model(mapping=...)``.
THIRD_PARTY: Mapping[str, ThirdPartyRule] = MappingProxyType({
    "transformers.pytorch_utils.Conv1D": ThirdPartyRule(QHFConv1D, _check_conv1d),
    "transformers.activations.NewGELUActivation": ThirdPartyRule(
        QGELU, attrs=lambda mod: {"approximate": "tanh"}),
    "transformers.activations.FastGELUActivation": ThirdPartyRule(
        QGELU, attrs=lambda mod: {"approximate": "tanh"}),
    "transformers.activations.GELUTanh": ThirdPartyRule(
        QGELU, _check_act(_is_gelu_tanh, "F.gelu(approximate='tanh')"),
        attrs=lambda mod: {"approximate": "tanh"}),
    "transformers.activations.GELUActivation": ThirdPartyRule(
        QGELU, _check_act(lambda a: a is F.gelu, "F.gelu (use_gelu_python=True)"),
        attrs=lambda mod: {"approximate": "none"}),
    "transformers.activations.SiLUActivation": ThirdPartyRule(
        QSiLU, attrs=lambda mod: {"inplace": False}),
    "transformers.activations.MishActivation": ThirdPartyRule(
        QMish, _check_act(lambda a: a is F.mish, "F.mish"), attrs=lambda mod: {"inplace": False}),
    _LLAMA_RMS: ThirdPartyRule(QRMSNorm, _check_rmsnorm, _rms_attrs("llama")),
    _T5_RMS: ThirdPartyRule(QRMSNorm, _check_rmsnorm, _rms_attrs("t5")),
    "timm.layers.norm.LayerNorm": ThirdPartyRule(QLayerNorm, _check_not_fast_norm),
    "timm.layers.norm.LayerNorm2d": ThirdPartyRule(QLayerNorm2d, _check_not_fast_norm),
    "torchvision.models.convnext.LayerNorm2d": ThirdPartyRule(QLayerNorm2d),
    "timm.layers.norm_act.BatchNormAct2d": ThirdPartyRule(QBatchNormAct2d, _check_bn_act),
})

#: Classes whose copies under other names (same forward code) get the same rule.
_TWIN_REFERENCES = (_LLAMA_RMS, _T5_RMS)


def find_rule(cls: type, table: Mapping[str, Optional[ThirdPartyRule]] = THIRD_PARTY
              ) -> Tuple[Optional[ThirdPartyRule], Optional[str]]:
    """The rule for ``cls`` itself (not its bases; the converter walks those) and, when there
    is none, None plus why (None when nothing is known about the class).

    Looks up the dotted path, then, for transformers classes, a copy of a reference class
    (:data:`_TWIN_REFERENCES`) whose forward code is identical.
    """
    path = dotted_name(cls)
    if path in table:
        rule = table[path]
        return rule, (None if rule is not None else "opted out by the mapping")
    if cls.__module__.split(".")[0] != "transformers":
        return None, None
    key = _code_key(getattr(cls, "forward", None))
    for ref_path in _TWIN_REFERENCES:
        ref = _load(ref_path)
        if ref is not None and ref is not cls and key == _code_key(ref.forward):
            rule = table.get(ref_path)
            return rule, (None if rule is not None else "opted out by the mapping")
    return None, None

