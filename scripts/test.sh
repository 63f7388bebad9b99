#!/usr/bin/env bash
# The test command: install (test tools, and vLLM 0.34.0 as oracle and server), build the docs site strictly
# (a broken link, anchor or missing page fails it) and run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --test
site_dir=$(mktemp -d)
# Not --quiet: it drops the warnings --strict counts, and a broken link would pass.
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --site-dir "$site_dir"
rm -rf "$site_dir"
exec .venv/bin/python -m pytest tests "$@"
