#!/usr/bin/env bash
# One command for a GPU machine: the GPU tests and the kernel and engine benchmarks, within
# 555 seconds on one H200, every log and figure in one folder (docs/deployment.md, "On a GPU
# machine"). The machine needs torch, triton and transformers, and tools/gpu/wheels/ (made by
# tools/gpu/wheels.sh on a networked machine) for the rest: it needs no network.
#
#   bash tools/gpu/run.sh [--dry-run] [--out DIR] [--steps A,B] [--budget SECONDS] [--scale X]
#
#   --dry-run      every step, cheaply, on a CPU: the GPU tests skip, the benchmarks run tiny
#                  shapes with a request or two, the install resolves without installing
#   --out DIR      where the logs and figures go (default: $OUT if set, else
#                  tools/gpu/out/<timestamp>); under $OUT the logs are packed into logs.tar.gz
#   --steps A,B    only these steps (default: all; see STEPS below)
#   --budget S     seconds for all the steps together (default 555; 900 with --dry-run)
#   --scale X      engine_bench's request counts times X (default 1)
#
#   PYTHON=...              the interpreter that has torch (default python3; .venv's in a dry run)
#   RADIXLM_GPU_WHEELS=...  the wheels folder (default tools/gpu/wheels)
#
# Each step runs under `timeout` with its own share of the budget (never more than what is left),
# writes <step>.log, and the run carries on when one fails. The end prints a table (step,
# seconds, status) that summary.md and summary.json also hold, with the figures. Exit status:
# 0 when every step that ran is ok, 1 otherwise, 2 for bad arguments.
# shellcheck disable=SC2317  # the step functions run indirectly (declare -f, under timeout)
set -u -o pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT" || exit 2

# name:seconds on the GPU (they add up to 555):seconds in a dry run
STEPS=(
  "env:15:60"
  "install:60:120"
  "pytest-kernels:60:120"
  "pytest-runtime:50:180"
  "kernels-bench:65:120"
  "engine-graphs:110:240"
  "engine-eager:60:180"
  "tp-bench:60:120"
  "moe-bench:75:120"
)

usage() { sed -n '2,23p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

DRY_RUN=0 DIR="" ONLY="" BUDGET="" SCALE=1
while [ $# -gt 0 ]; do
  case $1 in
    --dry-run) DRY_RUN=1 ;;
    --out) DIR=${2:?--out needs a folder}; shift ;;
    --out=*) DIR=${1#--out=} ;;
    --steps) ONLY=${2:?--steps needs names}; shift ;;
    --steps=*) ONLY=${1#--steps=} ;;
    --budget) BUDGET=${2:?--budget needs seconds}; shift ;;
    --scale) SCALE=${2:?--scale needs a number}; shift ;;
    -h | --help) usage; exit 0 ;;
    *) echo "run.sh: unknown argument $1" >&2; usage >&2; exit 2 ;;
  esac
  shift
done
names=()
for entry in "${STEPS[@]}"; do names+=("${entry%%:*}"); done
if [ -n "$ONLY" ]; then
  for name in ${ONLY//,/ }; do
    case " ${names[*]} " in
      *" $name "*) ;;
      *) echo "run.sh: unknown step $name; the steps are: ${names[*]}" >&2; exit 2 ;;
    esac
  done
fi
case $BUDGET in "") BUDGET=$((DRY_RUN ? 900 : 555)) ;; *[!0-9]*) echo "run.sh: --budget takes whole seconds" >&2; exit 2 ;; esac

PACK=0
if [ -z "$DIR" ]; then
  if [ -n "${OUT:-}" ]; then DIR=$OUT; else DIR=$ROOT/tools/gpu/out/$(date +%Y%m%d-%H%M%S); fi
fi
mkdir -p "$DIR" || exit 2
DIR=$(cd "$DIR" && pwd)
# The device tool brings back at most 8 files from $OUT: the logs travel as one archive.
if [ -n "${OUT:-}" ] && [ -d "$OUT" ] && [ "$DIR" = "$(cd "$OUT" && pwd)" ]; then PACK=1; fi

if [ -z "${PYTHON:-}" ]; then
  PYTHON=python3
  if [ "$DRY_RUN" = 1 ] && [ -x "$ROOT/.venv/bin/python" ]; then PYTHON=$ROOT/.venv/bin/python; fi
fi
WHEELS=${RADIXLM_GPU_WHEELS:-$ROOT/tools/gpu/wheels}
STATE=$(mktemp -d "${TMPDIR:-/tmp}/radixlm-gpu.XXXXXX")
trap 'rm -rf "$STATE"' EXIT
export ROOT DIR DRY_RUN SCALE PYTHON WHEELS STATE
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

# ------------------------------------------------------------------------------------ steps
# Each runs in its own bash under timeout, with the variables above; $STATE/python, written by
# the install step, is the interpreter of the steps after it.

py() {
  local python
  python=$(cat "$STATE/python" 2>/dev/null || echo "$PYTHON")
  "$python" "$@"
}

step_env() {
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi
  else
    echo "nvidia-smi: not on this machine"
  fi
  local require=(--require-cuda)
  [ "$DRY_RUN" = 1 ] && require=()
  "$PYTHON" tools/gpu/environment.py report --json "$DIR/env.json" "${require[@]}"
}

step_install() {
  # A venv of its own that sees everything $PYTHON has (torch, triton, transformers), so pip
  # adds only what is missing, from the wheels folder alone, and can change nothing of $PYTHON's.
  # The folder is checked for the GPU machine's Python in a dry run, else for this one's.
  local target=3.12
  [ "$DRY_RUN" = 1 ] || target=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  if [ -d "$WHEELS" ]; then
    "$PYTHON" tools/gpu/environment.py check-wheels "$WHEELS" --python-version "$target" ||
      return 1
  elif [ "$DRY_RUN" = 1 ]; then
    echo "no wheels folder ($WHEELS): the dry run resolves against what is installed"
  else
    echo "no wheels folder ($WHEELS): run tools/gpu/wheels.sh on a machine with network and"
    echo "carry tools/gpu/wheels; trying with what is installed"
  fi
  local venv=$STATE/venv
  "$PYTHON" -m venv --without-pip --clear "$venv" || return 1
  local site
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  "$PYTHON" tools/gpu/environment.py site-dirs |
    sed "s/.*/import site; site.addsitedir('&')/" >"$site/_radixlm_gpu_base.pth"
  local where='import importlib.util as u; print(u.find_spec("torch").origin)'
  local want got
  want=$("$PYTHON" -c "$where") || return 1
  got=$("$venv/bin/python" -c "$where") || return 1
  if [ "$want" != "$got" ]; then
    echo "the new venv does not see $PYTHON's torch ($got, not $want)"
    return 1
  fi
  "$PYTHON" tools/gpu/environment.py pins >"$STATE/pins.txt"
  echo "kept as installed: $(tr '\n' ' ' <"$STATE/pins.txt")"
  local pip=("$venv/bin/python" -m pip install --disable-pip-version-check --no-index
    --find-links "$WHEELS" --constraint "$STATE/pins.txt")
  [ "$DRY_RUN" = 1 ] && pip+=(--dry-run)
  # From the checkout, not editable (that would need `editables` too); built by hatchling here.
  local ours=("./packages/sampling[dill]" ./packages/cache "./kernels[test]"
    "./packages/constrained[xgrammar,llguidance]" ./packages/runtime)
  if ! { "${pip[@]}" hatchling && "${pip[@]}" --no-build-isolation "${ours[@]}"; }; then
    # pip resolves through what is installed too; where that fails (say, the image has a
    # package older than something installed needs), add the missing ones without resolving.
    echo "pip could not resolve from the wheels folder: installing, unresolved, the wheels of"
    echo "what is not installed at all"
    local missing=()
    mapfile -t missing < <("$venv/bin/python" tools/gpu/environment.py missing-wheels "$WHEELS")
    if [ ${#missing[@]} -gt 0 ]; then "${pip[@]}" --no-deps "${missing[@]}" || return 1; fi
    "${pip[@]}" --no-deps --no-build-isolation "${ours[@]}" || return 1
  fi
  got=$("$venv/bin/python" -c 'import radixlm.runtime, radixlm.kernels, xgrammar, llguidance
import pytest, torch
print(torch.__file__)') || return 1
  [ "$want" = "$got" ] || { echo "torch moved: $got, not $want"; return 1; }
  echo "$venv/bin/python" >"$STATE/python"
  echo "the steps below run $venv/bin/python (torch from $got)"
}

# A dry run collects one file of each (collecting all of them is most of the time, and every
# GPU test skips on a CPU anyway): the command and its report are what it checks.
step_pytest_kernels() {
  local tests=kernels/tests
  [ "$DRY_RUN" = 1 ] && tests=kernels/tests/test_kernels_gpu.py
  py -m pytest -m gpu "$tests" -q --junitxml "$DIR/pytest-kernels.xml"
}

step_pytest_runtime() {
  local tests=packages/runtime/tests
  [ "$DRY_RUN" = 1 ] && tests=packages/runtime/tests/test_runtime_memory.py
  py -m pytest -m gpu "$tests" -q --junitxml "$DIR/pytest-runtime.xml"
}

step_kernels_bench() {
  if [ "$DRY_RUN" = 1 ]; then
    py tools/bench/kernels_bench.py --tiny --iters 1 --json "$DIR/kernels.json"
  else
    py tools/bench/kernels_bench.py --json "$DIR/kernels.json"
  fi
}

engine() {  # engine_bench at Llama-3.1-8B shapes (a dry run: the small shape, a request each)
  if [ "$DRY_RUN" = 1 ]; then
    py tools/bench/engine_bench.py --device cpu --shape quick --scale 0.01 --peers none \
      --skip-no-jump-forward --skip-no-cache "$@"
  else
    py tools/bench/engine_bench.py --device cuda --shape llama-3.1-8b --scale "$SCALE" \
      --peers none --skip-no-jump-forward --workloads few_shot,no_sharing "$@"
  fi
}

step_engine_graphs() {  # radixlm (with and without its cache) and transformers generate_batch
  local workloads=()
  [ "$DRY_RUN" = 1 ] && workloads=(--workloads no_sharing)
  engine "${workloads[@]}" --json "$DIR/engine-graphs.json"
}

step_engine_eager() {  # radixlm alone, decoding without CUDA graphs
  local workloads=()
  [ "$DRY_RUN" = 1 ] && workloads=(--workloads few_shot)
  engine "${workloads[@]}" --disable-cuda-graph --skip-transformers --skip-no-cache \
    --json "$DIR/engine-eager.json"
}

step_tp_bench() {  # tensor parallelism: TP=1 beside TP=2 (where two GPUs are visible)
  if [ "$DRY_RUN" = 1 ]; then
    py tools/bench/tp_bench.py --device cpu --quick --batch-sizes 1 --tokens 4 --json "$DIR/tp.json"
  else
    py tools/bench/tp_bench.py --device cuda --batch-sizes 1,8 --repeats 1 --json "$DIR/tp.json"
  fi
}

step_moe_bench() {  # Mixtral-8x7B's real shape: the fused MoE against the per-expert loop
  if [ "$DRY_RUN" = 1 ]; then
    py tools/bench/moe_bench.py --device cpu --hidden 64 --intermediate 224 --layers 2 \
      --vocab 1000 --batch-sizes 1,4 --max-new-tokens 4 --repeats 1 --json "$DIR/moe.json"
  else
    # 93 GB of dummy bfloat16 weights: transformers' copy would not fit beside them.
    py tools/bench/moe_bench.py --device cuda --preset mixtral-8x7b --skip-transformers \
      --batch-sizes 1,8,32 --max-new-tokens 16 --repeats 1 --json "$DIR/moe.json"
  fi
}

# ---------------------------------------------------------------------------------- driver

now_ms() {
  if [ -n "${EPOCHREALTIME:-}" ]; then
    local us=${EPOCHREALTIME/[.,]/}
    echo $((10#$us / 1000))
  else
    date +%s%3N
  fi
}
START_MS=$(now_ms)
: >"$STATE/steps.tsv"
failed=0
mode="GPU"
[ "$DRY_RUN" = 1 ] && mode="dry run (CPU)"
echo "radixlm GPU run: $mode; budget ${BUDGET}s; figures and logs in $DIR"
for entry in "${STEPS[@]}"; do
  IFS=: read -r name gpu_s dry_s <<<"$entry"
  if [ -n "$ONLY" ] && [[ ",$ONLY," != *",$name,"* ]]; then continue; fi
  share=$((DRY_RUN ? dry_s : gpu_s))
  left=$((BUDGET - ($(now_ms) - START_MS) / 1000))
  limit=$((share < left ? share : left))
  log=$DIR/$name.log
  if [ "$limit" -lt 5 ]; then
    echo "out of time: no budget left" >"$log"
    printf '%s\t0\tskipped\t-\t%s\n' "$name" "$limit" >>"$STATE/steps.tsv"
    echo "== $name: skipped (the budget is spent)"
    failed=1
    continue
  fi
  echo "== $name (at most ${limit}s) ..."
  fn=step_${name//-/_}
  begin=$(now_ms)
  timeout --kill-after=10 "$limit" bash -c "$(declare -f py engine "$fn"); $fn" >"$log" 2>&1
  rc=$?
  ms=$(($(now_ms) - begin))
  seconds=$((ms / 1000)).$(((ms % 1000) / 100))
  case $rc in
    0) status=ok ;;
    124 | 137) status=timeout ;;
    *) status=failed ;;
  esac
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$seconds" "$status" "$rc" "$limit" >>"$STATE/steps.tsv"
  echo "== $name: $status (${seconds}s)"
  if [ "$status" != ok ]; then
    failed=1
    tail -n 15 "$log" | sed 's/^/   | /'
  fi
done

total_ms=$(($(now_ms) - START_MS))
echo
if ! "$PYTHON" tools/gpu/summary.py "$DIR" --steps "$STATE/steps.tsv" --dry-run "$DRY_RUN" \
  --total "$((total_ms / 1000))" --packed "$PACK"; then
  echo "(summary.py failed; the steps as recorded:)"
  column -t -s $'\t' "$STATE/steps.tsv"
  failed=1
fi
if [ "$PACK" = 1 ]; then
  (
    cd "$DIR" || exit 1
    shopt -s nullglob
    # moe.json too: summary.md and summary.json already hold its figures, and the tool's 8
    # files are taken.
    logs=(*.log *.xml moe*.json)
    tar -czf logs.tar.gz -- "${logs[@]}" && rm -f -- "${logs[@]}"
  )
  echo "logs packed into $DIR/logs.tar.gz"
fi
exit "$failed"
