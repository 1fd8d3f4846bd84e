#!/usr/bin/env bash
# Installs what the demo needs (scripts/setup_env.sh), then runs it; arguments go to the demo,
# e.g. scripts/demo.sh (quick, a few minutes)  or  scripts/demo.sh --full --seeds 3 --json results/demo.json
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
exec .venv/bin/python -m actnn_zoo.demo "$@"
