"""scripts/bits_vs_loss.py: run names, configs, resumability and the summary (no training)."""
from __future__ import annotations

import json

import pytest

from actnn_zoo.config import as_config

from _scripts import load_script


@pytest.fixture(scope="module")
def bvl():
    return load_script("bits_vs_loss.py")


def test_names_are_unique_and_configs_valid(bvl):
    runs = bvl.plan()
    assert len({r.name for r in runs}) == len(runs)
    assert runs[0].name == "text_fp32_s0"
    assert bvl.Run("text", "actnn", 1.5, 0, "curve").name == "text_actnn_1.5b_s0"
    assert bvl.Run("text", "acgc", 0.3, 2, "x").name == "text_acgc_e0.3_s2"
    for r in runs:
        cfg = bvl.config_for(r)
        assert (cfg is None) == (r.strategy == "fp32")
        if cfg is not None:
            as_config(cfg)  # the library accepts it


def test_pending_skips_written_runs(bvl, tmp_path):
    runs = [bvl.Run("text", "fp32", None, 0, "curve"), bvl.Run("text", "uniform", 2, 0, "curve")]
    bvl.run_path(tmp_path, runs[0]).write_text("{}")
    assert [r.name for r in bvl.pending(runs, tmp_path)] == ["text_uniform_2b_s0"]


def _record(bvl, strategy, level, seed, metric, bits):
    run = bvl.Run("text", strategy, level, seed, "x")
    return {"name": run.name, "run": {"task": "text", "strategy": strategy, "level": level,
                                      "seed": seed, "group": "x"},
            "label": run.label, "metric": metric, "strategy_bits": bits,
            "storage_bits": 32.0 if bits is None else bits + 0.1,
            "compression": 1.0 if bits is None else 32 / (bits + 0.1), "train_seconds": 1.0,
            "setup": {"steps": 3}}


def test_summary_against_fp32_on_the_same_seeds(bvl, tmp_path):
    recs = [_record(bvl, "fp32", None, 0, 2.0, None), _record(bvl, "fp32", None, 1, 2.2, None),
            _record(bvl, "uniform", 2, 0, 2.1, 2.0), _record(bvl, "uniform", 2, 1, 2.3, 2.0),
            _record(bvl, "actnn", 2, 0, 2.05, 2.0)]
    rows = {r["label"]: r for r in bvl.summarize(recs, "text")}
    assert rows["uniform 2"]["vs_fp32"] == pytest.approx(100 * (2.2 - 2.1) / 2.1)
    assert rows["actnn 2"]["vs_fp32"] == pytest.approx(2.5)  # seed 0 only: fp32 2.0
    assert rows["uniform 2"]["seeds"] == [0, 1]
    for r in recs:
        (tmp_path / f"{r['name']}.json").write_text(json.dumps(r))
    out = bvl.report(tmp_path, tmp_path / "res")
    assert "actnn 2" in out and (tmp_path / "res" / "bits_vs_loss.png").exists()
