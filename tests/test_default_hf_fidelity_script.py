"""scripts/default_hf_fidelity.py: a tiny GPT-2 run of its table, and its argument errors."""
from __future__ import annotations

import pytest

from _scripts import load_script


def _script():
    pytest.importorskip("transformers")
    return load_script("default_hf_fidelity.py")


def test_the_default_allocates_gpt2s_conv1d_between_the_uniform_widths(capsys):
    mod = _script()
    assert mod.main(["--model", "gpt2", "--width", "64", "--layers", "2", "--batch", "4",
                     "--context", "32", "--pretrain", "3", "--passes", "2"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("|")[0].strip(): [c.strip() for c in line.split("|")[1:]]
            for line in out.splitlines() if line.count("|") == 6}
    assert list(rows) == ["config", "default", "uniform-2", "uniform-4"]
    # the strategy sees the MLP's Conv1D layers (it gave them widths) and the GELUs
    widths = dict(w.rsplit(" ", 1) for w in rows["default"][5].split(", "))
    assert {"c_fc", "c_proj", "act"} <= widths.keys(), widths
    err = {k: float(v[0]) for k, v in rows.items() if k != "config"}
    saved = {k: float(v[4]) for k, v in rows.items() if k != "config"}
    # a 3.375-bit budget: error and compression between uniform 4 and uniform 2 bits
    assert err["uniform-4"] < err["default"] < err["uniform-2"], err
    assert saved["uniform-4"] < saved["default"] < saved["uniform-2"], saved
    assert all(0.9 < float(v[3]) <= 1.0 for k, v in rows.items() if k != "config")


def test_an_unknown_config_is_named(capsys):
    mod = _script()
    with pytest.raises(SystemExit):
        mod.main(["--configs", "default,uniform-3"])
    err = capsys.readouterr().err
    assert "unknown config(s) ['uniform-3']" in err and "gact-2" in err


def test_train_reports_each_configs_validation_loss_against_fp32(capsys):
    mod = _script()
    assert mod.main(["--model", "gpt2", "--width", "64", "--layers", "1", "--batch", "4",
                     "--context", "32", "--train", "2", "--configs", "default"]) == 0
    rows = {line.split("|")[0].strip(): [c.strip() for c in line.split("|")[1:]]
            for line in capsys.readouterr().out.splitlines() if "|" in line}
    assert list(rows) == ["fp32", "default"]
    ref, loss = float(rows["fp32"][0]), float(rows["default"][0])
    assert 0 < ref < 10 and 0 < loss < 10  # ln(vocab) ~ 4.6 at the start
    assert float(rows["default"][1].split("%")[0]) == pytest.approx(100 * (loss / ref - 1),
                                                                      abs=0.01)
