"""scripts/bench_host_cost.py: its table (a tiny run of GPT-2) and its argument errors."""
from __future__ import annotations

import pytest

from _scripts import load_script


def _script():
    pytest.importorskip("transformers")
    return load_script("bench_host_cost.py")


def test_table_has_ratios_and_extra_per_q_module(capsys):
    mod = _script()
    assert mod.main(["--models", "gpt2", "--modes",
                     "default,no-capture,checkpoint,compiled-fp32,compiled,torch-compiled",
                     "--backend",
                     "aot_eager", "--steps", "1", "--rounds", "1", "--warmup", "2"]) == 0
    out = capsys.readouterr().out
    assert "gpt2: 123 Q-modules when converted" in out
    rows = {line.split("|")[0].strip(): [c.strip() for c in line.split("|")[1:]]
            for line in out.splitlines() if line.count("|") == 6}
    assert list(rows)[1:] == ["fp32", "default", "no-capture", "checkpoint", "compiled-fp32",
                              "compiled", "torch-compiled"]
    fp32 = float(rows["fp32"][0])
    # the compiled target: the converted model's compiled step (actnn_zoo.compile, plain
    # torch.compile) over torch.compile's of the plain model
    for mode in ("compiled", "torch-compiled"):
        assert float(rows[mode][3]) == pytest.approx(
            float(rows[mode][0]) / float(rows["compiled-fp32"][0]), abs=0.01)
    for mode in ("default", "no-capture", "checkpoint"):
        ms, ratio, extra, _, mean_ratio, faults = rows[mode]
        assert int(faults) >= 0  # minor page faults per timed step
        assert float(ratio) == pytest.approx(float(ms) / fp32, abs=0.01)
        assert float(mean_ratio) > 0  # one step per mode here: the mean is that step's ratio
        assert float(mean_ratio) == pytest.approx(float(ratio), abs=0.01)
        # extra us per Q-module: only for converted modes
        if mode == "checkpoint":
            assert extra == ""
        else:
            assert float(extra) == pytest.approx((float(ms) - fp32) * 1e3 / 123, abs=1)


def test_floor_modes_run_the_plain_model_under_the_mechanisms(capsys, monkeypatch):
    """fp32-mode runs the plain model's forward under a pass-through torch function mode,
    fp32-hooks under pass-through saved-tensor hooks: each reaches its mechanism (counted
    here), neither converts the model, and their rows have no extra per Q-module."""
    mod = _script()
    seen = {"mode": 0, "hooks": 0}
    mode_call = mod._PassThrough.__torch_function__

    def counting_call(self, func, types, args=(), kwargs=None):
        seen["mode"] += 1
        return mode_call(self, func, types, args, kwargs)

    def counting_keep(t):
        seen["hooks"] += 1
        return t
    monkeypatch.setattr(mod._PassThrough, "__torch_function__", counting_call)
    monkeypatch.setattr(mod, "_keep", counting_keep)
    assert mod.main(["--models", "gpt2", "--modes", "fp32-mode,fp32-hooks", "--steps", "1",
                     "--rounds", "1", "--warmup", "1"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("|")[0].strip(): [c.strip() for c in line.split("|")[1:]]
            for line in out.splitlines() if line.count("|") == 6}
    assert list(rows)[1:] == ["fp32", "fp32-mode", "fp32-hooks"]
    assert rows["fp32-mode"][2] == "" and rows["fp32-hooks"][2] == ""
    assert seen["mode"] > 500 and seen["hooks"] > 100  # GPT-2's calls and saves, every step


def test_unknown_model_and_mode_are_named(capsys):
    mod = _script()
    with pytest.raises(SystemExit):
        mod.main(["--models", "bert"])
    assert "bert" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="unknown mode 'fast'"):
        mod.main(["--models", "gpt2", "--modes", "fast", "--steps", "1", "--rounds", "1"])


def test_count_table_is_consistent(capsys):
    """--count adds each mode's Python calls and torch operators per step (host_work), with
    the extra per Q-module over fp32's."""
    mod = _script()
    assert mod.main(["--models", "gpt2", "--modes", "default", "--steps", "1", "--rounds", "1",
                     "--warmup", "2", "--count"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if "Python calls" in line)
    rows = {line.split("|")[0].strip(): [c.strip() for c in line.split("|")[1:]]
            for line in lines[start + 1:start + 3]}
    assert list(rows) == ["fp32", "default"]
    calls, extra_calls, ops, extra_ops = (float(c) for c in rows["default"])
    fp32_calls, _, fp32_ops, _ = rows["fp32"]
    assert calls > float(fp32_calls) and ops > float(fp32_ops)
    assert extra_calls == pytest.approx((calls - float(fp32_calls)) / 123, abs=1)
    assert extra_ops == pytest.approx((ops - float(fp32_ops)) / 123, abs=1)


def test_python_modes_run_the_python_functions(capsys):
    """``default-python`` converts as ``default`` does and runs the linear layers' Python
    Functions (the compiled nodes off for its steps only)."""
    mod = _script()
    steps, n_q = mod.build_steps("gpt2", ["default", "default-python"])
    seen = {}
    from actnn_zoo.functional import linear

    real = linear.LinearFunction.apply

    def spy(*args):
        seen[mode] = seen.get(mode, 0) + 1
        return real(*args)

    linear.LinearFunction.apply = spy
    try:
        for mode in ("default", "default-python"):
            steps[mode]()
    finally:
        linear.LinearFunction.apply = real
    assert n_q == 123
    assert seen.get("default", 0) == 0 and seen["default-python"] >= 48, seen
    # every compiled path switched back on after the step
    import importlib
    for module, name in mod.COMPILED_PATHS:
        assert getattr(importlib.import_module(f"actnn_zoo.functional.{module}"), name) \
            is not None, name


def test_python_modes_switch_every_compiled_path_off():
    """Inside ``python_functions()`` each of ``COMPILED_PATHS`` (and the strategy's compiled
    width choice) is None, so the layers take their Python Functions."""
    import importlib

    from actnn_zoo.precision import actnn

    mod = _script()
    with mod.python_functions():
        for module, name in mod.COMPILED_PATHS:
            assert getattr(importlib.import_module(f"actnn_zoo.functional.{module}"), name) \
                is None, name
        assert actnn._CHOOSE is None
    assert actnn._CHOOSE is not None


def test_relu_masks_mode_turns_off_only_the_code_sharing():
    """relu-masks is uniform-2 with ReLUs keeping their own masks (``relu_codes: false``):
    the price of sharing the consumer's sparse codes, measured against uniform-2."""
    import torch
    from torch import nn

    import actnn_zoo as az
    mod = _script()
    over = mod.OVERRIDES["relu-masks"]
    assert {k: v for k, v in over.items() if k != "relu_codes"} == mod.OVERRIDES["uniform-2"]
    model = az.convert_model(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3)),
                             **over)
    assert model[1].qconfig.relu_codes is False
    assert az.convert_model(nn.Sequential(nn.ReLU()), **mod.OVERRIDES["uniform-2"]
                            )[0].qconfig.relu_codes is True
    assert torch.is_tensor(model(torch.randn(1, 3, 8, 8)))


def test_mean_column_is_the_mean_steps_ratio(capsys, monkeypatch):
    """The last column is mean step over fp32's mean step, not the medians' ratio: with step
    times whose mean and median differ (one slow step, as a re-allocation step is), the
    column follows the mean."""
    mod = _script()
    fake = {"fp32": [0.010, 0.010, 0.010, 0.010], "default": [0.020, 0.020, 0.020, 0.060]}
    monkeypatch.setattr(mod, "interleaved_step_times", lambda steps, **kw: dict(fake))
    assert mod.main(["--models", "gpt2", "--modes", "default", "--steps", "1", "--rounds",
                     "1", "--warmup", "0"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("|")[0].strip(): [c.strip() for c in line.split("|")[1:]]
            for line in out.splitlines() if line.count("|") == 6}
    assert float(rows["default"][1]) == pytest.approx(2.0)  # median 20 ms / 10 ms
    assert float(rows["default"][4]) == pytest.approx(3.0)  # mean 30 ms / 10 ms
    assert float(rows["fp32"][4]) == pytest.approx(1.0)


def test_fault_counter_skips_the_warm_up(monkeypatch):
    """The faults column counts the minor page faults of the timed steps only: the wrapper
    leaves out its first ``skip`` calls (the warm-up, which also maps the model's first
    pages) and divides by the steps it counted."""
    mod = _script()
    total = {"faults": 0}
    per_call = iter([1000, 1000, 7, 9, 11])  # two warm-up steps, then three timed ones

    def step() -> None:
        total["faults"] += next(per_call)

    monkeypatch.setattr(mod.resource, "getrusage",
                        lambda who: type("R", (), {"ru_minflt": total["faults"]})())
    counted = mod._Faults(step, skip=2)
    for _ in range(5):
        counted()
    assert counted.faults == 27 and counted.per_step() == pytest.approx(9.0)


def test_steady_malloc_restarts_only_the_script(capsys):
    """--steady-malloc sets glibc's malloc tunables for a fresh process (they are read at
    start): called as a function, which it cannot restart, it says so instead of timing
    with the settings it promised."""
    mod = _script()
    with pytest.raises(SystemExit):
        mod.main(["--models", "gpt2", "--modes", "default", "--steady-malloc"])
    assert "restarts the process" in capsys.readouterr().err


def test_split_reports_forward_and_backward_per_mode(capsys):
    """--split: the median forward and backward per mode; each a positive share of the step,
    with its ratio to fp32's."""
    mod = _script()
    assert mod.main(["--models", "gpt2", "--modes", "default", "--steps", "3", "--rounds", "1",
                     "--warmup", "2", "--split"]) == 0
    out = capsys.readouterr().out
    steps = {line.split("|")[0].strip(): float(line.split("|")[1])
             for line in out.splitlines() if line.count("|") == 6 and "ms/step" not in line}
    split = {line.split("|")[0].strip(): [float(c) for c in line.split("|")[1:]]
             for line in out.splitlines() if line.count("|") == 4 and "forward" not in line}
    assert list(split) == ["fp32", "default"]
    f0, _, b0, _ = split["fp32"]
    for mode, (fw, fr, bw, br) in split.items():
        assert 0 < fw < steps[mode] * 1.5 and 0 < bw < steps[mode] * 1.5
        assert fr == pytest.approx(fw / f0, abs=0.01) and br == pytest.approx(bw / b0, abs=0.01)


def test_callbacks_are_timed_inside_the_step_and_given_back(capsys):
    """--callbacks times the strategy's per-layer callbacks (LayerWatch pre and post) inside
    the step: the default has them (one pre call per watched layer call), uniform-2 has none;
    afterwards every watch holds the strategy's own callbacks again."""
    mod = _script()
    assert mod.main(["--models", "gpt2", "--modes", "default,uniform-2", "--steps", "2",
                     "--rounds", "1", "--warmup", "2", "--callbacks"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if "pre ms/step" in line)
    rows = {}
    for line in lines[start + 1:]:
        if line.count("|") != 6:
            break
        rows[line.split("|")[0].strip()] = [float(c) for c in line.split("|")[1:]]
    assert list(rows) == ["default"]  # fp32 and uniform-2 have no strategy callbacks
    pre_ms, pre_calls, pre_us, post_ms, post_calls, post_us = rows["default"]
    assert pre_ms > 0 and pre_calls >= 36 and post_calls >= 1
    assert pre_us == pytest.approx(pre_ms * 1e3 / pre_calls, rel=0.01, abs=0.1)

    steps, _ = mod.build_steps("gpt2", ["default"])
    step = steps["default"]
    step()
    watches = [m.__dict__[mod.WATCH_ATTR] for m in step.model.modules()
               if mod.WATCH_ATTR in m.__dict__]
    own = [(w.pre, w.post) for w in watches]
    got = mod.callback_times(step, 2)
    assert got["pre"][1] == pytest.approx(pre_calls) and got["pre"][0] > 0
    assert [(w.pre, w.post) for w in watches] == own
