#!/usr/bin/env bash
# Build the llama-cpp-python wheel `make install` uses: the pinned sdist, with every patch
# in this folder applied to the llama.cpp it vendors, compiled for this CPU.
#   usage: build_wheel.sh PYTHON WHEEL_DIR        (CMAKE_ARGS as for pip)
# Patches are ordered by name; one that does not apply stops the build.
set -euo pipefail
PY="$1"
OUT="$2"
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../../.." && pwd)"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
"$PY" -m pip download -q --no-deps --no-binary :all: -c "$ROOT/constraints.txt" -d "$WORK" llama-cpp-python
tar -xzf "$WORK"/llama_cpp_python-*.tar.gz -C "$WORK"
SRC="$(find "$WORK" -maxdepth 1 -type d -name 'llama_cpp_python-*' | head -n 1)"
for p in "$HERE"/*.patch; do
    git -C "$SRC" apply --whitespace=nowarn "$p"
    echo "applied $(basename "$p")"
done
mkdir -p "$OUT"
# The compile is silent for minutes: say what it is, and that it goes on, every 30 s.
echo "building llama-cpp-python (llama.cpp) for this CPU: about 5 minutes on 2 cores, once"
echo "per CPU and patch set"
bash "$HERE/with_progress.sh" "$WORK/build.log" "$PY" -m pip wheel -v --no-deps --no-cache-dir -w "$OUT" "$SRC"
