"""Configuration: the per-layer settings a Q-module carries (``module.qconfig``) and the
model-wide :class:`QuantConfig` (YAML/dict loading, validation, per-layer rule resolution).

Everything here is immutable: a ``QuantConfig`` is a value, resolved once per module by the
converter into a :class:`LayerQConfig` that the module owns. Nothing is registered globally.
"""
from __future__ import annotations

import difflib
import fnmatch
import io
import os
import re
import sys
from dataclasses import asdict, dataclass, field, fields, replace
from types import MappingProxyType
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from .quant.api import ROUNDING, SUPPORTED_BITS, check_bits, check_group_size
from .quant.hadamard import TRANSFORMS, check_transform, check_transform_group
from .quant.division import COMPRESSORS, DEFAULT_BLOCK, check_block, check_compressor

__all__ = ["LayerQConfig", "QuantConfig", "Rule", "STRATEGIES", "DEFAULT_STRATEGY", "as_config",
           "shipped_configs", "default_config", "has_attention", "TRANSFORMER_BITS"]


# Backward of conv/linear/batch-norm/smooth-activation layers decodes a large saved input in
# this many pieces of samples (functional/_saving.sample_chunks): a lower step peak (CNN 2.0x ->
# 2.5x below fp32's) for more kernel calls (on 2 CPU threads the CNN step went 1.42x -> 2.25x
# fp32's), so it is opt-in: 1 decodes whole.
DEFAULT_BACKWARD_CHUNKS = 1


def _check_chunks(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"backward_chunks must be an integer >= 1 (1: decode whole), "
                         f"got {value!r}")
    return value


@dataclass(frozen=True)
class LayerQConfig:
    """What one Q-module does with the tensors it saves for backward.

    Immutable and owned by the module: two converted models never share mutable settings.
    ``bits`` is the width used when no per-sample widths were set by a precision strategy.
    ``transform`` ('none' or 'hadamard') is applied per group before quantizing
    (:mod:`actnn_zoo.quant.hadamard`).
    ``compressor``: 'quant' (per-group quantization) or 'division' (DIVISION's dual precision
    for tensors of 3 to 5 dims, the plain quantizer for the others; ``actnn_zoo.quant.division``)
    with low-part blocks of ``division_block`` values per dim.
    ``relu_codes`` (ReLU only): read the backward from the mask of the consumer's sparse codes
    instead of saving a mask, where the consumer compresses the output (``ZeroCodeSlot``).
    """

    bits: int = 2
    group_size: int = 256
    rounding: str = "stochastic"
    enabled: bool = True
    backward_chunks: int = DEFAULT_BACKWARD_CHUNKS
    transform: str = "none"
    compressor: str = "quant"
    division_block: int = DEFAULT_BLOCK
    relu_codes: bool = True

    def __post_init__(self) -> None:
        check_bits(self.bits, "bits")
        check_group_size(self.group_size, "group_size")
        _check_chunks(self.backward_chunks)
        if self.rounding not in ROUNDING:
            raise ValueError(f"rounding must be one of {ROUNDING}, got {self.rounding!r}")
        if not isinstance(self.enabled, bool):
            raise ValueError(f"enabled must be a bool, got {self.enabled!r}")
        if not isinstance(self.relu_codes, bool):
            raise ValueError(f"relu_codes must be a bool, got {self.relu_codes!r}")
        check_transform(self.transform, "transform")
        check_transform_group(self.transform, self.group_size)
        check_compressor(self.compressor)
        check_block(self.division_block)

    def replace(self, **changes) -> "LayerQConfig":
        return replace(self, **changes)

    def to_dict(self) -> dict:
        """The settings; ``transform``, ``compressor`` and ``division_block`` only when not
        the defaults (so configs written before they existed read the same)."""
        out = asdict(self)
        for key, default in (("transform", "none"), ("compressor", "quant"),
                             ("division_block", DEFAULT_BLOCK), ("relu_codes", True)):
            if out[key] == default:
                del out[key]
        return out


# Bit-allocation strategies a QuantConfig may name (implemented in actnn_zoo.precision, whose
# STRATEGY_CLASSES has the same names). 'uniform' gives every layer the same width; the others
# read ``bits`` as an average budget in [BUDGET_MIN, BUDGET_MAX] rather than one width.
# 'actnn' (auto precision: per-layer and per-sample widths from gradients) is the default;
# 'gact' chooses one width per saved tensor from probed gradient-variance sensitivities under
# the same budget; 'acgc' chooses widths from an error bound (``error_fraction``), ``bits`` only
# being its starting width, and reports the average it reaches.
STRATEGIES: Tuple[str, ...] = ("uniform", "actnn", "gact", "acgc")
DEFAULT_STRATEGY = "actnn"
BUDGET_MIN, BUDGET_MAX = 1, 8
GROUP_MULTIPLE = 32  # group sizes a config may ask for (the kernels accept multiples of 8)
# 'acgc': the gradient error allowed, as a fraction of the gradient's norm squared
DEFAULT_ERROR_FRACTION = 0.1
ERROR_FRACTION_MAX = 1e6

TOP_KEYS = ("bits", "group_size", "strategy", "rounding", "enabled", "update_interval", "capture",
            "capture_bits", "error_fraction", "transform", "backward_chunks", "compressor",
            "division_block", "relu_codes", "rules")
# keys to_dict writes only when they differ from their default (a strategy-specific setting
# does not clutter every other config's dict / YAML)
_OPTIONAL_KEYS = MappingProxyType({"error_fraction": DEFAULT_ERROR_FRACTION,
                                   "capture_bits": None, "transform": "none",
                                   "backward_chunks": DEFAULT_BACKWARD_CHUNKS,
                                   "compressor": "quant", "division_block": DEFAULT_BLOCK,
                                   "relu_codes": True})
MATCHER_KEYS = ("type", "name", "pattern")
ACTION_KEYS = ("bits", "group_size", "rounding", "transform", "skip", "compressor")
RULE_KEYS = MATCHER_KEYS + ACTION_KEYS

_TYPE_SPEC = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*\Z")
_Path = Tuple[Union[str, int], ...]


# ----------------------------------------------------------------------------- error context
class _Where:
    """Where a config came from (file name, YAML line of each key), for error messages."""

    def __init__(self, source: Optional[str] = None,
                 lines: Optional[Dict[_Path, int]] = None) -> None:
        self.source = source
        self.lines = lines or {}

    def error(self, path: _Path, message: str) -> ValueError:
        head = f"config {self.source!r}" if self.source else "QuantConfig"
        line = None
        for k in range(len(path), 0, -1):  # the innermost path element with a known line
            line = self.lines.get(path[:k])
            if line is not None:
                break
        if line is not None and self.source:
            head += f", line {line}"
        elif line is not None:
            head += f" (line {line})"
        where = _path_str(path)
        return ValueError(f"{head}: {where + ': ' if where else ''}{message}")


def _path_str(path: _Path) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def _unknown_key(key: object, known: Sequence[str], noun: str = "key") -> str:
    """The 'unknown key' message, with difflib's closest known key as a suggestion."""
    close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown {noun} {key!r}{hint}; known {noun}s: {', '.join(known)}"


# ----------------------------------------------------------------------------- field checks
def _check_layer_bits(value: object) -> int:
    """A per-layer width: 1, 2, 4 or 8 (an integral float such as 4.0 is accepted)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return check_bits(value, "bits")


def _check_budget(strategy: str, value: object) -> Union[int, float]:
    """``bits`` of the whole config: one width for 'uniform', an average budget otherwise."""
    if strategy == "uniform":
        try:
            return _check_layer_bits(value)
        except ValueError:
            raise ValueError(f"bits must be one of {SUPPORTED_BITS} for strategy 'uniform', "
                             f"got {value!r}") from None
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not BUDGET_MIN <= value <= BUDGET_MAX):
        raise ValueError(f"bits (the average budget) must be a number in "
                         f"[{BUDGET_MIN}, {BUDGET_MAX}], got {value!r}")
    return int(value) if float(value).is_integer() else float(value)


def _check_group(value: object) -> int:
    if (isinstance(value, bool) or not isinstance(value, int) or value <= 0
            or value % GROUP_MULTIPLE):
        raise ValueError(f"group_size must be a positive multiple of {GROUP_MULTIPLE}, "
                         f"got {value!r}")
    return value


def _check_rounding(value: object) -> str:
    if value not in ROUNDING:
        raise ValueError(f"rounding must be one of {ROUNDING}, got {value!r}")
    return value  # type: ignore[return-value]


def _check_bool(value: object, key: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{key} must be true or false, got {value!r}")
    return value


def _check_strategy(value: object) -> str:
    if value not in STRATEGIES:
        raise ValueError(f"unknown strategy {value!r}; known strategies: {', '.join(STRATEGIES)}")
    return value  # type: ignore[return-value]


def _check_interval(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"update_interval must be an integer >= 1, got {value!r}")
    return value


def _check_capture_bits(value: object) -> Optional[int]:
    """The capture tiers' width: one of the supported widths, or None for the layers' width."""
    return None if value is None else check_bits(value, "capture_bits")


def _check_error_fraction(value: object) -> float:
    """'acgc''s e: the squared gradient error allowed, as a fraction of ||g||^2 (e > 0)."""
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not 0.0 < float(value) <= ERROR_FRACTION_MAX or value != value):
        raise ValueError(f"error_fraction must be a number in (0, {ERROR_FRACTION_MAX:g}], "
                         f"got {value!r}")
    return float(value)


def _check_matcher(key: str, value: object) -> Tuple[str, ...]:
    """A matcher value: one string or a non-empty list of strings (any of them may match)."""
    items = (value,) if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not items or not all(
            isinstance(v, str) for v in items):
        raise ValueError(f"{key} must be a string or a non-empty list of strings, got {value!r}")
    for v in items:
        if key == "type" and not _TYPE_SPEC.match(v):
            raise ValueError(f"type {v!r} is not a class name ('Conv2d') or a dotted path "
                             f"('torch.nn.Conv2d')")
        if key == "pattern" and v.startswith("re:"):
            try:
                re.compile(v[3:])
            except re.error as e:
                raise ValueError(f"pattern {v!r} is not a valid regular expression: {e}") from None
    return tuple(items)


# ----------------------------------------------------------------------------- matching
def _type_matches(spec: str, cls: type) -> bool:
    """'Conv2d' matches the class name; 'torch.nn.Conv2d' a public alias or the defining path.

    Dotted paths are looked up only in already-imported modules: a config never imports code.
    """
    if "." not in spec:
        return spec == cls.__name__
    mod_name, _, attr = spec.rpartition(".")
    mod = sys.modules.get(mod_name)
    if mod is not None and getattr(mod, attr, None) is cls:
        return True
    return spec == f"{cls.__module__}.{cls.__qualname__}"


def _pattern_matches(pattern: str, name: str) -> bool:
    """'re:<regex>' must match the whole name; anything else is a glob ('*' crosses dots)."""
    if pattern.startswith("re:"):
        return re.fullmatch(pattern[3:], name) is not None
    return fnmatch.fnmatchcase(name, pattern)


def _module_classes(module: object) -> Tuple[type, ...]:
    """The classes a ``type`` rule is tested against: the module's own and, for a Q-layer,
    the torch class it replaces (so a rule for 'Conv2d' still applies on re-conversion)."""
    cls = type(module)
    float_cls = getattr(cls, "_FLOAT_MODULE", None)
    return (cls,) if float_cls is None or float_cls is cls else (cls, float_cls)


@dataclass(frozen=True)
class Rule:
    """One rule of a QuantConfig: exactly one matcher, at least one action.

    Matchers: ``type`` (torch class name or dotted path), ``name`` (exact module name) or
    ``pattern`` (glob, or ``re:`` + regex, on the module name); each takes a string or a list
    (any element may match). Actions: ``bits``, ``group_size``, ``rounding``, ``transform``,
    ``skip``; a rule
    changes only the fields it sets, so ``skip: false`` in a stronger rule un-skips.
    """

    type: Tuple[str, ...] = ()
    name: Tuple[str, ...] = ()
    pattern: Tuple[str, ...] = ()
    bits: Optional[int] = None
    group_size: Optional[int] = None
    rounding: Optional[str] = None
    transform: Optional[str] = None
    skip: Optional[bool] = None
    compressor: Optional[str] = None

    def __post_init__(self) -> None:
        _check_rule_values(self, _Where(), ())

    @property
    def kind(self) -> str:
        """'type', 'pattern' or 'name': the matcher, which sets the rule's precedence."""
        return next(k for k in MATCHER_KEYS if getattr(self, k))

    @property
    def targets(self) -> Tuple[str, ...]:
        return getattr(self, self.kind)

    def matches(self, module_name: str, module: object) -> bool:
        if self.type:
            classes = _module_classes(module)
            return any(_type_matches(s, c) for s in self.type for c in classes)
        if self.name:
            return module_name in self.name
        return any(_pattern_matches(p, module_name) for p in self.pattern)

    def describe(self) -> str:
        """Short human form, e.g. ``pattern 'layer1.*'``."""
        t = self.targets
        return f"{self.kind} {t[0]!r}" if len(t) == 1 else f"{self.kind} {list(t)!r}"

    def to_dict(self) -> Dict[str, Any]:
        t = self.targets
        out: Dict[str, Any] = {self.kind: t[0] if len(t) == 1 else list(t)}
        for k in ACTION_KEYS:
            v = getattr(self, k)
            if v is not None:
                out[k] = v
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Rule":
        return _rule_from_dict(d, _Where(), ())


def _validate_rule(rule: Rule, where: _Where, path: _Path) -> None:
    """A rule has exactly one matcher and at least one action."""
    given = [k for k in MATCHER_KEYS if getattr(rule, k)]
    if not given:
        raise where.error(path, f"a rule needs one matcher ({', '.join(MATCHER_KEYS)})")
    if len(given) > 1:
        raise where.error(path, f"a rule takes exactly one matcher, got {' and '.join(given)} "
                                f"(write one rule per matcher)")
    if all(getattr(rule, k) is None for k in ACTION_KEYS):
        raise where.error(path, f"rule for {rule.describe()} has no action "
                                f"(set one of {', '.join(ACTION_KEYS)})")


_RULE_CHECKS = MappingProxyType({
    "bits": _check_layer_bits,
    "group_size": _check_group,
    "rounding": _check_rounding,
    "transform": check_transform,
    "skip": lambda v: _check_bool(v, "skip"),
    "compressor": check_compressor,
})


def _check_rule_values(rule: Rule, where: _Where, path: _Path) -> None:
    """Validate (and normalise in place) every field of a Rule, then its shape."""
    for key in RULE_KEYS:
        value = getattr(rule, key)
        if key in MATCHER_KEYS and value in ((), None):
            object.__setattr__(rule, key, ())
            continue
        if key in ACTION_KEYS and value is None:
            continue
        try:
            value = _check_matcher(key, value) if key in MATCHER_KEYS else _RULE_CHECKS[key](value)
        except ValueError as e:
            raise where.error(path + (key,), str(e)) from None
        object.__setattr__(rule, key, value)
    _validate_rule(rule, where, path)


def _rule_from_dict(d: object, where: _Where, path: _Path) -> Rule:
    if isinstance(d, Rule):
        return d
    if not isinstance(d, Mapping):
        raise where.error(path, f"a rule must be a mapping, got {type(d).__name__}")
    for key in d:
        if key not in RULE_KEYS:
            raise where.error(path + (str(key),), _unknown_key(key, RULE_KEYS))
    rule = Rule.__new__(Rule)  # checked with the file context first; Rule() would lose it
    for f in fields(Rule):
        object.__setattr__(rule, f.name, d.get(f.name, f.default))
    _check_rule_values(rule, where, path)
    return rule


# ----------------------------------------------------------------------------- QuantConfig
@dataclass(frozen=True)
class QuantConfig:
    """How a whole model is quantized: global settings plus ordered per-module rules.

    Precedence (as torch.ao's QConfigMapping): global < ``type`` rules < ``pattern`` rules <
    ``name`` rules; among rules of one kind the later wins. Rules merge field by field.
    ``bits`` is one width (1, 2, 4, 8) for strategy 'uniform' and an average budget in [1, 8]
    for the strategies that allocate widths per layer/sample (the default, 'actnn': 2 bits on
    average). ``update_interval`` (default 10) is how often (in steps) such strategies
    re-allocate across layers (``actnn``: the per-sample widths within a layer still follow every
    batch; at 10 instead of 1 the text and digits results are unchanged and the CNN step is up
    to a tenth of fp32's step shorter at batch 128, docs/results.md). A rule's ``bits`` pins
    the layers it matches to that width under any strategy.
    ``error_fraction`` (strategy 'acgc' only, default 0.1) is the squared gradient error each
    layer's compression may cause, as a fraction of the squared gradient norm; the average
    width is then an outcome (``bits`` is only the width before the first statistics).
    ``enabled: false`` converts nothing. ``capture`` (default true) also compresses what the
    converted model's training forward saves outside the Q-layers: functional calls and any
    other saved tensor (:mod:`actnn_zoo.capture`); ``capture_bits`` (default: the width of
    ``bits``) is the width tiers 2-3 use, so that a model can keep its Q-layers at 2 bits and
    compress what the capture tiers see (attention operands, products) with more.
    ``backward_chunks`` (default 1, off): conv, linear, batch-norm and smooth-activation backward
    decode a saved input of at least 1 MiB this many samples-chunks at a time, so the step's
    peak holds a chunk of it rather than all of it, at the cost of more, smaller kernel calls.
    ``transform`` ('none', the default, or 'hadamard'; also a rule action) rotates each group
    of what the Q-layers save with a randomized Walsh-Hadamard transform before quantizing
    (needs a power-of-two ``group_size``; the capture tiers do not rotate).
    ``compressor`` (default 'quant'; also a rule action) 'division' stores tensors of 3 to 5
    dims -- (N, C, L), (N, C, H, W), (N, C, D, H, W) -- as DIVISION does: the mean over blocks
    of ``division_block`` (default 8) values per spatial dim in bfloat16 plus the residual at
    the layer's width (:mod:`actnn_zoo.quant.division`); other tensors keep the quantizer.
    ``relu_codes`` (default true): on the CPU a ReLU whose output the next layer compresses
    saves no mask; that layer stores the output as sparse codes (a 1-bit mask of its nonzeros
    plus codes of the nonzeros only, :func:`actnn_zoo.quant.quantize_sparse`) and ReLU's
    backward reads their mask (docs/design.md, "ReLU reads its consumer's codes"). The
    ResNet-style CNN's saved activations then compress 15.5x instead of 13.3x at the 2-bit
    default with the same weight-gradient error (0.99x the masks'). False: every ReLU keeps its
    own mask. On CUDA ReLUs keep masks either way (no sparse kernels there yet).
    """

    bits: Union[int, float] = 2
    group_size: int = 256
    strategy: str = DEFAULT_STRATEGY
    rounding: str = "stochastic"
    enabled: bool = True
    update_interval: int = 10
    capture: bool = True
    capture_bits: Optional[int] = None
    error_fraction: float = DEFAULT_ERROR_FRACTION
    backward_chunks: int = DEFAULT_BACKWARD_CHUNKS
    transform: str = "none"
    compressor: str = "quant"
    division_block: int = DEFAULT_BLOCK
    relu_codes: bool = True
    rules: Tuple[Rule, ...] = ()
    source: Optional[str] = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        values = _validate_top({f.name: getattr(self, f.name) for f in fields(self)
                                if f.name != "source"}, _Where(self.source))
        for key, value in values.items():
            object.__setattr__(self, key, value)

    # -- loading / saving
    @classmethod
    def from_dict(cls, d: Optional[Mapping[str, Any]], source: Optional[str] = None
                  ) -> "QuantConfig":
        """Build from a plain dict (as read from YAML); missing keys take the defaults."""
        return cls._from_dict(d, _Where(source))

    @classmethod
    def _from_dict(cls, d: Optional[Mapping[str, Any]], where: _Where) -> "QuantConfig":
        if d is None:
            d = {}
        if not isinstance(d, Mapping):
            raise where.error((), f"the config must be a mapping of keys to values, "
                                  f"got {type(d).__name__}")
        for key in d:
            if key not in TOP_KEYS:
                raise where.error((str(key),), _unknown_key(key, TOP_KEYS))
        values = _validate_top(dict(d), where)
        return cls(**values, source=where.source)

    def to_dict(self) -> Dict[str, Any]:
        """Plain dict of every setting (defaults included); ``from_dict`` reads it back."""
        out = {k: getattr(self, k) for k in TOP_KEYS if k != "rules"
               and not (k in _OPTIONAL_KEYS and getattr(self, k) == _OPTIONAL_KEYS[k])}
        out["rules"] = [r.to_dict() for r in self.rules]
        return out

    @classmethod
    def from_yaml(cls, path_or_stream: Union[str, "os.PathLike[str]", io.IOBase, Any]
                  ) -> "QuantConfig":
        """Load a YAML file (path) or stream; errors name the file, key and line."""
        if isinstance(path_or_stream, (str, os.PathLike)):
            source = os.fspath(path_or_stream)
            with open(source, encoding="utf-8") as f:
                text = f.read()
        else:
            text = path_or_stream.read()
            source = getattr(path_or_stream, "name", None) or "<stream>"
            if isinstance(text, bytes):
                text = text.decode("utf-8")
        return cls._from_text(text, source)

    @classmethod
    def from_name(cls, name: str) -> "QuantConfig":
        """A config shipped with the package, by name (``"4bit"``; see :func:`shipped_configs`).

        The shipped YAML files install with the package (``actnn_zoo/configs/``), so a name
        works in any environment, while a path such as ``"configs/4bit.yaml"`` exists only in
        a clone. An unknown name raises ``ValueError`` listing the shipped names.

        >>> QuantConfig.from_name("4bit").bits
        4
        """
        names = shipped_configs()
        if not isinstance(name, str) or name not in names:
            close = difflib.get_close_matches(str(name), names, n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"unknown config name {name!r}{hint}; shipped configs: "
                             f"{', '.join(names)} (or give a YAML path, a dict or a "
                             f"QuantConfig)")
        resource = _configs_dir() / f"{name}{_SHIPPED_SUFFIX}"
        return cls._from_text(resource.read_text(encoding="utf-8"),
                              f"actnn_zoo/configs/{name}{_SHIPPED_SUFFIX}")

    @classmethod
    def _from_text(cls, text: str, source: str) -> "QuantConfig":
        """Parse YAML text; ``source`` names the file in error messages."""
        import yaml

        try:
            data = yaml.safe_load(text)
            lines = _yaml_key_lines(yaml.compose(text, Loader=yaml.SafeLoader), source)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
            at = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(e, "problem", None) or str(e)
            raise ValueError(f"config {source!r}{at}: malformed YAML: {problem}") from None
        return cls._from_dict(data, _Where(source, lines))

    def to_yaml(self, path: Union[str, "os.PathLike[str]", None] = None) -> str:
        """The YAML text of :meth:`to_dict`; also written to ``path`` when given."""
        import yaml

        text = yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None)
        if path is not None:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        return text

    def replace(self, **changes: Any) -> "QuantConfig":
        """A copy with some settings changed (validated); unknown names are a TypeError."""
        for key in changes:
            if key not in TOP_KEYS:
                raise TypeError(_unknown_key(key, TOP_KEYS, "setting"))
        values = {k: getattr(self, k) for k in TOP_KEYS}
        values.update(changes)
        return QuantConfig(**values)

    # -- resolution
    def layer_bits(self) -> int:
        """The width a layer gets before any rule: ``bits`` for 'uniform'; for budget
        strategies the largest supported width within the budget (the strategy refines it)."""
        return max(b for b in SUPPORTED_BITS if b <= self.bits)

    def explain(self, module_name: str, module: object
                ) -> Tuple[Optional[LayerQConfig], Optional[str]]:
        """(settings, None) for a module to quantize, or (None, why) for one to leave alone."""
        if not self.enabled:
            return None, "disabled"
        bits, group, rounding = self.layer_bits(), self.group_size, self.rounding
        transform = self.transform
        compressor = self.compressor
        skip, skip_by = False, None
        for kind in ("type", "pattern", "name"):  # weakest first; later rules override
            for index, rule in enumerate(self.rules):
                if rule.kind != kind or not rule.matches(module_name, module):
                    continue
                bits = rule.bits if rule.bits is not None else bits
                group = rule.group_size if rule.group_size is not None else group
                rounding = rule.rounding if rule.rounding is not None else rounding
                transform = rule.transform if rule.transform is not None else transform
                compressor = rule.compressor if rule.compressor is not None else compressor
                if rule.skip is not None:
                    skip, skip_by = rule.skip, index
        if skip:
            return None, f"skipped by rule {skip_by} ({self.rules[skip_by].describe()})"
        if transform == "hadamard":
            try:
                check_transform_group(transform, group)
            except ValueError as e:
                raise ValueError(f"module {module_name!r}: {e} (transform and group_size come "
                                 f"from the config and its rules)") from None
        return LayerQConfig(bits=bits, group_size=group, rounding=rounding,
                            transform=transform, backward_chunks=self.backward_chunks,
                            compressor=compressor, division_block=self.division_block,
                            relu_codes=self.relu_codes), None

    def pinned_bits(self, module_name: str, module: object) -> Optional[int]:
        """The width a rule fixes for this module (the strongest matching rule with ``bits``),
        or None when no rule sets one and a budget strategy may choose it."""
        bits = None
        for kind in ("type", "pattern", "name"):
            for rule in self.rules:
                if rule.kind == kind and rule.bits is not None and rule.matches(module_name,
                                                                                module):
                    bits = rule.bits
        return bits

    def resolve(self, module_name: str, module: object) -> Optional[LayerQConfig]:
        """The settings for the module at ``module_name``, or None to leave it unconverted."""
        return self.explain(module_name, module)[0]

    def unmatched_rules(self, named_modules: Iterable[Tuple[str, object]]) -> List[int]:
        """Indices of rules that match none of the (name, module) pairs."""
        pending = set(range(len(self.rules)))
        for name, module in named_modules:
            pending -= {i for i in pending if self.rules[i].matches(name, module)}
            if not pending:
                break
        return sorted(pending)


def _validate_top(values: Dict[str, Any], where: _Where) -> Dict[str, Any]:
    """Validate and normalise top-level values (only the keys present)."""
    out = dict(values)
    checks = {
        "group_size": _check_group,
        "strategy": _check_strategy,
        "rounding": _check_rounding,
        "enabled": lambda v: _check_bool(v, "enabled"),
        "capture": lambda v: _check_bool(v, "capture"),
        "relu_codes": lambda v: _check_bool(v, "relu_codes"),
        "capture_bits": _check_capture_bits,
        "update_interval": _check_interval,
        "error_fraction": _check_error_fraction,
        "backward_chunks": _check_chunks,
        "transform": check_transform,
        "compressor": check_compressor,
        "division_block": check_block,
    }
    for key, check in checks.items():
        if key in out:
            try:
                out[key] = check(out[key])
            except ValueError as e:
                raise where.error((key,), str(e)) from None
    if "bits" in out:
        try:
            out["bits"] = _check_budget(out.get("strategy", DEFAULT_STRATEGY), out["bits"])
        except ValueError as e:
            raise where.error(("bits",), str(e)) from None
    if out.get("transform") == "hadamard" and "group_size" in out:
        try:
            check_transform_group("hadamard", out["group_size"])
        except ValueError as e:
            raise where.error(("group_size",), str(e)) from None
    if "rules" in out:
        rules = out["rules"]
        if rules is None:
            rules = ()
        if isinstance(rules, (str, bytes, Mapping)) or not isinstance(rules, Sequence):
            raise where.error(("rules",), f"rules must be a list of rules, got "
                                          f"{type(rules).__name__}")
        out["rules"] = tuple(_rule_from_dict(r, where, ("rules", i)) for i, r in enumerate(rules))
    return out


def _yaml_key_lines(node: Any, source: str) -> Dict[_Path, int]:
    """1-based line of each top-level key, each rule and each rule key; duplicate keys are an
    error (yaml.safe_load would silently keep the last)."""
    import yaml

    lines: Dict[_Path, int] = {}

    def mapping(n: Any, path: _Path) -> None:
        if not isinstance(n, yaml.MappingNode):
            return
        seen = set()
        for k, v in n.value:
            key = k.value if isinstance(k, yaml.ScalarNode) else None
            if key is None:
                continue
            if key in seen:
                raise ValueError(f"config {source!r}, line {k.start_mark.line + 1}: "
                                 f"{_path_str(path + (key,))}: duplicate key {key!r}")
            seen.add(key)
            lines[path + (key,)] = k.start_mark.line + 1
            if path == () and key == "rules" and isinstance(v, yaml.SequenceNode):
                for i, item in enumerate(v.value):
                    lines[("rules", i)] = item.start_mark.line + 1
                    mapping(item, ("rules", i))

    if node is not None:
        mapping(node, ())
    return lines


ConfigLike = Union[None, str, "os.PathLike[str]", Mapping[str, Any], QuantConfig]

# ----------------------------------------------------------------------------- shipped configs
_SHIPPED_SUFFIX = ".yaml"


def _configs_dir() -> Any:
    """The package's ``configs`` folder (a ``Traversable``: also inside a zip or wheel)."""
    from importlib.resources import files

    return files(__package__ or "actnn_zoo") / "configs"


def shipped_configs() -> Tuple[str, ...]:
    """Names of the configs that install with the package, sorted (``"2bit"``, ``"4bit"``, ...).

    Each is ``actnn_zoo/configs/<name>.yaml``; pass the name wherever a config is accepted
    (``convert_model(model, "4bit")``, ``--config 4bit``), or read it with
    :meth:`QuantConfig.from_name`.
    """
    return tuple(sorted(entry.name[:-len(_SHIPPED_SUFFIX)] for entry in _configs_dir().iterdir()
                        if entry.name.endswith(_SHIPPED_SUFFIX) and entry.is_file()))


def is_config_name(text: str) -> bool:
    """Whether a string is read as a shipped config's name rather than a path: it has no
    directory separator and no ``.yaml``/``.yml`` suffix (``"4bit"``, not ``"4bit.yaml"`` or
    ``"configs/4bit.yaml"``). A name never touches the file system, so a stray file called
    ``4bit`` in the working directory cannot shadow the shipped config."""
    seps = {os.sep, "/"} | ({os.altsep} if os.altsep else set())
    return (not any(s in text for s in seps)
            and not text.lower().endswith((".yaml", ".yml")))


def as_config(config: ConfigLike = None, **overrides: Any) -> QuantConfig:
    """Any accepted config form plus keyword overrides.

    ``config`` is None (the default config), a shipped config's name (``"4bit"``, see
    :func:`shipped_configs`), a YAML path (a string with a directory separator or a
    ``.yaml``/``.yml`` suffix, or an ``os.PathLike``), a dict, or a :class:`QuantConfig`.
    """
    if config is None:
        cfg = QuantConfig()
    elif isinstance(config, QuantConfig):
        cfg = config
    elif isinstance(config, str) and is_config_name(config):
        cfg = QuantConfig.from_name(config)
    elif isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"config file {path!r} does not exist; the shipped configs are available by "
                f"name in any environment: {', '.join(shipped_configs())} "
                f"(e.g. convert_model(model, {shipped_configs()[0]!r}))")
        cfg = QuantConfig.from_yaml(path)
    elif isinstance(config, Mapping):
        cfg = QuantConfig.from_dict(config)
    else:
        raise TypeError(f"config must be None, a shipped config's name, a YAML path, a dict "
                        f"or a QuantConfig, got {type(config).__name__}")
    return cfg.replace(**overrides) if overrides else cfg


# ----------------------------------------------------------------------------- model-aware default
# The default for models with attention (issue 31, docs/results.md "A default that fits the
# model", scripts/default_fidelity.py). At the plain 2-bit average the text transformer's
# validation loss ended 3.1% above fp32's after 300 steps and 8.7% after 1000, and moving bits
# between tensor classes inside 2 bits did not help (the head's input or the softmax at 8 bits
# took them from the rest and made it worse: +4.0% / +6.8% at 300 steps). So a transformer
# gets a larger budget, spent first on what the per-class ablation (results/ablation_text.txt)
# found carries most of the gradient error: the output head's input at 8 bits (27.6% of it);
# the softmax outputs, what the capture tiers save (q, k, v, the attention matmuls' operands)
# and the inputs of attention's own linears (qkv, output projection) at 4 (19.5 + 21.2 +
# 21.4%). The actnn strategy spreads what remains over the MLP, the norms and the GELU (about
# 2.5 bits). 1000 steps: +0.83/+1.44/+1.44% (seeds 0/1/2) at 10.5x; without the attention
# linears +1.75% (2 seeds). Then a gradient-error probe per parameter (after 900 fp32 steps;
# Adam scales each parameter by its own gradient, so each one's relative error matters) found
# the norms' weights worst (relative error 0.50-0.71: their inputs were left to the strategy)
# and the head at 8 bits poor value (0.004 of the error for 512 bits a token): norms' inputs
# and the head's at 4, the budget raised to what 10x allows, 3.375 bits: +0.63/+0.85/+1.18% at
# 10.1x. Then the attention probabilities saved once (a dropout's output after softmax is the
# softmax's payload, masked: ``CompressedStore.derive``), their values counted at 0 bits, so
# the same budget buys the other layers more: +0.70/+0.92/+0.92% at 10.2x. The realised
# average over every saved value, capture tier 3 included, stays within the budget
# (``ActNNStrategy`` counts tier 3's values at their width, derived ones at 0). The same holds
# for Hugging Face GPT-2, whose MLP is two ``Conv1D`` layers, and for RMSNorm models, only
# since the strategies have kinds for those classes (docs/design.md, "What a strategy sees").
TRANSFORMER_BITS = 3.375
TRANSFORMER_CAPTURE_BITS = 4
TRANSFORMER_SOFTMAX_BITS = 4
TRANSFORMER_HEAD_BITS = 4
# the inputs of LayerNorm / RMSNorm modules (0: left to the strategy)
TRANSFORMER_NORM_BITS = 4
# the linears inside attention modules (q/k/v and output projections; 0: left to the strategy)
TRANSFORMER_ATTENTION_LINEAR_BITS = 4
# keys of convert_model's overrides that mean "I chose the budget / allocation myself": with
# any of them the plain default applies, never the model-aware one
_USER_ALLOCATION_KEYS = frozenset({"bits", "strategy", "capture_bits", "rules", "enabled"})


def has_attention(model: Any) -> bool:
    """Whether ``model`` (an ``nn.Module``) contains attention: a softmax module, torch's
    ``MultiheadAttention``, or a module whose class name contains 'Attention' (Hugging Face's
    ``GPT2Attention`` / ``LlamaAttention`` / ``BertSelfAttention``, timm's ``Attention``, a
    user's ``CausalSelfAttention``). Q-layers count as the class they replaced."""
    for module in model.modules():
        for cls in _module_classes(module):
            if cls.__name__ == "Softmax" or _is_attention(cls):
                return True
    return False


def _is_attention(cls: type) -> bool:
    return cls.__name__ == "MultiheadAttention" or "attention" in cls.__name__.lower()


def _linear_like(module: Any) -> bool:
    """nn.Linear (or a Q-layer of one) or Hugging Face's ``Conv1D`` (GPT-2's linear)."""
    import torch.nn as tnn

    return any(issubclass(c, tnn.Linear) or c.__name__ == "Conv1D"
               for c in _module_classes(module))


def _attention_linears(model: Any) -> List[str]:
    """Names of the linear layers inside attention modules (the q/k/v and output
    projections), outermost attention module first, each name once."""
    names: List[str] = []
    for prefix, module in model.named_modules():
        if not any(_is_attention(c) for c in _module_classes(module)):
            continue
        for sub, child in module.named_modules():
            name = f"{prefix}.{sub}" if prefix and sub else (prefix or sub)
            if sub and _linear_like(child) and name not in names:
                names.append(name)
    return names


def _norms(model: Any) -> List[str]:
    """Names of the LayerNorm / RMSNorm modules (torch's, Hugging Face's ``LlamaRMSNorm``
    and the like, or Q-layers of them), by class name."""
    return [name for name, module in model.named_modules()
            if name and any(c.__name__.endswith(("LayerNorm", "RMSNorm"))
                            for c in _module_classes(module))]


def _last_linear(model: Any) -> Optional[str]:
    """The name of the last ``nn.Linear`` (or Q-layer of one) registered in ``model``: the
    output head of a language model or classifier (``lm_head``, ``head``,
    ``cls.predictions.decoder``, ``classifier``), found without relying on a naming scheme."""
    import torch.nn as tnn

    last = None
    for name, module in model.named_modules():
        if name and any(issubclass(c, tnn.Linear) for c in _module_classes(module)):
            last = name
    return last


def default_config(model: Any = None, **overrides: Any) -> QuantConfig:
    """The config ``convert_model(model)`` uses when given none.

    Models without attention (CNNs, MLPs): :class:`QuantConfig`'s defaults, the ``actnn``
    strategy at a 2-bit average. Models with attention (:func:`has_attention`): ``actnn`` at a
    ``TRANSFORMER_BITS`` (3.375-bit) average with softmax modules, the linears inside
    attention modules, the norms, the output head (the last Linear) and the capture tiers at
    4 bits; the other layers (the MLPs, activations) share what remains of the budget.
    ``overrides`` apply on top; when they set ``bits``, ``strategy``, ``capture_bits``,
    ``rules`` or ``enabled`` the user has chosen the allocation and the plain defaults apply
    (a budget the user sets is the whole budget, never raised).
    """
    if model is None or _USER_ALLOCATION_KEYS & overrides.keys() or not has_attention(model):
        return QuantConfig().replace(**overrides) if overrides else QuantConfig()
    rules: List[Rule] = []
    if any(c.__name__ == "Softmax" for m in model.modules() for c in _module_classes(m)):
        rules.append(Rule(type=("Softmax",), bits=TRANSFORMER_SOFTMAX_BITS))
    attention = _attention_linears(model) if TRANSFORMER_ATTENTION_LINEAR_BITS else []
    if attention:
        rules.append(Rule(name=tuple(attention), bits=TRANSFORMER_ATTENTION_LINEAR_BITS))
    norms = _norms(model) if TRANSFORMER_NORM_BITS else []
    if norms:
        rules.append(Rule(name=tuple(norms), bits=TRANSFORMER_NORM_BITS))
    head = _last_linear(model)
    if head is not None and head not in attention:
        rules.append(Rule(name=(head,), bits=TRANSFORMER_HEAD_BITS))
    cfg = QuantConfig(bits=TRANSFORMER_BITS, capture_bits=TRANSFORMER_CAPTURE_BITS,
                      rules=tuple(rules))
    return cfg.replace(**overrides) if overrides else cfg
