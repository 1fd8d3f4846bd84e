#!/usr/bin/env python
"""Saved-activation compression with the norms saving their normalized input (the default since
the fidelity work) against the same norms saving their raw input, all else equal.

The fidelity change replaced compress(x) by compress((x - mean) * invstd) in batch, layer and
group norm (functional/norm.py). The "before" rows patch ``norm._normalize`` to hand back x
itself, so the same layers compress the raw input (their backward is then wrong; only the bytes
are read here). Rows: the project's ResNet-style CNN and transformer encoder, at the 2-bit
default (actnn, per-sample widths) and uniform 2 bits, one training forward plus the loss.

    PYTHONPATH=. .venv/bin/python scripts/norm_save_compression.py
"""
from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any, Dict
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout

import torch  # noqa: E402

import actnn_zoo as az  # noqa: E402
from actnn_zoo.functional import norm  # noqa: E402
from actnn_zoo.memory import compression_ratio  # noqa: E402
from actnn_zoo.models import build_model, example_batch, workload  # noqa: E402

CASES = (("resnet", 256), ("transformer_encoder", 32))
CONFIGS: Dict[str, Dict[str, Any]] = {"2-bit default": {},
                                      "uniform 2": {"strategy": "uniform", "bits": 2}}


def ratio(name: str, batch: int, config: Dict[str, Any]) -> float:
    torch.manual_seed(0)
    model = build_model(name).train()
    x, y = example_batch(name, batch, {}, 0)
    q = az.convert_model(copy.deepcopy(model), config)
    loss = workload(name).loss
    return compression_ratio(model, q, x, loss_fn=lambda out: loss(out, y))


def main() -> int:
    print(f"{'model':<22} {'config':<14} {'raw x saved':>12} {'x_hat saved':>12} {'change':>8}")
    for name, batch in CASES:
        for label, config in CONFIGS.items():
            after = ratio(name, batch, config)
            with mock.patch.object(norm, "_normalize", lambda x, mean, invstd: x):
                before = ratio(name, batch, config)
            print(f"{name + ':' + str(batch):<22} {label:<14} {before:11.2f}x {after:11.2f}x "
                  f"{100 * (after / before - 1):+7.2f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
