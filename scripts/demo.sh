#!/usr/bin/env bash
# Installs what the demo needs (scripts/setup_env.sh), then runs it; arguments go to the demo,
# e.g. scripts/demo.sh (quick, a few minutes)  or  scripts/demo.sh --full --seeds 3 --json results/demo.json
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# Where stderr is not a terminal (CI, a log file) nothing draws progress bars: pip's are off
# here, and the demo prints one line per phase instead of tqdm's \r updates.
[ -t 2 ] || export PIP_PROGRESS_BAR=off
bash "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
exec .venv/bin/python -m actnn_zoo.demo "$@"
