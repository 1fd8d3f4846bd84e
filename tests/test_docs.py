"""The API reference (docs/api, Sphinx autodoc): it documents every public name, every public
name has a docstring of its own, and it builds with warnings as errors, quickly."""
from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import actnn_zoo

ROOT = Path(__file__).resolve().parents[1]
API = ROOT / "docs" / "api"


def _own_doc(obj: object) -> str:
    """The object's own docstring: a class does not count its base's (``QConv2d`` would
    otherwise show ``nn.Conv2d``'s or a private mixin's)."""
    doc = vars(obj).get("__doc__") if isinstance(obj, type) else getattr(obj, "__doc__", None)
    return (doc or "").strip()


def test_every_public_name_has_a_docstring_of_its_own():
    short = {name: _own_doc(getattr(actnn_zoo, name)) for name in actnn_zoo.__all__}
    short = {name: doc for name, doc in short.items() if len(doc) < 30}
    assert not short, f"public names without a real docstring: {short}"


def test_the_reference_documents_exactly_the_public_names():
    text = (API / "index.rst").read_text()
    documented = re.findall(r"^\.\. auto(?:class|function):: (\w+)\s*$", text, re.M)
    assert len(documented) == len(set(documented)), "a name is documented twice"
    assert set(documented) == set(actnn_zoo.__all__)
    for dotted in re.findall(r"^\.\. auto(?:class|function):: ([\w.]+\.\w+)\s*$", text, re.M):
        module, _, name = dotted.rpartition(".")
        assert getattr(__import__(module, fromlist=[name]), name)  # no stale extra entries


def test_sphinx_builds_the_reference_with_warnings_as_errors(tmp_path):
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-b", "html",
                           "-q", str(API), str(tmp_path / "html")],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    seconds = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr[-4000:]
    page = (tmp_path / "html" / "index.html").read_text()
    for name in ("convert_model", "QuantConfig", "from_name", "QConv2d", "capturing"):
        assert name in page
    assert seconds < 60, f"the API reference took {seconds:.0f} s to build"
