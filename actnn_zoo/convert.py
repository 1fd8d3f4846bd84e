"""The float -> Q mapping, convert_model, restore_model, register_mapping.

Design (docs/design.md, rules 1-2):

* No global registry. The default mapping is derived, at call time, from the Q classes that
  :mod:`actnn_zoo.nn` exports (every ``QModule`` subclass with a ``_FLOAT_MODULE``).
  :func:`register_mapping` is a pure function returning a NEW mapping, which the caller passes
  to ``convert_model(..., mapping=...)``: a registration only affects the conversions that are
  given it, and never a model converted earlier or elsewhere in the process.
* Conversion swaps modules in place through their parent (``setattr``) and builds each Q-layer
  with ``Q.from_float(module, layer_qconfig)``, which shares the Parameter and buffer objects
  and copies the hook dicts (the hooks carry over; the replaced layer stays a working torch
  layer): state_dict, optimizers built earlier, device, dtype and train/eval mode carry
  over. A module object reachable under several names becomes one Q-layer.
* Beyond exact types (tier 1 of "compress everything a model saves", docs/design.md):
  a subclass of a mapped class converts like its base when it does not override ``forward``
  (``type(m).forward is Base.forward``: torch's ``NonDynamicallyQuantizableLinear``); one that
  does is left to capture (tiers 2-3) and the report says so. Classes of other libraries
  convert through :data:`actnn_zoo.nn.third_party.THIRD_PARTY`, keyed by dotted class path,
  so transformers / timm are never imported here. The Q-layer records the class it came from
  and ``to_float`` gives that class back.
* Re-conversion is declarative: ``convert_model(model, cfg)`` leaves the model as a fresh
  conversion with ``cfg`` would, whatever was done to it before. A Q-layer that ``cfg`` still
  quantizes keeps its object (hooks, identity) and gets the new ``qconfig`` (its per-sample
  widths are cleared; a precision strategy sets them again); one that ``cfg`` skips or
  disables goes back to its torch class.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Type, Union

from torch import nn

from . import nn as qnn
from .config import TOP_KEYS, ConfigLike, QuantConfig, _unknown_key, as_config, default_config
from .capture import attach_capture, detach_capture
from .nn._base import QModule, same_forward
from .nn.third_party import THIRD_PARTY, ThirdPartyRule, dotted_name, find_rule
from .precision import PRECISION_ATTR, PrecisionStrategy, TrackedLayer, build_strategy

__all__ = ["convert_model", "restore_model", "register_mapping", "default_mapping",
           "conversion_report", "precision_strategy", "ConversionReport", "ConvertedLayer",
           "SkippedLayer", "UnmatchedRule"]

QMapping = Mapping[Union[Type[nn.Module], str],
                   Union[Type[nn.Module], ThirdPartyRule, None]]
REPORT_ATTR = "actnn_zoo_report"


# ----------------------------------------------------------------------------- mapping
def _is_q_class(obj: object) -> bool:
    return (isinstance(obj, type) and issubclass(obj, QModule) and issubclass(obj, nn.Module)
            and isinstance(getattr(obj, "_FLOAT_MODULE", None), type))


def default_mapping() -> Dict[Type[nn.Module], Type[nn.Module]]:
    """torch class -> Q class for every Q-layer :mod:`actnn_zoo.nn` exports right now.

    A fresh dict on every call (the caller may change it freely). When two exported classes
    replace the same torch class, the one named ``'Q' + torch name`` wins, else the first by
    name, so the result does not depend on import order.
    """
    found: Dict[Type[nn.Module], List[type]] = {}
    for obj in vars(qnn).values():
        if _is_q_class(obj) and obj not in found.get(obj._FLOAT_MODULE, []):
            found.setdefault(obj._FLOAT_MODULE, []).append(obj)
    out = {}
    for float_cls, candidates in found.items():
        candidates.sort(key=lambda c: (c.__name__ != "Q" + float_cls.__name__, c.__name__))
        out[float_cls] = candidates[0]
    return out


def _check_pair(float_cls: object, q_cls: object) -> None:
    if isinstance(float_cls, str):  # a dotted class path: a third-party rule or an opt-out
        if "." not in float_cls or (q_cls is not None and not isinstance(q_cls, ThirdPartyRule)):
            raise TypeError(f"mapping keys must be nn.Module classes, or dotted class paths "
                            f"('package.module.Class') mapped to an actnn_zoo.nn.third_party."
                            f"ThirdPartyRule or None; got {float_cls!r} -> {q_cls!r}")
        return
    if not (isinstance(float_cls, type) and issubclass(float_cls, nn.Module)):
        raise TypeError(f"mapping keys must be nn.Module classes or dotted class paths, "
                        f"got {float_cls!r}")
    if q_cls is None:
        return
    if not _is_q_class(q_cls):
        raise TypeError(f"{float_cls.__name__} is mapped to {q_cls!r}, which is not a QModule "
                        f"nn.Module class with a _FLOAT_MODULE")
    if q_cls._FLOAT_MODULE is not float_cls:  # type: ignore[union-attr]
        raise ValueError(f"{q_cls.__name__}._FLOAT_MODULE is "  # type: ignore[union-attr]
                         f"{q_cls._FLOAT_MODULE.__name__}, "  # type: ignore[union-attr]
                         f"so it cannot replace {float_cls.__name__}")


def register_mapping(float_cls: Union[Type[nn.Module], str],
                     q_cls: Union[Type[nn.Module], ThirdPartyRule, None],
                     mapping: Optional[QMapping] = None) -> Dict[Any, Any]:
    """A new mapping: ``mapping`` (default: :func:`default_mapping`) plus ``float_cls -> q_cls``.

    Nothing global changes: pass the result to ``convert_model(model, mapping=...)``. Models
    converted before, or without it, are not affected. ``q_cls=None`` opts ``float_cls`` out
    of conversion. ``q_cls._FLOAT_MODULE`` must be ``float_cls`` (``from_float`` checks it).
    ``float_cls`` may also be a dotted class path (``"transformers.pytorch_utils.Conv1D"``)
    mapped to a :class:`~actnn_zoo.nn.third_party.ThirdPartyRule` or to None (opt out of a
    :data:`~actnn_zoo.nn.third_party.THIRD_PARTY` rule).
    """
    _check_pair(float_cls, q_cls)
    out: Dict[Any, Any] = dict(
        default_mapping() if mapping is None else mapping)
    out[float_cls] = q_cls
    return out


def _effective_mapping(mapping: Optional[QMapping]
                       ) -> Tuple[Dict[type, Optional[type]], Dict[str, Optional[ThirdPartyRule]]]:
    """(torch class -> Q class, dotted path -> third-party rule), defaults plus ``mapping``."""
    table: Dict[type, Optional[type]] = dict(default_mapping())
    paths: Dict[str, Optional[ThirdPartyRule]] = dict(THIRD_PARTY)
    if mapping is not None:
        if not isinstance(mapping, Mapping):
            raise TypeError(f"mapping must be a dict of torch class -> Q class, "
                            f"got {type(mapping).__name__}")
        for float_cls, q_cls in mapping.items():
            _check_pair(float_cls, q_cls)
            if isinstance(float_cls, str):
                paths[float_cls] = q_cls  # type: ignore[assignment]
            else:
                table[float_cls] = q_cls  # type: ignore[assignment]
    return table, paths


Builder = Callable[[nn.Module, Any], nn.Module]


@dataclass(frozen=True)
class _Target:
    """What a module class converts to: the Q class and how to build it (None: no Q-layer,
    with ``reason`` saying why when the class is known)."""

    q_cls: Optional[type]
    build: Optional[Builder] = None
    reason: str = "no Q layer for this type"
    known: bool = False  # a mapped class (or a subclass of one): always reported when skipped


def _target_of(cls: type, mod: nn.Module, table: Dict[type, Optional[type]],
               paths: Dict[str, Optional[ThirdPartyRule]]) -> _Target:
    """The conversion for ``mod`` of class ``cls``: its own entry (type, then dotted path),
    else the first base in its MRO with an entry, which applies only when ``cls`` keeps that
    base's forward. A third-party rule whose check refuses ``mod`` gives no Q-layer."""
    own = _own_target(cls, mod, table, paths)
    if own is not None:
        return own
    for base in cls.__mro__[1:]:
        if base is nn.Module or base is object:
            break
        found = _own_target(base, mod, table, paths)
        if found is None:
            continue
        if found.q_cls is None or same_forward(cls, base):
            return found
        return _Target(None, reason=f"subclass of {base.__name__} that overrides forward: "
                                    f"not converted (left to capture tiers 2-3)", known=True)
    return _Target(None)


def _own_target(cls: type, mod: nn.Module, table: Dict[type, Optional[type]],
                paths: Dict[str, Optional[ThirdPartyRule]]) -> Optional[_Target]:
    """``cls``'s own entry (None: it has none) for ``mod`` (an instance of ``cls`` or of a
    subclass, or a Q-layer converted from one: it keeps the original's attributes)."""
    if cls in table:
        q = table[cls]
        if q is None:
            return _Target(None, reason="no Q layer for this type (opted out by the mapping)",
                           known=True)
        return _Target(q, lambda mod, lc: q.from_float(mod, lc))  # type: ignore[union-attr]
    rule, why = find_rule(cls, paths)
    if rule is None:
        return None if why is None else _Target(None, reason=why, known=True)
    refused = rule.check(mod)
    if refused is not None:
        return _Target(None, reason=f"{dotted_name(cls)}: {refused}; not converted", known=True)
    return _Target(rule.q_cls, rule.build, known=True)


# ----------------------------------------------------------------------------- report
@dataclass(frozen=True)
class ConvertedLayer:
    name: str
    from_type: str
    to_type: str
    bits: int
    group_size: int
    rounding: str


@dataclass(frozen=True)
class SkippedLayer:
    name: str
    type: str
    reason: str


@dataclass(frozen=True)
class UnmatchedRule:
    index: int
    rule: str


@dataclass
class ConversionReport:
    """What :func:`convert_model` did: plain strings and numbers, no module references.

    ``skipped`` lists leaf modules without a Q-layer (they keep saving full tensors) and any
    module with a Q-layer that a rule or ``enabled: false`` kept as it was.
    """

    converted: List[ConvertedLayer] = field(default_factory=list)
    skipped: List[SkippedLayer] = field(default_factory=list)
    unmatched_rules: List[UnmatchedRule] = field(default_factory=list)
    config: Optional[QuantConfig] = None

    def __str__(self) -> str:
        out = [f"actnn_zoo conversion: {len(self.converted)} converted, {len(self.skipped)} "
               f"skipped, {len(self.unmatched_rules)} unmatched rule(s)"]
        if self.converted:
            out.append("converted:")
            out += _table(("name", "from", "to", "bits", "group"),
                          [(c.name or "<root>", c.from_type, c.to_type, str(c.bits),
                            str(c.group_size)) for c in self.converted])
        if self.skipped:
            out.append("skipped:")
            out += _table(("name", "type", "reason"),
                          [(s.name or "<root>", s.type, s.reason) for s in self.skipped])
        if self.unmatched_rules:
            out.append("unmatched rules:")
            out += [f"  rules[{u.index}] {u.rule}" for u in self.unmatched_rules]
        return "\n".join(out)


def _table(header: Tuple[str, ...], rows: List[Tuple[str, ...]]) -> List[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
            for r in [header, *rows]]


def conversion_report(model: nn.Module) -> ConversionReport:
    """The report of the last :func:`convert_model` on ``model`` (``model.actnn_zoo_report``).

    Which modules became Q-layers (and at what width), which were left alone and why, and
    which config rules matched nothing: the first thing to read when a model saves more than
    expected. ``print(az.conversion_report(model))`` prints it as tables."""
    report = getattr(model, REPORT_ATTR, None)
    if not isinstance(report, ConversionReport):
        raise ValueError("this model was not converted by actnn_zoo.convert_model")
    return report


# ----------------------------------------------------------------------------- swapping
def _swap(root: nn.Module, decide: Callable[[str, nn.Module], Optional[nn.Module]]
          ) -> nn.Module:
    """Replace modules as ``decide(first_name, module)`` says (None = keep); returns the root.

    Each distinct module object is decided once (under the first name named_modules gives
    it), then every slot holding it, in every parent, is pointed at the replacement. Parents
    are looked up through the replacements, so a replaced parent gets replaced children.
    """
    paths = list(root.named_modules(remove_duplicate=False))
    new: Dict[int, nn.Module] = {}
    decided = set()
    for name, mod in paths:
        if id(mod) in decided:
            continue
        decided.add(id(mod))
        repl = decide(name, mod)
        if repl is not None and repl is not mod:
            new[id(mod)] = repl
    if not new:
        return root
    by_path = dict(paths)
    for name, mod in paths:
        if not name or id(mod) not in new:
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = by_path[parent_name]
        setattr(new.get(id(parent), parent), attr, new[id(mod)])
    return new.get(id(root), root)


def _float_type(mod: nn.Module) -> type:
    """The class a module converts from: its own, or for a Q-layer the class it replaced."""
    return mod.float_class() if isinstance(mod, QModule) else type(mod)  # type: ignore


def convert_model(model: nn.Module, config: ConfigLike = None, *,
                  mapping: Optional[QMapping] = None, **overrides: Any) -> nn.Module:
    """Swap every layer with a Q-layer for it, in place; returns the (possibly new) root.

    The converted model trains as before but keeps what its training forward saves for
    backward compressed (2 bits per value on average by default), so a step needs less
    memory; eval and ``no_grad`` forwards run the plain torch ops. Example::

        model = az.convert_model(model)                  # the default: a 2-bit average
        model = az.convert_model(model, "4bit")          # a shipped config, by name
        model = az.convert_model(model, strategy="gact", bits=3)

    ``config``: None (defaults: ``strategy: actnn``, 2 bits on average; for a model with
    attention 3.375 bits, attention's tensors, the norms and the head at 4, see
    :func:`actnn_zoo.config.default_config`), the name of a config
    shipped with the package (``"4bit"``; :func:`actnn_zoo.config.shipped_configs`), a YAML
    path, a dict or a :class:`QuantConfig`; ``overrides`` (``bits=4``, ...) apply on top.
    ``mapping`` adds to or overrides the default torch -> Q class mapping (see :func:`register_mapping`; a
    value None opts a class out).
    Matching is by exact type, then dotted class path (third-party classes), then the first
    mapped base class, which applies only to a subclass that keeps the base's ``forward``;
    other modules are left alone (the report says why for mapped ones). Q-layers already in the model are
    re-configured, swapped or restored so the result equals a fresh conversion (module doc).
    The root itself is converted when it has a Q-layer; use the returned object.
    A :class:`ConversionReport` is stored as ``model.actnn_zoo_report`` (see
    :func:`conversion_report`); rules that match no module raise a UserWarning. The config's
    bit-allocation strategy is attached as ``model.actnn_zoo_precision`` (see
    :func:`precision_strategy`; any earlier one is detached first).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert_model expects an nn.Module, got {type(model).__name__}")
    for key in overrides:
        if key not in TOP_KEYS:
            raise TypeError(f"convert_model() got an {_unknown_key(key, TOP_KEYS, 'override')}")
    # no config: the default for this kind of model (a larger budget for attention models,
    # config.default_config); a config or a budget the user gives is used as given
    cfg = (default_config(model, **overrides) if config is None
           else as_config(config, **overrides))
    table, paths = _effective_mapping(mapping)
    report = ConversionReport(config=cfg)
    _detach_precision(model)
    detach_capture(model)

    def decide(name: str, mod: nn.Module) -> Optional[nn.Module]:
        float_cls = _float_type(mod)
        is_q = isinstance(mod, QModule)
        found = _target_of(float_cls, mod, table, paths)
        if found.q_cls is None and is_q and not found.known:
            # An existing Q-layer of a class the mapping does not know stays of its class.
            found = _Target(type(mod), lambda m, lc: type(m).from_float(m, lc), known=True)
        if found.q_cls is None:
            why = found.reason
            if is_q:  # opted out by the mapping (or no longer convertible): back to torch
                report.skipped.append(SkippedLayer(name, float_cls.__name__,
                                                   why + "; restored to torch"))
                return mod.to_float()  # type: ignore[union-attr]
            if found.known or not any(True for _ in mod.children()):
                report.skipped.append(SkippedLayer(name, type(mod).__name__, why))
            return None
        target = found.q_cls
        # Rules are matched against the original class (a type rule naming LlamaRMSNorm).
        probe = mod.to_float() if is_q and mod.float_source is not None else mod  # type: ignore
        lc, reason = cfg.explain(name, probe)
        if lc is None:
            reason = (reason or "skipped") + ("; restored to torch" if is_q else "")
            report.skipped.append(SkippedLayer(name, float_cls.__name__, reason))
            return mod.to_float() if is_q else None  # type: ignore[union-attr]
        report.converted.append(ConvertedLayer(name, type(mod).__name__, target.__name__,
                                               lc.bits, lc.group_size, lc.rounding))
        if is_q and type(mod) is target:
            mod.qconfig = lc
            mod.sample_bits = None
            return mod
        source = mod.to_float() if is_q else mod  # type: ignore[union-attr]
        return found.build(source, lc)  # type: ignore[misc]

    all_pairs = list(model.named_modules(remove_duplicate=False))
    new_root = _swap(model, decide)
    unmatched = cfg.unmatched_rules(all_pairs)
    report.unmatched_rules = [UnmatchedRule(i, cfg.rules[i].describe()) for i in unmatched]
    if unmatched:
        listed = "; ".join(f"rules[{u.index}] {u.rule}" for u in report.unmatched_rules)
        warnings.warn(f"actnn_zoo.convert_model: {len(unmatched)} config rule(s) matched no "
                      f"module in the model: {listed}", UserWarning, stacklevel=2)
    setattr(new_root, REPORT_ATTR, report)
    _attach_precision(new_root, cfg)
    if not isinstance(new_root, QModule):  # a lone Q-layer saves nothing else to capture
        attach_capture(new_root, cfg)
    return new_root


def _attach_precision(root: nn.Module, cfg: QuantConfig) -> None:
    """Build ``cfg.strategy`` over the Q-layers of ``root`` and keep it on the root."""
    layers = [TrackedLayer(name, mod, cfg.pinned_bits(name, mod))  # type: ignore[arg-type]
              for name, mod in root.named_modules() if isinstance(mod, QModule)]
    strategy = build_strategy(cfg)
    strategy.attach(root, layers)
    setattr(root, PRECISION_ATTR, strategy)


def _detach_precision(model: nn.Module) -> None:
    """Remove the strategy a previous conversion attached (hooks, per-sample widths)."""
    strategy = vars(model).get(PRECISION_ATTR)
    if isinstance(strategy, PrecisionStrategy):
        strategy.detach()
    if PRECISION_ATTR in vars(model):
        delattr(model, PRECISION_ATTR)


def precision_strategy(model: nn.Module) -> PrecisionStrategy:
    """The bit-allocation strategy :func:`convert_model` attached to ``model``.

    It chooses the Q-layers' widths from the gradients every ``update_interval`` steps (the
    config's ``strategy``, ``actnn`` by default); get it to inspect what it chose, or call its
    ``detach()`` to stop re-allocating (each layer then uses its configured width)."""
    strategy = vars(model).get(PRECISION_ATTR)
    if not isinstance(strategy, PrecisionStrategy):
        raise ValueError("this model was not converted by actnn_zoo.convert_model")
    return strategy


def restore_model(model: nn.Module) -> nn.Module:
    """Undo :func:`convert_model`: every Q-layer back to its torch class, in place.

    For exporting, serving or evaluating the plain model after compressed training.
    Parameters and buffers are shared, so the state_dict is unchanged. Returns the root
    (a new object when the root itself was a Q-layer).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"restore_model expects an nn.Module, got {type(model).__name__}")

    def decide(name: str, mod: nn.Module) -> Optional[nn.Module]:
        return mod.to_float() if isinstance(mod, QModule) else None

    _detach_precision(model)
    detach_capture(model)
    root = _swap(model, decide)
    for m in {id(model): model, id(root): root}.values():
        if REPORT_ATTR in vars(m):
            delattr(m, REPORT_ATTR)
        if PRECISION_ATTR in vars(m):
            delattr(m, PRECISION_ATTR)
    return root
