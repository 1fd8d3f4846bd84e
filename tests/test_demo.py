"""Smoke runs of the demo's training functions, data loaders, table and CLI (a few steps each)."""
from __future__ import annotations

import io
import re
import statistics
import subprocess
import sys

import pytest
import torch

from actnn_zoo.data import load_digits_data, load_text_corpus, sequential_windows
from actnn_zoo.demo import (COLUMNS, DigitsSetup, TextSetup, format_table, run_task,
                            train_digits, train_text)

TINY_DIGITS = DigitsSetup(epochs=2, batch_size=64, width=8, lr=0.05)
TINY_TEXT = TextSetup(steps=30, batch_size=16, context=32, d_model=32, n_heads=2, n_layers=1,
                      num_chars=50_000, eval_windows=32)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models gain nothing from threads, and on a busy machine spinning threads cost."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def digits():
    return load_digits_data()


@pytest.fixture(scope="module")
def corpus():
    return load_text_corpus(TINY_TEXT.num_chars)


def _decreases(losses, k=8):
    return statistics.fmean(losses[-k:]) < statistics.fmean(losses[:k])


def test_digits_data_is_deterministic_and_normalised(digits):
    again = load_digits_data()
    assert torch.equal(digits.x_train, again.x_train) and torch.equal(digits.y_test, again.y_test)
    assert digits.x_train.shape[1:] == (1, 8, 8)
    assert len(digits.x_train) + len(digits.x_test) == 1797
    assert abs(float(digits.x_train.mean())) < 1e-4
    assert abs(float(digits.x_train.std()) - 1) < 1e-3
    assert set(digits.y_test.tolist()) == set(range(10))


def test_text_corpus_is_stdlib_source(corpus):
    assert corpus.train.numel() + corpus.val.numel() == TINY_TEXT.num_chars
    assert "import" in corpus.decode(corpus.train[:5000])
    assert corpus.vocab_size == len(corpus.chars) and int(corpus.train.max()) < corpus.vocab_size
    assert torch.equal(load_text_corpus(TINY_TEXT.num_chars).val, corpus.val)
    byte = load_text_corpus(20_000, vocab="bytes")
    assert byte.vocab_size == 256
    x, y = next(sequential_windows(corpus.val, 8, 4))
    assert torch.equal(x[0, 1:], y[0, :-1])


def test_train_digits_fp32_learns(digits):
    r = train_digits("fp32", TINY_DIGITS, seed=0, data=digits, progress=False)
    assert len(r.losses) == 2 * (len(digits.x_train) // 64) == len(r.step_seconds)
    assert _decreases(r.losses)
    assert r.metric > 50.0  # test accuracy in percent; chance is 10


def test_checkpoint_mode_same_start_and_data_order(digits):
    a = train_digits("fp32", TINY_DIGITS, seed=1, data=digits, max_steps=3, progress=False)
    b = train_digits("checkpoint", TINY_DIGITS, seed=1, data=digits, max_steps=3,
                     progress=False)
    assert a.losses[0] == pytest.approx(b.losses[0], rel=1e-5)


def test_train_digits_2bit_learns(digits):
    r = train_digits("bits", TINY_DIGITS, seed=0, data=digits, max_steps=24, progress=False)
    assert _decreases(r.losses)
    assert all(l == l for l in r.losses)  # no NaN


def test_train_text_learns(corpus):
    r = train_text("fp32", TINY_TEXT, seed=0, corpus=corpus, progress=False)
    assert len(r.losses) == TINY_TEXT.steps
    assert _decreases(r.losses)
    assert 0 < r.metric < r.losses[0]  # validation loss below the untrained loss


def test_run_task_table_fields(digits, capsys):
    modes = ["fp32", "checkpoint", "bits"]
    small = DigitsSetup(epochs=1, batch_size=128, width=8)
    rows = run_task("digits", modes, [0], None, None, small, TINY_TEXT, peak=False,
                    mem_batch=None, progress=True, timing_steps=6)
    # stderr here is pytest's capture, not a terminal: one line per phase, no bar updates
    err = capsys.readouterr().err
    assert "\r" not in err and "\x1b" not in err
    lines = err.splitlines()
    steps = len(digits.x_train) // 128
    assert lines == [line for line in lines if line.startswith("[demo] digits ")]
    assert len(lines) == 2 * len(modes) + 1  # train + saved bytes per mode, then step time
    assert re.fullmatch(rf"\[demo\] digits fp32, seed 0: {steps}/{steps} steps in [\d.]+ s, "
                        r"loss [\d.]+ -> [\d.]+", lines[0])
    assert lines[1].startswith("[demo] digits fp32: saved activations of one batch, ")
    assert lines[-1].startswith("[demo] digits step time: 6 steps per mode")
    assert [r.mode for r in rows][:2] == ["fp32", "checkpoint"]
    ref = rows[0]
    assert ref.ratio == pytest.approx(1.0) and ref.step_ratio == pytest.approx(1.0)
    for r in rows:
        assert r.metric_name == "acc%" and 0 <= r.metric <= 100
        assert r.saved_mib > 0 and r.step_ms > 0 and r.curve
    assert rows[1].ratio > 1.5  # checkpointing keeps only block inputs
    assert rows[2].ratio > 5
    table = format_table(rows)
    for col in COLUMNS:
        assert col in table
    assert "ResNet (digits)" in table and "n/a" in table  # peak skipped


def test_cli_help():
    from actnn_zoo.__main__ import main
    from actnn_zoo.demo import build_parser

    for cmd in ("report", "bench", "max-batch"):
        with pytest.raises(SystemExit) as e:
            main([cmd, "--help"])
        assert e.value.code == 0
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])


def test_cli_report_runs(capsys):
    from actnn_zoo.__main__ import main

    assert main(["report", "--model", "conv1d", "--batch", "8", "--mode", "checkpoint",
                 "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "fp32 saves" in out and "compression" in out


def test_cli_bench_rows(capsys, tmp_path):
    from actnn_zoo.__main__ import main

    out_json = tmp_path / "bench.json"
    assert main(["bench", "--models", "conv1d", "--bits", "2", "--batch", "8", "--no-peak",
                 "--no-checkpoint", "--strategy", "actnn", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "conv1d" in out and "2-bit" in out
    import json

    rows = json.loads(out_json.read_text())["rows"]
    assert rows[0]["mode"] == "fp32" and rows[1]["saved_ratio"] > 5
    assert rows[2]["saved_ratio"] > 5 and "error" not in rows[2]


@pytest.mark.parametrize("argv", [["bench", "--strategy", "no-such-strategy"],
                                  ["max-batch", "--strategy", "auto"],
                                  ["report", "--model", "no-such-model"]])
def test_cli_unknown_names_are_one_line_errors_with_exit_code_2(argv, capsys):
    from actnn_zoo.__main__ import main
    from actnn_zoo.config import STRATEGIES

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert argv[-1] in err and "error" in err
    if "--strategy" in argv:
        assert all(name in err for name in STRATEGIES)  # the registered names, none stale


def test_cli_report_of_an_importable_model_factory(capsys):
    from actnn_zoo.__main__ import main

    assert main(["report", "--model", "torch.nn:Sequential", "--input-shape", "8,3,16,16",
                 "--bits", "2", "--strategy", "uniform", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "torch.nn:Sequential, batch 8" in out
    with pytest.raises(SystemExit, match="needs --input-shape"):
        main(["report", "--model", "torch.nn:Sequential"])
    with pytest.raises(SystemExit, match="cannot import"):
        main(["report", "--model", "no_such_module:f", "--input-shape", "2,2"])


class _Terminal(io.StringIO):
    """A stream that says it is a terminal, as stderr is in an interactive shell."""

    def isatty(self) -> bool:
        return True


def test_progress_is_a_bar_on_a_terminal_and_one_line_per_phase_elsewhere(digits, monkeypatch):
    tty = _Terminal()
    monkeypatch.setattr(sys, "stderr", tty)
    train_digits("fp32", TINY_DIGITS, seed=0, data=digits, max_steps=5, progress=True)
    assert "\r" in tty.getvalue() and "[demo]" not in tty.getvalue()  # tqdm redraws in place

    log = io.StringIO()  # isatty() is False: a file, a pipe, CI
    monkeypatch.setattr(sys, "stderr", log)
    train_digits("fp32", TINY_DIGITS, seed=0, data=digits, max_steps=5, progress=True)
    assert "\r" not in log.getvalue()
    assert log.getvalue().count("\n") == 1
    assert log.getvalue().startswith("[demo] digits fp32, seed 0: 5/5 steps in ")

    quiet = io.StringIO()
    monkeypatch.setattr(sys, "stderr", quiet)
    train_digits("fp32", TINY_DIGITS, seed=0, data=digits, max_steps=5, progress=False)
    assert quiet.getvalue() == ""


def test_demo_cli_logs_one_line_per_phase_when_stderr_is_a_pipe():
    """``python -m actnn_zoo.demo 2> log``, as scripts/demo.sh runs in CI."""
    proc = subprocess.run(
        [sys.executable, "-m", "actnn_zoo.demo", "--tasks", "digits", "--epochs", "1",
         "--modes", "fp32,bits", "--no-peak", "--timing-steps", "2", "--threads", "1"],
        capture_output=True, text=True, timeout=300, check=True)
    assert "\r" not in proc.stderr and "\r" not in proc.stdout
    lines = proc.stderr.splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "[demo] digits fp32, seed 0", "[demo] digits fp32",
        "[demo] digits 2-bit (default), seed 0", "[demo] digits 2-bit (default)",
        "[demo] digits step time"]
    assert "ResNet (digits)" in proc.stdout and "2-bit (default)" in proc.stdout
