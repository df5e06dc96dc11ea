#!/usr/bin/env bash
# One-shot GPU check (issue 21), sized for 8 minutes on one H200. Parts, each under its own time limit; a failing part
# does not stop the others:
#   cuda_tests  pytest of every test file holding CUDA tests (tests/test_kernels.py today: kernel bit-exactness against
#               composer2.quant, tensor-core grouped GEMMs; found by _gpu_check.py tests-files). A GPU test that
#               skips on this machine (no cupy, no CUDA) counts as a failure.
#   gpu_bench   benchmarks/gpu_bench.py: quantize GB/s against a device copy of the same bytes, grouped-GEMM TFLOP/s
#               against torch's bf16 matmul of the same FLOPs, both baselines measured in the same run.
#   base_stage  profiles/gpu.yaml's data, tokenizer and base stages in a scratch workspace (params.yaml + the profile,
#               as `composer2 workspace gpu` overlays them), on a corpus built here from the Python standard library,
#               this repository's composer2/ and benchmarks/ sources and its Markdown files: no network, no DVC.
#               base runs --steps steps (default 300), capped by the time left; it passes with >= 50 finite losses
#               that fell by 10%.
# Time limits: cuda_tests 150 s, gpu_bench 100 s, base_stage what is left of --budget (480 s) less 15 s for the summary.
# Then ONE JSON summary: per part passed/error/figures/wall time, the GPU, torch/cupy versions (keys: README, GPU check).
#
# Usage: benchmarks/gpu_check.sh [JSON] [--json JSON] [--dry-run] [--steps N] [--budget SECONDS] [--parts LIST]
#                                [--workdir DIR] [--keep]
#   --workdir  scratch folder, kept (default: a temporary one, removed at the end unless --keep)
#   JSON       default $OUT/gpu_check.json when $OUT is set, else ./gpu_check.json
#   --dry-run  CPU plumbing check: collect (not run) the CUDA tests, gpu_bench.py at tiny sizes on the CPU (reference
#              path), and the base part with the smoke profile's sizes for 2 steps on the CPU; no GPU needed
#   --budget   total seconds (default 480); --parts  comma list of cuda_tests,gpu_bench,base_stage (default: all)
# Python: $PYTHON if set, else <repo>/.venv/bin/python (what `make install` builds), else python3 on PATH; it must
# import torch (a CUDA build for the real run), cupy and pytest. The checkout's composer2 is imported (PYTHONPATH=repo),
# and nothing is installed.
# Exit: 0 every part passed, 1 a part failed, 2 no CUDA device (refused; the JSON says so), 3 no usable python/torch,
# 64 bad arguments.
set -u -o pipefail
unset PYTEST_ADDOPTS    # the cuda_tests part reads pytest's own -q output: a caller's -v (say) must not change it

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(dirname "$HERE")
DRY=0; JSON=""; STEPS=""; BUDGET=480; WORK=""; KEEP=0; PARTS_SEL="cuda_tests,gpu_bench,base_stage"
RESERVE=15                                  # seconds kept for the summary
usage() { sed -n '2,/^set -u/p' "${BASH_SOURCE[0]}" | grep '^#' | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --json) JSON=${2:?--json needs a path}; shift ;;
    --json=*) JSON=${1#*=} ;;
    --steps) STEPS=${2:?}; shift ;;
    --budget) BUDGET=${2:?}; shift ;;
    --parts) PARTS_SEL=${2:?}; shift ;;
    --workdir) WORK=${2:?}; shift ;;
    --keep) KEEP=1 ;;
    -h|--help) usage; exit 0 ;;
    -*) echo "gpu_check: unknown option $1 (see --help)" >&2; exit 64 ;;
    *) JSON=$1 ;;
  esac
  shift
done
case "$BUDGET$STEPS" in *[!0-9]*) echo "gpu_check: --budget and --steps take whole numbers" >&2; exit 64 ;; esac
for p in ${PARTS_SEL//,/ }; do
  case "$p" in cuda_tests|gpu_bench|base_stage) ;; *) echo "gpu_check: unknown part '$p' (parts: cuda_tests, gpu_bench, base_stage)" >&2; exit 64 ;; esac
done
if [ -z "$JSON" ]; then if [ -n "${OUT:-}" ]; then JSON=$OUT/gpu_check.json; else JSON=$PWD/gpu_check.json; fi; fi
case "$JSON" in /*) ;; *) JSON=$PWD/$JSON ;; esac
mkdir -p "$(dirname "$JSON")" || exit 64
MODE=gpu; [ $DRY = 1 ] && MODE=dry
[ -n "$STEPS" ] || { [ $DRY = 1 ] && STEPS=2 || STEPS=300; }
STARTED=$(date -u +%Y-%m-%dT%H:%M:%SZ)
T0=$SECONDS

# A summary without python (none found, or it cannot even start): status and message only.
bare_json() {  # status message exit_code
  local msg=${2//\\/\\\\}; msg=${msg//\"/\\\"}
  printf '{"schema": "composer2.gpu_check/1", "mode": "%s", "status": "%s", "error": "%s", "exit_code": %s, "started_utc": "%s", "parts": {}}\n' \
    "$MODE" "$1" "$msg" "$3" "$STARTED" >"$JSON"
  echo "gpu_check: $1: $2 -> $JSON" >&2
  exit "$3"
}

if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x "$REPO/.venv/bin/python" ]; then PY=$REPO/.venv/bin/python
else PY=$(command -v python3 || true); fi
[ -n "$PY" ] && "$PY" -c 'import json' 2>/dev/null || bare_json env_error "no python: set PYTHON, or run 'make install' to build $REPO/.venv" 3
command -v timeout >/dev/null || bare_json env_error "the 'timeout' command (coreutils) is missing" 3
export PATH="$(dirname "$PY"):$PATH" PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

# Scratch space (logs, the workspace, its checkpoint): a fresh temporary folder, removed at the end unless --keep;
# a --workdir folder is kept (only its parts/ and ws/ are rewritten).
if [ -n "$WORK" ]; then mkdir -p "$WORK" && KEEP=1; else WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX"); fi
WORK=$(cd "$WORK" && pwd)
PARTS=$WORK/parts; rm -rf "$PARTS"; mkdir -p "$PARTS"
cleanup() { [ $KEEP = 1 ] || rm -rf "$WORK"; }
trap cleanup EXIT
NAMES=()

merge() {  # extra merge flags
  "$PY" "$HERE/_gpu_check.py" merge --out "$JSON" --parts "$PARTS" --mode "$MODE" --started "$STARTED" \
    --wall $((SECONDS - T0)) --budget "$BUDGET" --names ${NAMES[@]+"${NAMES[@]}"} "$@"
}

# ---- preflight: python, torch, cupy, the GPU
timeout -k 5 120 "$PY" "$HERE/_gpu_check.py" env --out "$PARTS/env.json"; ENV_RC=$?
if [ $ENV_RC = 124 ] || [ $ENV_RC = 137 ]; then
  bare_json env_error "$PY did not report torch and the GPU within 120 s (a hung driver?)" 3
fi
if [ $ENV_RC = 3 ] || [ ! -s "$PARTS/env.json" ]; then
  bare_json env_error "$PY cannot import torch (run 'make install', or set PYTHON to a python that has the repository's requirements)" 3
fi
if [ $ENV_RC = 2 ] && [ $DRY = 0 ]; then
  echo "gpu_check: refusing to run: no CUDA device. $("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1])).get("no_cuda_reason", ""))' "$PARTS/env.json")." >&2
  echo "gpu_check: run it on a machine with an NVIDIA GPU and a CUDA build of torch, or pass --dry-run for the CPU plumbing check." >&2
  merge --refused; exit 2
fi
"$PY" -c 'import json,sys; e=json.load(open(sys.argv[1])); print("gpu_check: %s, torch %s, cupy %s, python %s" % (e.get("gpu_name", "no GPU (dry run)"), e.get("torch"), e.get("cupy"), e.get("python")))' "$PARTS/env.json"

now() { date +%s.%N; }
want() { case ",$PARTS_SEL," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }

# run_part NAME CAP CMD...: CMD under `timeout`, limited to CAP seconds and to what the budget has left.
run_part() {
  local name=$1 cap=$2; shift 2
  local left=$((BUDGET - (SECONDS - T0) - RESERVE)) limit=$cap log=$WORK/$name.log rc t1
  [ $left -lt $limit ] && limit=$left
  NAMES+=("$name")
  if [ $limit -lt 10 ]; then
    printf 'rc=124\nwall_s=0\nlimit_s=%s\ncmd=%s\nskipped=not run: the %ss budget was spent\n' "$limit" "$*" "$BUDGET" >"$PARTS/$name.run"
    echo "== $name: not run (budget spent)"; return 124
  fi
  echo "== $name (limit ${limit}s)"
  t1=$(now)
  ( cd "$REPO" && timeout -k 10 "$limit" "$@" ) >"$log" 2>&1; rc=$?
  printf 'rc=%s\nwall_s=%s\nlimit_s=%s\ncmd=%s\nlog=%s\n' "$rc" "$(awk -v a="$t1" -v b="$(now)" 'BEGIN{printf "%.2f", b - a}')" "$limit" "$*" "$log" >"$PARTS/$name.run"
  tail -n 4 "$log" | sed 's/^/   /'
  echo "   -> rc $rc"
  return $rc
}

if want cuda_tests; then
  mapfile -t FILES < <("$PY" "$HERE/_gpu_check.py" tests-files)
  if [ ${#FILES[@]} = 0 ]; then    # never let pytest fall back to the whole suite
    NAMES+=(cuda_tests); printf 'rc=1\nwall_s=0\nskipped=no test file with CUDA tests found under tests/\n' >"$PARTS/cuda_tests.run"
  elif [ $DRY = 1 ]; then
    run_part cuda_tests 120 "$PY" -m pytest -q --collect-only -p no:cacheprovider "${FILES[@]}"; rc=$?
    "$PY" "$HERE/_gpu_check.py" tests --mode dry --log "$WORK/cuda_tests.log" --rc $rc --out "$PARTS/cuda_tests.json"
  else
    run_part cuda_tests 150 "$PY" -m pytest -q -rs -p no:cacheprovider --junitxml="$WORK/cuda_tests.xml" "${FILES[@]}"; rc=$?
    "$PY" "$HERE/_gpu_check.py" tests --mode gpu --junit "$WORK/cuda_tests.xml" --log "$WORK/cuda_tests.log" --rc $rc --out "$PARTS/cuda_tests.json"
  fi
fi

if want gpu_bench; then
  if [ $DRY = 1 ]; then run_part gpu_bench 100 "$PY" "$HERE/gpu_bench.py" --tiny --device cpu --json "$PARTS/gpu_bench.json"
  else run_part gpu_bench 100 "$PY" "$HERE/gpu_bench.py" --json "$PARTS/gpu_bench.json"; fi
fi

if want base_stage; then
  left=$((BUDGET - (SECONDS - T0) - RESERVE))
  # the helper caps the stages itself 15 s before the outer limit, so a capped run still reports its steps
  run_part base_stage "$left" "$PY" "$HERE/_gpu_check.py" base --mode "$MODE" --work "$WORK" --steps "$STEPS" \
    --budget $((left - 15)) --out "$PARTS/base_stage.json"
fi

merge; exit $?
