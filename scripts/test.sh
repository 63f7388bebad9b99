#!/usr/bin/env bash
# The test command: install (test tools, and vLLM 0.32.0 as oracle and server) and run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --test
exec .venv/bin/python -m pytest tests "$@"
