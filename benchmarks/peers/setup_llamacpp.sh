#!/usr/bin/env bash
# llama.cpp peer: llama-cpp-python compiled from source for this CPU (native, AVX-512 where present).
# Idempotent; prints the venv path. The compile takes ~17 minutes on 2 cores.
# Env: LLAMACPP_VERSION (default 0.3.36), AGENTX_BUILD_JOBS (default 2).
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$HERE/_venv.sh" llamacpp
VERSION="${LLAMACPP_VERSION:-0.3.36}"
# The peer only needs numpy + the extension; torch is pinned for uniformity and for export checks.
if ! "$PY" -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$VERSION')" 2>/dev/null; then
    # Native, except AMX: 0.3.36's AMX int8 path segfaults on the first forward on this VM
    # (Xeon with amx_int8; 2026-12-02), so the flags name the vector extensions and leave AMX off.
    # Where the CPU lacks AVX-512, set CMAKE_ARGS="-DGGML_NATIVE=ON ..." instead.
    if grep -q amx_int8 /proc/cpuinfo 2>/dev/null; then
        ISA="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
    else
        ISA="-DGGML_NATIVE=ON"
    fi
    export CMAKE_ARGS="${CMAKE_ARGS:-$ISA -DGGML_OPENMP=ON -DGGML_BLAS=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF}"
    export CMAKE_BUILD_PARALLEL_LEVEL="${AGENTX_BUILD_JOBS:-2}"
    pip_install -c "$CONSTRAINTS" --no-cache-dir --no-binary llama-cpp-python "llama-cpp-python==$VERSION"
fi
# gguf writes the f16/f32 GGUF for the like-for-like run (benchmarks/peers/convert_gguf.py).
"$PY" -c "import gguf" 2>/dev/null || pip_install -c "$CONSTRAINTS" gguf numpy
echo "$VENV"
