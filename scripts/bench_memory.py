#!/usr/bin/env python
"""Saved-activation compression and peak memory per model and bit width.

Same as ``python -m actnn_zoo bench``; e.g.
    .venv/bin/python scripts/bench_memory.py --json results/bench_memory.json \
        --sweep 256,512,1024,2048,4096
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout

from actnn_zoo.__main__ import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
