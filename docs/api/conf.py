"""Sphinx configuration of the API reference (``sphinx-build -W -b html docs/api <out>``).

Only the API reference is built here, from the docstrings (autodoc); the guides stay Markdown
(README.md, docs/design.md, docs/results.md). ``tests/test_docs.py`` builds it with warnings as
errors, so a broken docstring fails the suite.
"""
import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, ROOT)

project = "actnn_zoo"
author = "actnn_zoo authors"
copyright = "actnn_zoo authors"
extensions = ["sphinx.ext.autodoc"]
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_inherit_docstrings = False  # a Q-layer shows its own docstring, not torch's
add_module_names = False
html_theme = "alabaster"
html_static_path = []
exclude_patterns = ["_build"]
