#!/usr/bin/env bash
# Creates .venv and installs qeff-evs with the CPU build of torch (pinned in constraints.txt).
# With --test it also installs the test tools, the bench extra (the bench smoke test plots) and vLLM 0.32.0's
# pure-Python modules (test oracles):
# vLLM goes in without its dependency tree, whose CUDA/full install is neither needed nor importable here.
set -euo pipefail
cd "$(dirname "$0")/.."

pip_quiet() {  # pip, minus the local-mirror "is ignored" noise, keeping pip's exit status
    .venv/bin/pip install -q --disable-pip-version-check "$@" 2>&1 | { grep -v "is ignored" || true; }
}

[[ -x .venv/bin/python ]] || python3 -m venv .venv
if [[ "${1:-}" == "--test" ]]; then
    pip_quiet -c constraints.txt -e ".[test,oracle,bench]"
    pip_quiet --no-deps vllm==0.32.0
else
    pip_quiet -c constraints.txt -e .
fi
.venv/bin/python -c "import torch; print('qeff-evs installed; torch', torch.__version__)"
