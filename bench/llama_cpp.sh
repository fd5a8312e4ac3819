#!/usr/bin/env bash
# Build llama.cpp's llama-server for bench.peers (--llama-server PATH), from the llama.cpp source
# vendored in the PyPI sdist of llama-cpp-python 0.3.36 (llama.cpp commit 0c1e57098): Release,
# native CPU, without the web UI or OpenSSL. About 20 minutes on two cores. It needs CMake and
# Ninja (Debian's cmake and ninja-build, installed here when missing and run as root).
#
#   bash bench/llama_cpp.sh [WORK_DIR]      # default .test-cache/llama.cpp; prints the binary's path
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v cmake >/dev/null || ! command -v ninja >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get install -y -q cmake ninja-build >&2 || (apt-get update -q && apt-get install -y -q cmake ninja-build) >&2
    else
        echo "bench/llama_cpp.sh needs cmake and ninja (apt install cmake ninja-build)" >&2
        exit 1
    fi
fi
work="${1:-.test-cache/llama.cpp}"
mkdir -p "$work"
work="$(cd "$work" && pwd)"
src="$work/llama_cpp_python-0.3.36/vendor/llama.cpp"
bin="$src/build/bin/llama-server"
if [ -x "$bin" ]; then
    echo "$bin"
    exit 0
fi
if [ ! -d "$src" ]; then
    pip="${PIP:-.venv/bin/pip}"
    "$pip" download --quiet --no-binary :all: --no-deps llama-cpp-python==0.3.36 -d "$work" >&2
    tar -xzf "$work/llama_cpp_python-0.3.36.tar.gz" -C "$work"
fi
echo "building llama-server in $src/build (about 20 minutes on two cores)" >&2
cmake -S "$src" -B "$src/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON >&2
cmake --build "$src/build" --target llama-server -j "$(nproc)" >&2
echo "$bin"
