#!/usr/bin/env bash
# Creates .venv and installs qeff-evs with the CPU build of torch (pinned in constraints.txt).
#   --vllm  also vLLM 0.34.0 for `QEFF_EVS_BACKEND=... vllm serve <export>` (qeff-evs's platform plugin):
#           vllm and xgrammar without their dependency trees (CUDA packages, triton), plus the light
#           packages vLLM's engine and server import (the "vllm" extra).
#           With it vllm-router (the "router" extra), the front of every multi-instance deployment.
#   --test  the test tools too, the bench extra (the bench smoke test plots), the openvino extra (--backend
#           openvino is tested) and everything --vllm installs (vLLM is the tests' oracle and server).
set -euo pipefail
cd "$(dirname "$0")/.."

pip_quiet() {  # pip, minus the local-mirror "is ignored" noise, keeping pip's exit status
    .venv/bin/pip install -q --disable-pip-version-check "$@" 2>&1 | { grep -v "is ignored" || true; }
}

extras=()
case "${1:-}" in
    --test) extras=(test vllm router bench openvino) ;;
    --vllm) extras=(vllm router) ;;
    "") ;;
    *) echo "usage: $0 [--vllm | --test]" >&2; exit 2 ;;
esac

[[ -x .venv/bin/python ]] || python3 -m venv .venv
if ((${#extras[@]})); then
    pip_quiet -c constraints.txt -e ".[$(IFS=,; echo "${extras[*]}")]"
    pip_quiet -c constraints.txt --no-deps vllm==0.34.0 xgrammar==0.2.8
else
    pip_quiet -c constraints.txt -e .
fi
.venv/bin/python -c "import torch; print('qeff-evs installed; torch', torch.__version__)"
