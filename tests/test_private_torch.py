"""Private torch internals: every use sits in ``actnn_zoo/_torch_private.py``.

A leading-underscore torch attribute can change or vanish in any torch release without
notice; where torch has a public equivalent the package uses it, and the few without one are
wrapped in that single module, so a torch upgrade has one file to check. The scan below walks
the package's syntax trees and fails on any private torch name elsewhere: an attribute
``x._name`` where ``_name`` is a private attribute of ``torch.Tensor``, ``nn.Module`` or any
``torch.nn`` layer class (and not a name actnn_zoo defines itself), a string naming one
(``"_parameters"``), and any ``torch._*`` / ``torch.x._y`` module path, attribute or import.

Also here: the public replacements' behaviour equals torch's (BatchNorm's input-rank check,
ConvTranspose's ``output_size``).
"""
from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import List, Set

import pytest
import torch
from torch import nn

import actnn_zoo
import actnn_zoo.nn as qnn
from actnn_zoo.config import LayerQConfig

PACKAGE = Path(actnn_zoo.__file__).resolve().parent
ALLOWED = PACKAGE / "_torch_private.py"
TORCH_ROOTS = {"torch", "nn", "F", "dist"}  # how the package names torch's modules


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def torch_private_names() -> Set[str]:
    classes = [torch.Tensor, nn.Parameter, torch.autograd.Function,
               torch.autograd.function.FunctionCtx]
    classes += [c for c in vars(nn).values() if inspect.isclass(c) and issubclass(c, nn.Module)]
    names = {n for c in classes for n in dir(c) if _private(n)}
    return names | {n for n in vars(nn.Module()) if _private(n)}  # _parameters, _*hooks, ...


def _trees() -> List[tuple]:
    return [(p, ast.parse(p.read_text(), str(p))) for p in sorted(PACKAGE.rglob("*.py"))]


def own_names(trees) -> Set[str]:
    """Private names actnn_zoo defines (methods, attributes it assigns): its own, not torch's."""
    names = set()
    for _, tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return {n for n in names if _private(n)}


def _root(node: ast.AST) -> str:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else ""


def find_private_torch_uses(trees, private: Set[str]) -> List[str]:
    found = []
    for path, tree in trees:
        if path == ALLOWED:
            continue
        rel = path.relative_to(PACKAGE.parent)
        for node in ast.walk(tree):
            where = f"{rel}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Attribute) and _private(node.attr):
                if node.attr in private or _root(node) in TORCH_ROOTS:
                    found.append(f"{where}: .{node.attr}")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                if node.value in private:
                    found.append(f"{where}: {node.value!r}")
            elif isinstance(node, ast.ImportFrom) and node.module:
                parts = node.module.split(".")
                if parts[0] == "torch" and any(_private(p) for p in parts):
                    found.append(f"{where}: from {node.module} import")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    parts = alias.name.split(".")
                    if parts[0] == "torch" and any(_private(p) for p in parts):
                        found.append(f"{where}: import {alias.name}")
    return found


def test_private_torch_attributes_only_in_one_module():
    trees = _trees()
    assert ALLOWED.exists()
    private = torch_private_names() - own_names(trees)
    assert {"_version", "_base", "_parameters", "_check_input_dim"} <= private
    assert find_private_torch_uses(trees, private) == []


def test_the_scan_finds_what_it_should():
    sample = ("import torch\nfrom torch._dynamo import x\nimport torch._C\n"
              "def f(m, t):\n    m._check_input_dim(t)\n    v = t._version\n"
              "    d = m.__dict__['_forward_hooks']\n    return torch.nn._reduction\n")
    path = PACKAGE / "sample.py"
    found = find_private_torch_uses([(path, ast.parse(sample))], torch_private_names())
    assert len(found) == 6, found


# ------------------------------------------------------------ the public replacements
@pytest.mark.parametrize("q_cls,ok,bad", [
    (qnn.QBatchNorm1d, [(4, 3), (4, 3, 5)], [(4,), (4, 3, 5, 5)]),
    (qnn.QBatchNorm2d, [(4, 3, 5, 5)], [(4, 3), (4, 3, 5), (4, 3, 5, 5, 5)]),
    (qnn.QBatchNorm3d, [(4, 3, 5, 5, 5)], [(4, 3, 5, 5)]),
    (qnn.QSyncBatchNorm, [(4, 3), (4, 3, 5, 5)], [(4,)]),
])
def test_batchnorm_input_rank_check_matches_torch(q_cls, ok, bad):
    ref = q_cls._FLOAT_MODULE(3)
    q = q_cls(3, qconfig=LayerQConfig(bits=8))
    for shape in ok:
        torch.testing.assert_close(q(torch.randn(shape)).shape, ref(torch.randn(shape)).shape)
    for shape in bad:
        with pytest.raises(ValueError) as want:
            ref(torch.randn(shape))
        with pytest.raises(ValueError) as got:
            q(torch.randn(shape))
        assert str(got.value) == str(want.value)


def test_sync_batchnorm_zero_channels_raises_like_torch():
    ref, q = nn.SyncBatchNorm(0), qnn.QSyncBatchNorm(0)
    with pytest.raises(ValueError) as want:
        ref(torch.randn(4, 0, 3))
    with pytest.raises(ValueError) as got:
        q(torch.randn(4, 0, 3))
    assert str(got.value) == str(want.value)


@pytest.mark.parametrize("dims", [1, 2, 3])
def test_conv_transpose_output_size_matches_torch(dims):
    torch.manual_seed(0)
    cls = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}[dims]
    q_cls = {1: qnn.QConvTranspose1d, 2: qnn.QConvTranspose2d, 3: qnn.QConvTranspose3d}[dims]
    ref = cls(2, 3, 3, stride=3, padding=1, dilation=1)
    q = q_cls.from_float(ref, LayerQConfig(bits=8))
    x = torch.randn((2, 2) + (4,) * dims)
    # (4-1)*3 - 2 + 3 = 10 ... 12 are reachable: every output_padding 0..2
    for size in (10, 11, 12):
        for out_size in ([size] * dims, [2, 3] + [size] * dims):
            want = ref(x, output_size=out_size)
            got = q(x, output_size=out_size)
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for bad in ([9] * dims, [13] * dims, [10] * (dims + 1)):
        with pytest.raises(ValueError):
            ref(x, output_size=bad)
        with pytest.raises(ValueError):
            q(x, output_size=bad)
