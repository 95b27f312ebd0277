#!/usr/bin/env bash
# The wheels a bare GPU machine lacks, fetched on a CPU machine with network, for benchmarks/gpu_install.py to
# install there with no registry (docs/gpu.md).
#
#   benchmarks/gpu_wheels.sh [DEST]        DEST defaults to wheels/ at the repository root (ignored by git)
#
# The GPU image (Python 3.12, x86-64, torch and transformers of its own) has everything the proof imports, but
# not what `lockstep serve` needs: pyzmq (the ZeroMQ front door), fastapi and uvicorn (the HTTP gateway), and
# maybe setuptools (for `pip install -e .`). This downloads them and everything they depend on, resolved by pip
# for CPython 3.12 on manylinux x86-64 (so pydantic and pydantic-core come as the matching pair), replacing any
# wheels DEST held before. Then it checks that the folder alone installs them into an empty target (no index),
# prints the total size, and fails if it is over 64 MiB (what a device run may carry).
# The device tool carries an ignored folder only when asked: run the proof with carry=["wheels"].
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${1:-$ROOT/wheels}"
PY="${PYTHON:-$(command -v python3 || command -v python)}"
LIMIT_MIB=64
PACKAGES=(pyzmq fastapi uvicorn setuptools)
TARGET=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312
        --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64)

mkdir -p "$DEST"
rm -f "$DEST"/*.whl
"$PY" -m pip download --disable-pip-version-check "${TARGET[@]}" --dest "$DEST" "${PACKAGES[@]}"

check="$(mktemp -d)"
trap 'rm -rf "$check"' EXIT
"$PY" -m pip install --disable-pip-version-check --dry-run --ignore-installed --no-index --find-links "$DEST" \
  "${TARGET[@]}" --target "$check" "${PACKAGES[@]}" >"$check/log" 2>&1 \
  || { cat "$check/log" >&2; echo "gpu_wheels: $DEST does not install ${PACKAGES[*]} on its own" >&2; exit 1; }

ls -1 "$DEST"/*.whl | sed "s|^$DEST/|  |"
bytes=$(cat "$DEST"/*.whl | wc -c)
mib=$(awk -v b="$bytes" 'BEGIN { printf "%.1f", b / 1048576 }')
echo "gpu_wheels: $(ls "$DEST"/*.whl | wc -l) wheels, $mib MiB in $DEST (limit $LIMIT_MIB MiB)"
if [ "$bytes" -gt $((LIMIT_MIB * 1048576)) ]; then
  echo "gpu_wheels: over $LIMIT_MIB MiB: a device run could not carry them" >&2
  exit 1
fi
