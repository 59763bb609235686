#!/usr/bin/env bash
# llama.cpp's command-line tools, built from the tree inside llama-cpp-python's PyPI sdist, for the GGUF
# acceptance test (tests/test_gguf_llama_cpp.py) and the GGUF benchmark. Only the tools those need are
# built (llama-perplexity, llama-quantize, llama-imatrix, llama-simple), CPU only, at low priority on two
# jobs because the machine is shared; beside them quantkit-llama-score, our scorer for
# `quantkit eval --backend llama.cpp` (quantkit/evaluate/llama_cpp_score.cpp), linked against the same static
# libraries. The build lives outside the repo, in ${QUANTKIT_LLAMA_CPP_CACHE:-~/.cache/quantkit}/llama.cpp-VERSION-ISA;
# an existing build is kept (the scorer is recompiled when its source is newer than it).
# Prints the folder holding the binaries on its last line.
# --find: build nothing; print that folder when everything is built there, else exit 1 (quantkit eval asks so).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
VERSION="${QUANTKIT_LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
CACHE="${QUANTKIT_LLAMA_CPP_CACHE:-$HOME/.cache/quantkit}"
# GGML_NATIVE builds for this CPU's instruction set, so the cache is keyed by it: a home folder shared by
# machines of another CPU kind (AMX or not, AVX-512 or not) gets a build of its own, never one that faults
ISA="$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | tr ' ' '\n' | sort | tr -d '\n' | md5sum | cut -c1-8)"
ROOT="$CACHE/llama.cpp-$VERSION-${ISA:-generic}"
BIN="$ROOT/build/bin"
TOOLS=(llama-perplexity llama-quantize llama-imatrix llama-simple)
SCORER_SRC="$PWD/quantkit/evaluate/llama_cpp_score.cpp"
SCORER="$BIN/quantkit-llama-score"

have_all() { for t in "${TOOLS[@]}"; do [ -x "$BIN/$t" ] || return 1; done; }
have_scorer() { [ -x "$SCORER" ] && ! [ "$SCORER_SRC" -nt "$SCORER" ]; }
# a few seconds: one source file against the libraries the tools' build left in build/
build_scorer() {
  local b="$ROOT/build"
  nice -n 19 "${CXX:-c++}" -O2 -std=c++17 -I"$ROOT/src/include" -I"$ROOT/src/ggml/include" "$SCORER_SRC" \
    "$b/src/libllama.a" "$b/ggml/src/libggml.a" "$b/ggml/src/libggml-cpu.a" "$b/ggml/src/libggml-base.a" \
    -ldl -lm -fopenmp -lpthread -o "$SCORER.tmp" >&2
  mv "$SCORER.tmp" "$SCORER"
}
if [ "${1:-}" = "--find" ]; then have_all && have_scorer && echo "$BIN" && exit 0; exit 1; fi
if have_all; then have_scorer || build_scorer; echo "$BIN"; exit 0; fi

mkdir -p "$ROOT"
if [ ! -f "$ROOT/src/CMakeLists.txt" ]; then
  tmp="$(mktemp -d)"
  # --no-binary for this one package only: with :all: pip would also compile cmake from source
  # to read the sdist's metadata.
  "$PY" -m pip download -q --no-deps --no-binary llama-cpp-python -d "$tmp" "llama-cpp-python==$VERSION" >&2
  tar -xzf "$tmp"/llama_cpp_python-"$VERSION".tar.gz -C "$tmp"
  rm -rf "$ROOT/src"
  mv "$tmp/llama_cpp_python-$VERSION/vendor/llama.cpp" "$ROOT/src"
  rm -rf "$tmp"
fi
command -v cmake >/dev/null && command -v ninja >/dev/null || "$PY" -m pip install -q cmake ninja >&2
nice -n 19 cmake -S "$ROOT/src" -B "$ROOT/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=OFF >&2
nice -n 19 cmake --build "$ROOT/build" -j 2 --target "${TOOLS[@]}" >&2
have_all || { echo "llama.cpp build finished without all of ${TOOLS[*]} in $BIN" >&2; exit 1; }
have_scorer || build_scorer
echo "$BIN"
