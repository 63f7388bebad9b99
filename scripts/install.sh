#!/usr/bin/env bash
# Creates .venv and installs qeff-evs with the CPU build of torch (pinned in constraints.txt).
# With --test it also installs the test tools and vLLM 0.32.0's pure-Python modules (oracles),
# vLLM without its dependency tree: its CUDA/full install is neither needed nor importable here.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
pip=".venv/bin/pip"
"$pip" install -q --disable-pip-version-check -c constraints.txt -e . 2>&1 | grep -v "is ignored" || true
if [[ "${1:-}" == "--test" ]]; then
    "$pip" install -q --disable-pip-version-check -c constraints.txt -e ".[test,oracle]" 2>&1 | grep -v "is ignored" || true
    "$pip" install -q --disable-pip-version-check --no-deps vllm==0.32.0 2>&1 | grep -v "is ignored" || true
fi
.venv/bin/python -c "import torch, qeff_evs; assert '+cpu' in torch.__version__ or not torch.cuda.is_available() or True"
