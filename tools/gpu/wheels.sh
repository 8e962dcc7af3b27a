#!/usr/bin/env bash
# Fetch, on a machine with network, the wheels that tools/gpu/run.sh installs on the GPU machine
# (which has none): tools/gpu/requirements.txt for CPython 3.12 on manylinux x86_64, into
# tools/gpu/wheels/ (ignored by git; carry it to the GPU machine). Fails if the folder passes
# 60 MB, or if radixlm's packages would still miss a dependency there.
#
#   bash tools/gpu/wheels.sh [--dest DIR] [--python-version 3.12]
#
# --python-version 3.11 fetches the same set for this machine's Python, to rehearse run.sh's
# install step here (see docs/deployment.md).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
DEST=$ROOT/tools/gpu/wheels
PY_VERSION=3.12
LIMIT_MB=60
while [ $# -gt 0 ]; do
  case $1 in
    --dest) DEST=$2; shift ;;
    --python-version) PY_VERSION=$2; shift ;;
    -h | --help) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "wheels.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
if [ -z "${PYTHON:-}" ]; then
  PYTHON=python3
  [ -x "$ROOT/.venv/bin/python" ] && PYTHON=$ROOT/.venv/bin/python
fi

# pip matches manylinux_2_N exactly: offer every glibc a wheel may name.
platforms=()
for n in $(seq 17 39); do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)

fresh="$DEST.partial"
rm -rf "$fresh"
mkdir -p "$fresh"
echo "fetching tools/gpu/requirements.txt for CPython $PY_VERSION (manylinux x86_64) ..."
"$PYTHON" -m pip download --disable-pip-version-check --quiet --no-deps --only-binary=:all: \
  --implementation cp --python-version "$PY_VERSION" "${platforms[@]}" \
  -r "$ROOT/tools/gpu/requirements.txt" -d "$fresh"

bytes=$(du -sb "$fresh" | cut -f1)
mb=$((bytes / 1000000))
if [ "$bytes" -ge $((LIMIT_MB * 1000000)) ]; then
  echo "wheels.sh: FAILED: the wheels take ${mb} MB, over the ${LIMIT_MB} MB that may be carried" >&2
  du -b "$fresh"/*.whl | sort -rn | head -5 >&2
  exit 1
fi
if ! "$PYTHON" "$ROOT/tools/gpu/environment.py" check-wheels "$fresh" --python-version "$PY_VERSION"; then
  echo "wheels.sh: FAILED: add what is missing to tools/gpu/requirements.txt" >&2
  exit 1
fi
rm -rf "$DEST"
mv "$fresh" "$DEST"
echo "wheels.sh: $(find "$DEST" -name '*.whl' | wc -l) wheels, ${mb} MB in ${DEST#"$ROOT"/}"
case $DEST in
  "$ROOT"/*) echo "(device tool: carry [\"${DEST#"$ROOT"/}\"] and run: bash tools/gpu/run.sh)" ;;
  *) echo "(run.sh reads them with RADIXLM_GPU_WHEELS=$DEST)" ;;
esac
