#!/usr/bin/env bash
# The two-process tests N times in a row beside two CPU-bound processes (a loaded machine), each round's pass count
# and wall time, and a check that no test process outlived its round.
# Usage: bash scripts/stress_distributed.sh [ROUNDS] [PYTEST TARGETS...]
#   default: 10 rounds of tests/test_distributed.py and the two 2-process all_reduce tests
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
ROUNDS=${1:-10}
shift || true
TARGETS=("$@")
if [ ${#TARGETS[@]} -eq 0 ]; then
  TARGETS=(tests/test_distributed.py "tests/test_mismatch.py::test_all_reduce_on_two_real_processes"
           "tests/test_ratios.py::test_all_reduce_on_two_real_processes")
fi
export HF_HUB_OFFLINE=1 WANDB_MODE=offline PYTHONPATH=$PWD
"$PY" -c "while True: pass" & HOG1=$!
"$PY" -c "while True: pass" & HOG2=$!
trap 'kill "$HOG1" "$HOG2" 2>/dev/null' EXIT
echo "load: 2 CPU-bound processes (pids $HOG1 $HOG2) on $(nproc) cores; $(uptime)"
ok=0
for i in $(seq 1 "$ROUNDS"); do
  start=$(date +%s)
  base=$(mktemp -d)
  "$PY" -m pytest -q -p no:cacheprovider --basetemp "$base" "${TARGETS[@]}" > "$base.log" 2>&1
  rc=$?
  out=$(tail -1 "$base.log")
  # no process of the round left: nothing running a harness of this checkout or a script of this round's tmp dir
  left=$(pgrep -f "$PWD/tests/|$base" | tr '\n' ' ')
  rm -rf "$base" "$base.log"
  [ "$rc" -eq 0 ] && [ -z "$left" ] && ok=$((ok + 1))
  echo "round $i: rc=$rc $(( $(date +%s) - start )) s: $out; left behind: ${left:-none}"
done
echo "passed $ok of $ROUNDS rounds"
