#!/usr/bin/env bash
# Serve a GGUF model with llama.cpp's llama-server (continuous batching, 16 slots), as a peer.
# usage: llama_server.sh GGUF_FILE [PORT] [SLOTS]
# Builds once (about 10 min on 2 cores) from the llama.cpp sources inside the llama-cpp-python
# source package on PyPI, into $PEERS_DIR/llama.cpp (default /tmp/peers): llama-server, and
# llama-quantize / llama-perplexity / llama-batched-bench beside it. The same tree holds
# convert_hf_to_gguf.py (HF folder -> GGUF; its Llama path imports sentencepiece, so install that
# into the Python you run it with).
set -euo pipefail
gguf=${1:?GGUF_FILE}; port=${2:-8102}; slots=${3:-16}
root=${PEERS_DIR:-/tmp/peers}; src=$root/llama.cpp
mkdir -p "$root"
if [ ! -x "$src/build/bin/llama-server" ] || [ ! -x "$src/build/bin/llama-quantize" ]; then
  command -v cmake >/dev/null && command -v ninja >/dev/null || { apt-get update -q && apt-get install -y -q cmake ninja-build; }
  if [ ! -f "$src/CMakeLists.txt" ]; then
  tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps --no-binary :all: -d "$tmp" llama-cpp-python
  tar -xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp"
  rm -rf "$src"; mv "$tmp"/llama_cpp_python-*/vendor/llama.cpp "$src"
  fi
  # LLAMA_USE_PREBUILT_UI=OFF: the default downloads a web UI, which fails on an offline machine
  cmake -S "$src" -B "$src/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF -DGGML_NATIVE=ON -DLLAMA_CURL=OFF
  cmake --build "$src/build" --target llama-server llama-batched-bench llama-quantize llama-perplexity -j 2
fi
exec "$src/build/bin/llama-server" -m "$gguf" -t 2 -np "$slots" -cb -c $((slots * 2048)) \
  --host 127.0.0.1 --port "$port"
