#!/usr/bin/env bash
# Hugging Face transformers peer (CPU, fp32). Idempotent; prints the venv path.
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$HERE/_venv.sh" hf
if ! "$PY" -c "import transformers, safetensors, tokenizers" 2>/dev/null; then
    pip_install -c "$CONSTRAINTS" transformers safetensors tokenizers
fi
echo "$VENV"
