"""GACT is never worse than uniform bits at equal saved bytes (issue 31, deliverable 3).

On the digits CNN, the project's text transformer and random-init GPT-2 (tiny sizes of
``scripts/gact_vs_uniform.py``: 30 training steps with GACT at a 2-bit budget, then its
allocation against uniform 2 bits on the same weights and a held-out batch), 3 seeds each:

* GACT's saved bytes (codes and metadata, what autograd and the capture store keep) are at
  most uniform's, within 0.5%;
* its error ``E ||g_q - g||^2`` against the exact fp32 gradient, over every parameter and
  ``DRAWS`` draws per strategy, is not above uniform's by more than 3 standard errors of the
  ratio (delta method over the draws): a one-sided test that fails a strategy measurably worse
  than uniform (the issue's 1.20x-1.55x was 5-15 standard errors out at these draws), while
  equal allocations (where GACT predicts no gain and keeps uniform widths) pass;
* over the 3 seeds, its mean ratio is below 1 + 2 standard errors of that mean, and on the two
  transformers, where GACT predicts large gains, below 0.9.

The full sizes, more draws and the weight-matrix error are the script's
(``docs/results.md``, "GACT against uniform at equal bytes").
"""
from __future__ import annotations

import math

import pytest

from _scripts import load_script

SEEDS = (0, 1, 2)
DRAWS = 8
MODELS = ("digits", "text", "gpt2")

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def script():
    return load_script("gact_vs_uniform.py")


@pytest.mark.parametrize("name", MODELS)
def test_gact_is_not_worse_than_uniform_at_equal_bytes(script, name):
    if name == "gpt2":
        pytest.importorskip("transformers")
    results = [script.measure(name, seed, steps=30, draws=DRAWS, tiny=True) for seed in SEEDS]
    lines = [f"seed {r.seed}: gact/uniform {r.ratio:.3f} ± {r.ratio_se:.3f} (weights "
             f"{r.ratio_w:.3f}), bytes {r.gact_bytes / r.uniform_bytes:.4f}, predicted "
             f"{r.predicted}, widths {r.widths}" for r in results]
    msg = "\n".join(lines)
    for r in results:
        assert r.gact_bytes <= r.uniform_bytes * 1.005, msg
        assert r.gact_bits <= 2.0 + 1e-9, msg
        assert r.ratio <= 1.0 + 3.0 * r.ratio_se, msg
    mean = sum(r.ratio for r in results) / len(results)
    se = math.sqrt(sum(r.ratio_se ** 2 for r in results)) / len(results)
    assert mean <= 1.0 + 2.0 * se, msg
    if name != "digits":
        assert mean < 0.9, msg


def test_unknown_model_is_named(script):
    with pytest.raises(ValueError, match="resnet"):
        script.setup("resnet", 0)
    with pytest.raises(SystemExit):
        script.main(["--models", "bert"])

