"""The README a new user reads: its Python blocks run as written (each on its own, outside the
clone), its configuration reference lists exactly the schema's keys with their defaults, its
shipped-config table the shipped configs, and every link points at something that exists."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Dict, List

import pytest
import torch
import yaml

from actnn_zoo.config import TOP_KEYS, QuantConfig, shipped_configs

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _blocks(lang: str) -> List[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```$", README, re.S | re.M)


def _section(title: str) -> str:
    """The text of the README's ``## title`` section."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", README, re.S | re.M)
    assert match, f"README has no section '## {title}'"
    return match.group(1)


def _table(text: str, first_header: str) -> List[Dict[str, str]]:
    """The rows of the markdown table whose first header cell is ``first_header``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_header} |"))
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(header, (c.strip() for c in line.strip("|").split("|")))))
    return rows


def _anchors(markdown: str) -> set:
    """Heading ids as GitHub makes them: lower case, punctuation dropped, spaces to hyphens,
    a repeated id numbered (-1, -2, ...)."""
    seen: Dict[str, int] = {}
    out = set()
    in_code = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        match = None if in_code else re.match(r"^#{1,6} (.*)$", line)
        if not match:
            continue
        slug = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_readme_is_short():
    assert len(README.encode("utf-8")) <= 15 * 1024


def test_sections_come_in_the_order_a_new_user_needs():
    titles = re.findall(r"^## (.*)$", README, re.M)
    assert titles == ["Install", "Quick start", "What is covered", "Configuration reference",
                      "Strategies: which to use", "Results", "Limits", "Citations"]


@pytest.mark.parametrize("index", range(len(_blocks("python"))))
def test_python_block_runs_as_written(index, tmp_path, monkeypatch, capsys):
    """Each block on its own, in a fresh namespace and a folder with no ``configs/`` (as
    after ``pip install``), with the torch defaults a user has."""
    code = _blocks("python")[index]
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    exec(compile(code, f"README.md python block {index}", "exec"), {"__name__": "__main__"})


def test_the_quick_start_trains_converts_and_restores():
    blocks = _blocks("python")
    assert blocks, "the README has no python block"
    quick = blocks[0]
    for call in ("az.convert_model(model)", "az.capturing(model)", "loss.backward()",
                 'az.convert_model(model, "4bit")', "az.restore_model(model)"):
        assert call in quick


def test_configuration_reference_lists_exactly_the_schema_with_its_defaults():
    rows = _table(_section("Configuration reference"), "key")
    keys = [row["key"].strip("`") for row in rows]
    schema = [f.name for f in dataclasses.fields(QuantConfig) if f.name != "source"]
    assert keys == list(TOP_KEYS) and sorted(keys) == sorted(schema)
    default = QuantConfig()
    kinds = {"int": int, "float": float, "str": str, "bool": bool, "list": (list, tuple),
             "null": type(None)}
    for row in rows:
        key = row["key"].strip("`")
        written = yaml.safe_load(row["default"].strip("`"))
        actual = getattr(default, key)
        if key == "rules":
            assert written == [] and actual == ()
        else:
            assert written == actual and type(written) is type(actual), (key, written, actual)
        allowed = tuple(kinds[t] for t in re.split(r" or ", row["type"]))
        assert isinstance(actual, allowed) and not (
            isinstance(actual, bool) and bool not in allowed), (key, row["type"])
        assert row["meaning"], key


def test_rule_keys_in_the_reference_are_the_schemas():
    from actnn_zoo.config import ACTION_KEYS, MATCHER_KEYS

    text = _section("Configuration reference")
    rules = text[text.index("A rule has one matcher"):text.index("```yaml")]
    named = set(re.findall(r"`(\w+)`", rules))
    assert set(MATCHER_KEYS) | set(ACTION_KEYS) <= named


def test_yaml_example_is_a_valid_config():
    for block in _blocks("yaml"):
        cfg = QuantConfig.from_dict(yaml.safe_load(block))
        assert cfg.rules


def test_shipped_config_table_lists_the_shipped_configs():
    rows = _table(_section("Configuration reference"), "name")
    names = [n.strip().strip("`") for row in rows for n in row["name"].split(",")]
    assert sorted(names) == sorted(shipped_configs())


def test_every_link_points_at_something_that_exists():
    results_anchors = _anchors((ROOT / "docs" / "results.md").read_text(encoding="utf-8"))
    readme_anchors = _anchors(README)
    links = re.findall(r"\]\(([^)\s]+)\)", README)
    assert links
    for link in links:
        if link.startswith("http"):
            continue
        path, _, anchor = link.partition("#")
        if not path:
            assert anchor in readme_anchors, link
            continue
        assert (ROOT / path).exists(), link
        if anchor:
            assert path == "docs/results.md", link
            assert anchor in results_anchors, f"{link}: no such heading in docs/results.md"


def test_results_table_rows_each_link_to_a_section_of_results_md():
    rows = _table(_section("Results"), "what")
    assert len(rows) >= 8
    for row in rows:
        assert re.search(r"\(docs/results\.md#[\w-]+\)", row["details"]), row["what"]


def test_commands_in_bash_blocks_exist():
    for block in _blocks("bash"):
        for script in re.findall(r"\b(scripts/[\w./-]+)", block):
            assert (ROOT / script).exists(), script


def test_seed_papers_are_cited():
    cites = _section("Citations")
    for paper, venue in (("ActNN", "ICML 2021"), ("GACT", "ICML 2022"),
                         ("DIVISION", "ICML 2023"), ("AC-GC", "NeurIPS 2021")):
        assert re.search(rf"\*{paper}:.*?\* {venue}", cites, re.S), paper
