#!/usr/bin/env bash
# The GPU check of issue 31 (item 5): what only a GPU shows, in at most 10 minutes on one H200, with a CUDA build of
# torch, no vLLM and no Hub (every model is built from its config). It writes one JSON file.
#
#   bash scripts/gpu_check.sh [--out gpu_check.json] [--dry-run]
#
# Steps (each with its own time limit, all within BUDGET_S):
#   environment   the GPU, CUDA, torch / transformers / TRL versions; fails without CUDA
#   gpu_tests     pytest -m gpu on the node ids below: every scoring mode and each truncation correction 2 GRPO steps
#                 on CUDA (fp32- and bf16-stored policies), the default mode equal to stock TRL, IEEE fp32 with TF32
#                 on, an fp16 copy at position 30,000, fp32 passes under FlashAttention 2 (when flash-attn is
#                 installed), the diagnostics' and kept sets' device; the vLLM test skips (no vLLM here)
#   peak_memory   the peak-memory table at a Qwen2.5-1.5B-shaped config against stock TRL (benchmarks/peak_memory.py
#                 --device cuda --shape 1.5b: the CUDA allocator's peak per arm, each in its own process; 512
#                 completion tokens and the arms whose memory differs from TRL's, to fit the 200 s of this step)
# The JSON holds each step's status, seconds and output tail, pytest's counts per node, the benchmark's output, and
# "ok": true only when every step passed.
#
# --dry-run needs no GPU: it checks that every node id below is collected by pytest and says what would run
# (tests/gpu/test_gpu_check.py runs it on every CPU test run).
#
# Status: this script has not run on a GPU yet.

set -euo pipefail
cd "$(dirname "$0")/.."

OUT=gpu_check.json
DRY_RUN=0
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT="$2"; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1 (allowed: --out FILE, --dry-run)" >&2; exit 2 ;;
  esac
done

PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export WANDB_MODE=disabled CUBLAS_WORKSPACE_CONFIG=:4096:8  # deterministic cuBLAS for the stock-TRL comparison

BUDGET_S=600
# the gpu tests this check runs (each must exist: tests/gpu/test_gpu_check.py collects them on the CPU)
GPU_TESTS=(
  tests/gpu/test_cuda_modes.py::test_every_mode_trains_two_steps_on_cuda
  tests/gpu/test_cuda_modes.py::test_truncation_corrections_train_two_steps_on_cuda
  tests/gpu/test_cuda_modes.py::test_bf16_is_stock_trl_on_cuda
  tests/gpu/test_cuda_precision.py::test_fp32_modes_compute_ieee_fp32_with_tf32_on
  tests/gpu/test_cuda_precision.py::test_an_fp16_copy_scores_long_positions_with_fp32_rotary_tables
  tests/gpu/test_cuda_precision.py::test_fp32_passes_under_flash_attention_2
  tests/gpu/test_cuda_precision.py::test_diagnostics_and_kept_sets_live_on_the_gpu
  tests/gpu/test_vllm_truncation.py::test_vllm_colocate_truncation_correction
)
PEAK_MEMORY=benchmarks/peak_memory.py

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
START=$(date +%s)
STEPS=()

# step NAME LIMIT_S COMMAND...: run COMMAND with a time limit (never past the budget); keep its status, seconds and
# output under $WORK
step() {
  local name=$1 limit=$2; shift 2
  local left=$(( BUDGET_S - ($(date +%s) - START) ))
  [ "$limit" -gt "$left" ] && limit=$left
  STEPS+=("$name")
  local t0=$(date +%s) rc=0
  if [ "$limit" -le 0 ]; then
    echo "budget of ${BUDGET_S}s spent before this step" > "$WORK/$name.log"; rc=124
  else
    echo "== $name (limit ${limit}s): $*"
    set +e
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$WORK/$name.log"
    rc=${PIPESTATUS[0]}
    set -e
  fi
  echo "$rc" > "$WORK/$name.rc"
  echo $(( $(date +%s) - t0 )) > "$WORK/$name.seconds"
}

PEAK_MEMORY_ARGS=(--device cuda --shape 1.5b --tokens 512
                  --arms trl,trl_cast_lm_head_to_fp32,fp32_clone,fp16_clone,fp32_head,renormalize)

if [ "$DRY_RUN" = 1 ]; then
  step collect 120 "$PYTHON" -m pytest --collect-only -q -p no:cacheprovider -m gpu "${GPU_TESTS[@]}"
  step peak_memory_args 60 "$PYTHON" "$PEAK_MEMORY" --check-args "${PEAK_MEMORY_ARGS[@]}"
  echo "peak_memory: would run $PEAK_MEMORY ${PEAK_MEMORY_ARGS[*]}" > "$WORK/peak_memory_plan.log"
  cat "$WORK/peak_memory_plan.log"
else
  step environment 60 "$PYTHON" -c '
import sys, torch, transformers, trl
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), transformers {transformers.__version__}, trl {trl.__version__}")
if not torch.cuda.is_available():
    sys.exit("no CUDA device: the GPU check needs one (run --dry-run on a CPU)")
print(torch.cuda.get_device_name(0), f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB")
'
  if [ "$(cat "$WORK/environment.rc")" = 0 ]; then
    step gpu_tests 390 "$PYTHON" -m pytest -m gpu -q -p no:cacheprovider -rs --junitxml="$WORK/gpu_tests.xml" \
      "${GPU_TESTS[@]}"
    step peak_memory 200 "$PYTHON" "$PEAK_MEMORY" "${PEAK_MEMORY_ARGS[@]}" --json "$WORK/peak_memory.json"
  fi
fi

"$PYTHON" - "$WORK" "$OUT" "$DRY_RUN" "$START" "${STEPS[@]}" <<'EOF'
"""Assemble the check's one JSON from the steps' files."""
import json, platform, sys, time
import xml.etree.ElementTree as ET
from pathlib import Path

work, out, dry_run, start, steps = Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "1", int(sys.argv[4]), sys.argv[5:]
report = {"check": "issue 31 GPU check (scripts/gpu_check.sh)", "dry_run": dry_run, "host": platform.node(),
          "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(start)), "seconds": int(time.time()) - start,
          "steps": {}}
for name in steps:
    rc = int((work / f"{name}.rc").read_text())
    log = (work / f"{name}.log").read_text(errors="replace")
    report["steps"][name] = {"status": "passed" if rc == 0 else ("timeout" if rc in (124, 137) else "failed"),
                             "exit_code": rc, "seconds": int((work / f"{name}.seconds").read_text()),
                             "output_tail": log[-4000:]}
junit = work / "gpu_tests.xml"
if junit.exists():
    nodes = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        outcome = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        nodes[f"{case.get('classname')}::{case.get('name')}"] = {"outcome": outcome, "seconds": float(case.get("time", 0))}
    report["steps"]["gpu_tests"]["nodes"] = nodes
    report["steps"]["gpu_tests"]["counts"] = {k: sum(n["outcome"] == k for n in nodes.values())
                                              for k in ("passed", "failure", "error", "skipped")}
plan = work / "peak_memory_plan.log"
if plan.exists():
    report["peak_memory_plan"] = plan.read_text().strip()
table = work / "peak_memory.json"
if table.exists():
    report["peak_memory"] = json.loads(table.read_text())  # the benchmark's result, as its --json writes it
report["ok"] = bool(steps) and all(s["status"] == "passed" for s in report["steps"].values())
Path(out).write_text(json.dumps(report, indent=2) + "\n")
print(f"gpu_check: {'ok' if report['ok'] else 'NOT ok'}; {out}")
sys.exit(0 if report["ok"] else 1)
EOF
