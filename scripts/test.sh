#!/usr/bin/env bash
# The test command: install (with test tools and vLLM oracles) and run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --test
exec .venv/bin/python -m pytest tests "$@"
