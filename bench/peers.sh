#!/usr/bin/env bash
# Build the peers bench/throughput.py compares against, outside the tracked tree:
#   bench/.peers/llama-server   llama.cpp's C++ server, built from the llama.cpp that
#                               the llama-cpp-python sdist vendors (same version as ours)
#   bench/.peers/example-venv   a venv for the sdist's examples/server/server.py
# Idempotent: each part is skipped when present. About 7 minutes on 2 cores the first time.
set -euo pipefail
cd "$(dirname "$0")"
PEERS="$PWD/.peers"
VERSION="$(../.venv/bin/python -c 'import llama_cpp; print(llama_cpp.__version__)')"
mkdir -p "$PEERS"
SDIST_DIR="$PEERS/llama_cpp_python-$VERSION"
if [ ! -d "$SDIST_DIR" ]; then
    ../.venv/bin/python -m pip download -q --no-deps --no-binary :all: -d "$PEERS" "llama-cpp-python==$VERSION"
    tar -xzf "$PEERS/llama_cpp_python-$VERSION.tar.gz" -C "$PEERS"
fi
if [ ! -x "$PEERS/llama-server" ]; then
    cmake -S "$SDIST_DIR/vendor/llama.cpp" -B "$PEERS/build" -DCMAKE_BUILD_TYPE=Release \
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF \
        -DCMAKE_C_FLAGS="${LLAMA_CFLAGS:-}" -DCMAKE_CXX_FLAGS="${LLAMA_CFLAGS:-}" > "$PEERS/cmake.log"
    cmake --build "$PEERS/build" --target llama-server -j "$(nproc)" > "$PEERS/build.log"
    cp "$PEERS/build/bin/llama-server" "$PEERS/llama-server"
fi
if [ ! -x "$PEERS/example-venv/bin/python" ]; then
    python3 -m venv "$PEERS/example-venv"
    "$PEERS/example-venv/bin/python" -m pip install -q --upgrade pip
    # The same llama-cpp-python build as ours (make install's wheel, with its flags).
    "$PEERS/example-venv/bin/python" -m pip install -q -c ../constraints.txt ${WHEELS:+--find-links "$WHEELS" --only-binary llama-cpp-python} "llama-cpp-python==$VERSION" \
        fastapi uvicorn openai pydantic safetensors websockets jinja2 numpy
fi
cp "$SDIST_DIR/examples/server/server.py" "$PEERS/example_server.py"
echo "LLAMA_SERVER_BIN=$PEERS/llama-server"
echo "LLAMA_CPP_PYTHON_EXAMPLE_SERVER=$PEERS/example_server.py"
