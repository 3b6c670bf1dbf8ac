#!/usr/bin/env bash
# The GPU check (issues 31 and 39): what only a GPU shows, in one call of under 480 s on one GPU machine that has
# python3 with a CUDA build of torch, transformers, accelerate, peft and pytest, but no TRL, datasets or vLLM and no
# internet. What it needs beyond that is carried in as wheels (at most 64 MiB), fetched beforehand by --prepare.
# It writes one JSON file.
#
#   bash scripts/gpu_check.sh --prepare DIR [--python-version 3.12]   # where PyPI is reachable: the wheels into DIR
#   bash scripts/gpu_check.sh --wheels DIR [--out gpu_check.json]      # on the GPU machine, offline
#   bash scripts/gpu_check.sh --dry-run [--wheels DIR] [--out FILE]    # on a CPU: the whole script, no GPU
#   bash scripts/gpu_check.sh --dry-run --collect-only                  # the same, the tests collected, not run
#
# --prepare downloads, without their dependencies, the wheels of what the bare machine lacks (WHEELS below: TRL,
# datasets and what datasets needs beyond transformers' own dependencies) for CPython 3.12 on manylinux x86_64
# (--python-version for another), and fails if DIR then holds more than 64 MiB.
#
# Steps, each with its own time limit, all within BUDGET_S (450 s):
#   install      the wheels of --wheels DIR that the interpreter does not have, offline (`pip install --no-index
#                --no-deps --target`) into a temporary folder on PYTHONPATH, with the repository (nothing is
#                installed into the interpreter)
#   environment  the GPU, CUDA, the versions of torch / transformers / accelerate / peft / TRL / datasets, and that
#                grpo_ratio and its trainers import; fails without CUDA (a dry run notes it)
#   gpu_tests    pytest -m gpu on the node ids below (tests/gpu): every scoring mode and each truncation correction 2
#                GRPO steps on CUDA, the default mode equal to stock TRL, IEEE fp32 with TF32 on (separate and fused
#                fp32_head), long positions in an fp16 copy, the async fp16_clone fallback under the tree kernel's
#                dtype contract, whole copies under the fp16 fallback, the fp32 tree attention's memory, LoRA, MoE,
#                the async trainer and the attribution on CUDA; FlashAttention and vLLM tests skip (not installed)
#   peak_memory  the peak-memory table at a Qwen2.5-1.5B-shaped config against stock TRL (benchmarks/peak_memory.py
#                --device cuda --shape 1.5b: the CUDA allocator's peak per arm, each in its own process, the model
#                built on the GPU); stock TRL's arm is timed first and the others run while they fit what is left
# The JSON holds each step's status, seconds and output tail, pytest's outcome per node, the benchmark's result, and
# "ok": true only when every step passed.
#
# --dry-run runs every step on the CPU: the same install (from --wheels DIR into a fresh folder; without it the
# interpreter's own packages), the environment step without the CUDA requirement, pytest collecting every node id
# below and running the bodies of the CPU-runnable ones on the CPU (GPU_TESTS_DEVICE=cpu), and the benchmark's tiny
# shape on the CPU under the same arm timing (about 6 minutes on 2 busy cores). With --collect-only it runs no test
# body and no arm (the benchmark only checks its GPU arguments): tests/gpu/test_gpu_check.py runs that on every CPU
# test run, and the whole dry run in -m slow.
#
#   PYTHON   the interpreter (default python3)
#
# Status: this script has not run on a GPU yet.

set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"

OUT=gpu_check.json
DRY_RUN=0
COLLECT_ONLY=0
WHEELS=""
PREPARE=""
PY_VERSION=3.12
usage() { sed -n '2,40p' "$0"; }
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT="$2"; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    --collect-only) COLLECT_ONLY=1; shift ;;
    --wheels) WHEELS="$2"; shift 2 ;;
    --prepare) PREPARE="$2"; shift 2 ;;
    --python-version) PY_VERSION="$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1 (allowed: --prepare DIR, --python-version X.Y, --wheels DIR, --out FILE, --dry-run, --collect-only)" >&2
       exit 2 ;;
  esac
done
if [ "$COLLECT_ONLY" = 1 ] && [ "$DRY_RUN" = 0 ]; then
  echo "gpu_check.sh: --collect-only goes with --dry-run" >&2
  exit 2
fi

PYTHON=${PYTHON:-python3}
MAX_WHEEL_BYTES=$((64 * 1024 * 1024))
# what a machine with python3, torch, transformers, accelerate, peft and pytest lacks for TRL 1.16 and datasets
# (each pinned: the set the dry run installed and ran with); pyarrow is the bulk (49 MB for cp312)
WHEELS_TO_CARRY=(
  trl==1.16.0 datasets==5.2.0 pyarrow==24.0.0 pandas==3.1.1 python-dateutil==4.0.0
  dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0
  requests==2.34.2 urllib3==2.8.0 charset-normalizer==3.5.3
)

if [ -n "$PREPARE" ]; then
  mkdir -p "$PREPARE"
  abi="cp${PY_VERSION/./}"
  "$PYTHON" -m pip download --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
    --abi "$abi" --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$PREPARE" "${WHEELS_TO_CARRY[@]}"
  "$PYTHON" - "$PREPARE" "$MAX_WHEEL_BYTES" <<'EOF'
import sys
from pathlib import Path

folder, limit = Path(sys.argv[1]), int(sys.argv[2])
wheels = sorted(folder.glob("*.whl"))
total = sum(w.stat().st_size for w in wheels)
for w in wheels:
    print(f"{w.stat().st_size / 2**20:8.2f} MiB  {w.name}")
print(f"{total / 2**20:8.2f} MiB  in {len(wheels)} wheels (limit {limit / 2**20:.0f} MiB)")
if total > limit:
    sys.exit(f"gpu_check.sh --prepare: {folder} holds {total / 2**20:.1f} MiB of wheels, over the "
             f"{limit / 2**20:.0f} MiB that can be carried")
EOF
  exit 0
fi

export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export WANDB_MODE=disabled CUBLAS_WORKSPACE_CONFIG=:4096:8  # deterministic cuBLAS for the stock-TRL comparison
export TRL_EXPERIMENTAL_SILENCE=1

BUDGET_S=450  # one call of the GPU machine is 600 s at most; the machine's start and the transfers come on top
# the gpu tests this check runs (each must exist: tests/gpu/test_gpu_check.py collects them on the CPU)
GPU_TESTS=(
  tests/gpu/test_cuda_modes.py::test_every_mode_trains_two_steps_on_cuda
  tests/gpu/test_cuda_modes.py::test_truncation_corrections_train_two_steps_on_cuda
  tests/gpu/test_cuda_modes.py::test_bf16_is_stock_trl_on_cuda
  tests/gpu/test_cuda_precision.py::test_fp32_modes_compute_ieee_fp32_with_tf32_on
  tests/gpu/test_cuda_precision.py::test_an_fp16_copy_scores_long_positions_with_fp32_rotary_tables
  tests/gpu/test_cuda_precision.py::test_fp32_passes_under_flash_attention_2
  tests/gpu/test_cuda_precision.py::test_diagnostics_and_kept_sets_live_on_the_gpu
  tests/gpu/test_cuda_precision.py::test_the_sampler_fp32_head_runs_the_out_dtype_kernel
  tests/gpu/test_vllm_truncation.py::test_vllm_colocate_truncation_correction
  tests/gpu/test_cuda_at_scale.py::test_async_fp16_clone_fallback_keeps_the_tree_kernel_contract
  tests/gpu/test_cuda_at_scale.py::test_fp16_fallback_builds_each_whole_copy_at_most_once
  tests/gpu/test_cuda_at_scale.py::test_fp32_tree_attention_allocates_less_than_one_score_rectangle
  tests/gpu/test_cuda_at_scale.py::test_fused_fp32_head_is_ieee_with_tf32_on
  tests/gpu/test_cuda_at_scale.py::test_lora_copies_train_two_steps
  tests/gpu/test_cuda_at_scale.py::test_moe_routes_and_fp32_layers_train_two_steps
  tests/gpu/test_cuda_at_scale.py::test_attribution_trains_two_steps
  tests/gpu/test_cuda_at_scale.py::test_async_decoupled_trains_two_steps
)
# the bodies a dry run also runs, on the CPU (GPU_TESTS_DEVICE=cpu): every import and trainer of the environment
DRY_RUN_TESTS=(
  "tests/gpu/test_cuda_at_scale.py::test_fused_fp32_head_is_ieee_with_tf32_on"
  "tests/gpu/test_cuda_at_scale.py::test_lora_copies_train_two_steps[fp32_head]"
  "tests/gpu/test_cuda_at_scale.py::test_moe_routes_and_fp32_layers_train_two_steps"
  "tests/gpu/test_cuda_at_scale.py::test_attribution_trains_two_steps"
  "tests/gpu/test_cuda_at_scale.py::test_async_decoupled_trains_two_steps[bf16]"
)
PEAK_MEMORY=benchmarks/peak_memory.py
PEAK_MEMORY_ARMS=trl,fp32_head,fp32_clone,fp16_clone,renormalize,trl_cast_lm_head_to_fp32

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
START=$(date +%s)
STEPS=()

left_s() { echo $(( BUDGET_S - ($(date +%s) - START) )); }

# step NAME LIMIT_S COMMAND...: run COMMAND with a time limit (never past the budget); keep its status, seconds and
# output under $WORK
step() {
  local name=$1 limit=$2; shift 2
  local left
  left=$(left_s)
  [ "$limit" -gt "$left" ] && limit=$left
  STEPS+=("$name")
  local t0 rc=0
  t0=$(date +%s)
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

# the carried wheels: those whose distribution the interpreter lacks, offline (pip's --target; unzipped by hand where
# the interpreter has no pip), into a fresh folder named site-packages that goes on PYTHONPATH. The name matters:
# dill (datasets' fingerprints) pickles a module by reference only when its file lies under the interpreter's prefix
# or in a "site-packages" folder; elsewhere it pickles the module by value, pyarrow's included, and fails.
cat > "$WORK/install_wheels.py" <<'EOF'
import importlib.metadata as metadata
import re
import subprocess
import sys
import zipfile
from pathlib import Path

folder, site = Path(sys.argv[1]), Path(sys.argv[2])
wheels = sorted(folder.glob("*.whl"))
if not wheels:
    sys.exit(f"--wheels {folder}: no wheels there (make them with: bash scripts/gpu_check.sh --prepare {folder})")
site.mkdir(parents=True)
missing = []
for wheel in wheels:
    name = re.sub(r"[-_.]+", "-", wheel.name.split("-")[0]).lower()
    try:
        print(f"have {name} {metadata.version(name)}: {wheel.name} not installed")
    except metadata.PackageNotFoundError:
        missing.append(wheel)
have_pip = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode == 0
if missing and have_pip:
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
                    "--disable-pip-version-check", "--target", str(site), *map(str, missing)], check=True)
else:
    for wheel in missing:  # a wheel is a zip of its files laid out as in site-packages
        with zipfile.ZipFile(wheel) as z:
            z.extractall(site)
for wheel in missing:
    print(f"installed {wheel.name}")
print(f"{len(missing)} of {len(wheels)} wheels installed into {site}")
EOF

if [ -n "$WHEELS" ]; then
  step install 90 "$PYTHON" "$WORK/install_wheels.py" "$WHEELS" "$WORK/site-packages"
  export PYTHONPATH="$WORK/site-packages${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # benchmarks/peak_memory.py imports grpo_ratio from here

if [ ${#STEPS[@]} -eq 0 ] || [ "$(cat "$WORK/install.rc")" = 0 ]; then
  step environment 60 env GPU_CHECK_DRY_RUN="$DRY_RUN" "$PYTHON" -c '
import os, sys
import accelerate, datasets, peft, torch, transformers, trl
import grpo_ratio
from grpo_ratio import RatioGRPOTrainer, RatioRLOOTrainer
from grpo_ratio.async_grpo import RatioAsyncGRPOTrainer
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), transformers "
      f"{transformers.__version__}, accelerate {accelerate.__version__}, peft {peft.__version__}, trl {trl.__version__}, "
      f"datasets {datasets.__version__}; grpo_ratio from {os.path.dirname(grpo_ratio.__file__)}")
if not torch.cuda.is_available():
    if os.environ["GPU_CHECK_DRY_RUN"] == "1":
        print("no CUDA device: a dry run (the tests run on the CPU where they can)")
        sys.exit(0)
    sys.exit("no CUDA device: the GPU check needs one (run --dry-run on a CPU)")
print(torch.cuda.get_device_name(0), f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB")
'
fi

if [ "${STEPS[-1]}" = environment ] && [ "$(cat "$WORK/environment.rc")" = 0 ]; then
  if [ "$DRY_RUN" = 1 ]; then
    step collect 60 "$PYTHON" -m pytest --collect-only -q -p no:cacheprovider -m gpu "${GPU_TESTS[@]}"
  fi
  if [ "$DRY_RUN" = 1 ] && [ "$COLLECT_ONLY" = 1 ]; then
    step peak_memory_args 60 "$PYTHON" "$PEAK_MEMORY" --check-args --device cuda --shape 1.5b --tokens 512 \
      --arms "$PEAK_MEMORY_ARMS" --budget-s 120
  elif [ "$DRY_RUN" = 1 ]; then
    step gpu_tests 240 env GPU_TESTS_DEVICE=cpu "$PYTHON" -m pytest -m gpu -q -p no:cacheprovider -rs \
      --junitxml="$WORK/gpu_tests.xml" "${DRY_RUN_TESTS[@]}"
    left=$(left_s)
    step peak_memory 150 "$PYTHON" "$PEAK_MEMORY" --device cpu --shape tiny --tokens 16 --arms trl,fp32_head \
      --budget-s $(( (left < 150 ? left : 150) - 10 )) --json "$WORK/peak_memory.json"
  else
    step gpu_tests 270 "$PYTHON" -m pytest -m gpu -q -p no:cacheprovider -rs --junitxml="$WORK/gpu_tests.xml" \
      "${GPU_TESTS[@]}"
    left=$(left_s)
    # the arms' own budget leaves the step 15 s for the parent's start and its table
    step peak_memory "$left" "$PYTHON" "$PEAK_MEMORY" --device cuda --shape 1.5b --tokens 512 \
      --arms "$PEAK_MEMORY_ARMS" --budget-s $(( left - 15 )) --json "$WORK/peak_memory.json"
  fi
fi

"$PYTHON" - "$WORK" "$OUT" "$DRY_RUN" "$START" "$BUDGET_S" "${STEPS[@]}" <<'EOF'
"""Assemble the check's one JSON from the steps' files."""
import json, platform, sys, time
import xml.etree.ElementTree as ET
from pathlib import Path

work, out, dry_run, start, budget = Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "1", int(sys.argv[4]), int(sys.argv[5])
steps = sys.argv[6:]
report = {"check": "GPU check (scripts/gpu_check.sh)", "dry_run": dry_run, "host": platform.node(),
          "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(start)), "seconds": int(time.time()) - start,
          "budget_seconds": budget, "steps": {}}
for name in steps:
    rc = int((work / f"{name}.rc").read_text())
    log = (work / f"{name}.log").read_text(errors="replace")
    report["steps"][name] = {"status": "passed" if rc == 0 else ("timeout" if rc in (124, 137) else "failed"),
                             "exit_code": rc, "seconds": int((work / f"{name}.seconds").read_text()),
                             "output_tail": log[-4000:]}
junit = work / "gpu_tests.xml"
if junit.exists() and "gpu_tests" in report["steps"]:
    nodes = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        outcome = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        nodes[f"{case.get('classname')}::{case.get('name')}"] = {"outcome": outcome, "seconds": float(case.get("time", 0))}
    report["steps"]["gpu_tests"]["nodes"] = nodes
    report["steps"]["gpu_tests"]["counts"] = {k: sum(n["outcome"] == k for n in nodes.values())
                                              for k in ("passed", "failure", "error", "skipped")}
table = work / "peak_memory.json"
if table.exists():
    report["peak_memory"] = json.loads(table.read_text())  # the benchmark's result, as its --json writes it
report["ok"] = bool(steps) and all(s["status"] == "passed" for s in report["steps"].values())
Path(out).write_text(json.dumps(report, indent=2) + "\n")
print(f"gpu_check: {'ok' if report['ok'] else 'NOT ok'} in {report['seconds']} s; {out}")
sys.exit(0 if report["ok"] else 1)
EOF
