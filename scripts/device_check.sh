#!/usr/bin/env bash
# The reference path on a GPU machine with no network: install from the wheels given, then run the PyTorch
# backend on CUDA against ONNX Runtime on the CPU (scripts/device_check.py), one summary line per check.
#   bash scripts/device_check.sh [--wheels DIR] [device_check.py options: --device cuda|cpu, --families ...,
#                                 --no-pytest, --atol, --workdir]
#   --wheels DIR  pip installs from DIR only (--no-index) what scripts/install.sh --test installs: a CUDA build
#                 of torch 2.13.0, the test and vllm extras, and vllm 0.34.0 + xgrammar 0.2.8 without their
#                 dependencies (the Qwen3.5 parity tests use vLLM's pruning functions as oracles). Fill DIR
#                 elsewhere: pip download -d DIR -c constraints.txt '.[test,vllm]' torch==2.13.0 (CUDA index),
#                 and pip download -d DIR --no-deps vllm==0.34.0 xgrammar==0.2.8.
#                 Without it, the .venv that is there (scripts/install.sh --test) is used as it is.
# Exit status: the number of failed checks.
set -euo pipefail
cd "$(dirname "$0")/.."

wheels=""
args=()
while (($#)); do
    case "$1" in
        --wheels) wheels="${2:?--wheels needs a folder of wheels}"; shift 2 ;;
        *) args+=("$1"); shift ;;
    esac
done

if [[ -n "$wheels" ]]; then
    [[ -d "$wheels" ]] || { echo "device_check: --wheels $wheels is not a folder of wheels" >&2; exit 2; }
    [[ -x .venv/bin/python ]] || python3 -m venv .venv
    .venv/bin/pip install -q --disable-pip-version-check --no-index --find-links "$wheels" \
        -c constraints.txt -e ".[test,vllm]"
    .venv/bin/pip install -q --disable-pip-version-check --no-index --find-links "$wheels" \
        -c constraints.txt --no-deps vllm==0.34.0 xgrammar==0.2.8
fi
[[ -x .venv/bin/python ]] || { echo "device_check: no .venv; pass --wheels DIR or run scripts/install.sh --test" >&2; exit 2; }
exec .venv/bin/python scripts/device_check.py "${args[@]+"${args[@]}"}"
