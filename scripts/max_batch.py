#!/usr/bin/env python
"""Largest batch under a peak-memory cap: fp32 vs compressed vs checkpointing.

Same as ``python -m actnn_zoo max-batch``; on CPU each try is a fresh child process whose
peak RSS over its warmed-up state is compared with the cap; on CUDA (``--device cuda
--cap-mib 0``) a real out-of-memory error decides. E.g.
    .venv/bin/python scripts/max_batch.py --model resnet --cap-mib 512 \
        --json results/max_batch.json
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout

from actnn_zoo.__main__ import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["max-batch", *sys.argv[1:]]))
