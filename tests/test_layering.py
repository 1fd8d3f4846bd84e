"""The package's layers point one way: no module imports from a layer above its own.

Why: a lower layer that imports a higher one can no longer be understood, tested or changed
without it, and the cycle that follows has to be closed with lazy imports that hide it (the
session lookup once lived in ``capture/`` while ``functional/`` used it, and ``capture/``
reached back into ``functional/`` inside a function). The checker below reads every module of
``actnn_zoo`` with :mod:`ast` -- every ``import`` and ``from ... import``, relative or absolute,
at module level or inside functions, classes and ``if TYPE_CHECKING:`` blocks, and
``importlib.import_module`` / ``__import__`` calls with a literal ``"actnn_zoo..."`` name -- and
names the importing file, line and target of each import that goes upward.

The layers, lowest first (:data:`LAYERS`); a module belongs to the layer of its top-level name
under ``actnn_zoo`` (``actnn_zoo.capture.store`` is in ``capture``) and may import its own
layer and any layer below:

1. ``_C`` (the compiled extension), ``_torch_private``, ``_compile``: torch-only helpers.
2. ``quant``: the quantizers and their kernels.
3. ``config`` and ``configs``: the settings. ``configs/`` holds the shipped YAML files, data
   that ``config.py`` finds by name (``importlib.resources``); it has no Python module, so it
   is placed with the one module that reads it, and a module added there later would be held
   to the same rule as ``config``.
4. ``_session``: how the zoo's Functions find the open capture session and the ReLU
   claim/offer interface. It sits above ``quant`` rather than among the torch-only helpers
   because a claim that no save answers falls back to a 1-bit mask, packed by
   ``quant.pack_mask``.
5. ``functional``: the autograd Functions.
6. ``capture``: the session and store that implement ``_session``'s interface, and the
   routing of functional calls to ``functional``.
7. ``nn``, 8. ``precision``, 9. ``convert``.
10. ``__init__`` (the root package ``actnn_zoo`` itself): the public facade that re-exports
    names from ``nn``, ``capture``, ``config``, ``convert`` and ``quant``, so it sits above all
    of them; modules above it (``demo``) may import the facade. A subpackage's ``__init__``
    belongs to its subpackage's layer (it re-exports its own modules). That every import
    executes the root ``__init__`` first is Python's mechanics, not a dependency a module
    chooses, so it is not counted.
11. ``memory``: saved-bytes accounting of a model (uses ``capture``).
12. ``models`` and ``data``: example workloads and their data; they import nothing of the
    package, and ``bench`` builds its steps from them, so they sit below ``bench``.
13. ``bench``: the benchmark harness (peak memory, step times, largest batch).
14. ``demo``, 15. ``__main__`` (the command line).

A new top-level module must be given a layer here; the test fails until it is.
"""
from __future__ import annotations

import ast
import textwrap
from pathlib import Path
from typing import Dict, Iterator, List, Mapping, NamedTuple, Optional, Sequence, Set, Tuple

import pytest

import actnn_zoo

PACKAGE = "actnn_zoo"
ROOT = Path(actnn_zoo.__file__).resolve().parent

LAYERS: Tuple[Tuple[str, ...], ...] = (
    ("_C", "_torch_private", "_compile"),
    ("quant",),
    ("config", "configs"),
    ("_session",),
    ("functional",),
    ("capture",),
    ("nn",),
    ("precision",),
    ("convert", "compiled"),
    ("__init__",),
    ("memory",),
    ("models", "data"),
    ("bench",),
    ("demo",),
    ("__main__",),
)

# (importing module, imported module) -> why the upward import stays for now. Empty: every
# upward import was removed. An entry that no longer occurs fails the test (stale).
KNOWN_EXCEPTIONS: Dict[Tuple[str, str], str] = {}

_EXTENSION_SUFFIXES = (".so", ".pyd")
# Compiled extensions of the package, modules whether or not they are built in this checkout
# (without the build, ``from .. import _C`` must still read as importing ``actnn_zoo._C``).
EXTENSIONS = ("_C",)


class Import(NamedTuple):
    """One import of a module of the package: who imports what, and where."""

    path: Path
    line: int
    importer: str
    target: str


def package_modules(root: Path, package: str,
                    extensions: Sequence[str] = ()) -> Dict[str, Optional[Path]]:
    """Every module of the package under ``root``: dotted name -> source file (None for a
    compiled extension, which has no source to read but can be imported). ``extensions``:
    top-level compiled modules to count even when they are not built."""
    out: Dict[str, Optional[Path]] = {f"{package}.{name}": None for name in extensions}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if path.suffix == ".py":
            parts = rel.with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join((package,) + parts)] = path
        elif path.suffix in _EXTENSION_SUFFIXES:
            stem = path.name.split(".")[0]  # _C.cpython-311-x86_64-linux-gnu.so -> _C
            out[".".join((package,) + rel.parent.parts + (stem,))] = None
    return out


def _resolve_relative(importer: str, is_package: bool, level: int, module: Optional[str]) -> str:
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    if level - 1 > len(base) - 1:
        raise ValueError(f"{importer}: relative import beyond the top-level package")
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _import_module_literal(node: ast.Call) -> Optional[str]:
    """``importlib.import_module("x")`` / ``import_module("x")`` / ``__import__("x")``."""
    fn = node.func
    name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
    if name not in ("import_module", "__import__") or not node.args:
        return None
    arg = node.args[0]
    return arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else None


def module_imports(path: Path, importer: str, package: str,
                   modules: Mapping[str, Optional[Path]]) -> Iterator[Import]:
    """The imports of modules of ``package`` that the file ``path`` (module ``importer``) makes,
    wherever they are in the file. ``from X import name`` counts as importing ``X.name`` when
    that is a module, else ``X``."""
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))

    def ours(name: str) -> bool:
        return name == package or name.startswith(package + ".")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if ours(alias.name):
                    yield Import(path, node.lineno, importer, alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                source = _resolve_relative(importer, is_package, node.level, node.module)
            else:
                source = node.module or ""
            if not ours(source):
                continue
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                yield Import(path, node.lineno, importer,
                             sub if alias.name != "*" and sub in modules else source)
        elif isinstance(node, ast.Call):
            name = _import_module_literal(node)
            if name is not None and ours(name):
                yield Import(path, node.lineno, importer, name)


def layer_index(layers: Sequence[Sequence[str]]) -> Dict[str, int]:
    index: Dict[str, int] = {}
    for i, names in enumerate(layers):
        for name in names:
            assert name not in index, f"{name} is in two layers"
            index[name] = i
    return index


def top_name(module: str, package: str) -> str:
    """The name under the package that decides a module's layer (``__init__`` for the root)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def all_imports(root: Path, package: str, extensions: Sequence[str] = ()) -> List[Import]:
    """Every import of a module of the package, once per (file, line, target)."""
    modules = package_modules(root, package, extensions)
    found = [imp for name, path in modules.items() if path is not None
             for imp in module_imports(path, name, package, modules)]
    return list(dict.fromkeys(found))


def violations(root: Path, package: str, layers: Sequence[Sequence[str]],
               exceptions: Mapping[Tuple[str, str], str], extensions: Sequence[str] = ()
               ) -> Tuple[List[str], Set[Tuple[str, str]]]:
    """Messages for every upward import and every module without a layer, and the exceptions
    that were used (so that stale ones can be reported)."""
    index = layer_index(layers)
    problems: List[str] = []
    used: Set[Tuple[str, str]] = set()
    for name in package_modules(root, package, extensions):
        if top_name(name, package) not in index:
            problems.append(f"{name}: no layer; add {top_name(name, package)!r} to LAYERS in "
                            f"tests/test_layering.py")
    for imp in all_imports(root, package, extensions):
        src, dst = top_name(imp.importer, package), top_name(imp.target, package)
        if src not in index or dst not in index or index[dst] <= index[src]:
            continue
        if (imp.importer, imp.target) in exceptions:
            used.add((imp.importer, imp.target))
            continue
        problems.append(f"{imp.path}:{imp.line}: {imp.importer} (layer {src!r}) imports "
                        f"{imp.target} (layer {dst!r}, higher)")
    return problems, used


# -- the package itself --------------------------------------------------------------------------
def test_package_layers_point_one_way() -> None:
    problems, used = violations(ROOT, PACKAGE, LAYERS, KNOWN_EXCEPTIONS, EXTENSIONS)
    assert not problems, "imports against the layer order:\n" + "\n".join(problems)
    stale = set(KNOWN_EXCEPTIONS) - used
    assert not stale, f"known exceptions that no longer occur (remove them): {sorted(stale)}"


def test_checker_sees_the_package_imports() -> None:
    """Guards against a checker that passes because it reads nothing: it must see a top-level
    import, a lazy one inside a function, a ``from .. import module`` and the extension."""
    edges = {(imp.importer, imp.target) for imp in all_imports(ROOT, PACKAGE, EXTENSIONS)}
    for edge in [("actnn_zoo.capture.store", "actnn_zoo.functional._saving"),
                 ("actnn_zoo.capture.handlers", "actnn_zoo.functional.softmax"),  # lazy
                 ("actnn_zoo.capture.attach", "actnn_zoo._session"),  # from .. import _session
                 ("actnn_zoo.functional.activation", "actnn_zoo._session"),
                 ("actnn_zoo.quant.backend", "actnn_zoo._C")]:  # lazy, compiled
        assert edge in edges, f"checker missed {edge}"


# -- the checker can fail: a small synthetic package -------------------------------------------
TOY_LAYERS = (("_low",), ("low",), ("__init__",), ("high",))
TOY_BASE = {
    "__init__.py": "from .low import f\n",
    "_low.py": "import torch\n",
    "low/__init__.py": "from .mod import f\n",
    "low/mod.py": "from .._low import torch\n\ndef f():\n    return 1\n",
    "high.py": "from . import f\nfrom .low import mod\nimport toy._low\n",
}


def _toy(tmp_path: Path, extra: Mapping[str, str]) -> Path:
    root = tmp_path / "toy"
    for rel, text in {**TOY_BASE, **extra}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(text))
    return root


def test_checker_accepts_a_clean_tree(tmp_path: Path) -> None:
    problems, _ = violations(_toy(tmp_path, {}), "toy", TOY_LAYERS, {})
    assert problems == []


@pytest.mark.parametrize("rel, text, line, target", [
    ("low/bad.py", "import os\nfrom ..high import g\n", 2, "toy.high"),  # relative, top level
    ("low/bad.py", "def f():\n    import toy.high\n", 2, "toy.high"),  # absolute, lazy
    ("low/bad.py", "class C:\n    def m(self):\n        from .. import high\n", 3,
     "toy.high"),  # from package import module, in a method
    ("low/bad.py", "from toy import f\n", 1, "toy"),  # a name of the root facade
    ("_low.py", "from .low import mod\n", 1, "toy.low.mod"),
    ("low/bad.py", "import importlib\nM = importlib.import_module('toy.high')\n", 2, "toy.high"),
    ("low/__init__.py", "from .mod import f\nfrom ..high import g\n", 2, "toy.high"),  # __init__
    ("low/bad.py", "from ..high import g, h, k\n", 1, "toy.high"),  # reported once per line
])
def test_checker_names_an_upward_import(tmp_path: Path, rel: str, text: str, line: int,
                                        target: str) -> None:
    root = _toy(tmp_path, {rel: text})
    problems, _ = violations(root, "toy", TOY_LAYERS, {})
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"{root / rel}:{line}: ") and f"imports {target} " in problems[0]


def test_checker_flags_a_module_without_a_layer(tmp_path: Path) -> None:
    problems, _ = violations(_toy(tmp_path, {"stray.py": "x = 1\n"}), "toy", TOY_LAYERS, {})
    assert problems == ["toy.stray: no layer; add 'stray' to LAYERS in tests/test_layering.py"]


def test_known_exception_is_allowed_and_reported_used(tmp_path: Path) -> None:
    root = _toy(tmp_path, {"low/bad.py": "from ..high import g\n"})
    edge = ("toy.low.bad", "toy.high")
    problems, used = violations(root, "toy", TOY_LAYERS, {edge: "why"})
    assert problems == [] and used == {edge}


def test_unbuilt_extension_counts_as_a_module(tmp_path: Path) -> None:
    """``from . import _ext`` names the compiled module even where it is not built here (else
    it would read as importing the root facade, a false upward import from ``_low``)."""
    root = _toy(tmp_path, {"_low.py": "from . import _ext\n"})
    layers = (("_low", "_ext"),) + TOY_LAYERS[1:]
    assert violations(root, "toy", layers, {}, extensions=("_ext",))[0] == []
    assert len(violations(root, "toy", layers, {})[0]) == 1  # without it: the facade, upward
