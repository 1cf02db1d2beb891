#!/usr/bin/env bash
# Run here (a machine with PyPI and the dev venv), before benchmarks/gpu/check.sh is sent to the
# GPU machine: fills .gpu-payload/ (git-ignored; name it in the device run's `carry`) with
#   wheels/      agentx's Python dependencies the GPU image lacks, for its CPython 3.12
#   tokenizer/   SmolLM2's tokenizer as a Hugging Face folder (tokenizer.json + config), which
#                the random-weight checkpoints check.sh writes there use
# The SmolLM2 GGUF itself (94 MB) is over the device tool's 64 MiB transfer limit, so the GPU
# benchmarks use random weights of SmolLM2-135M's shape: speed does not depend on the values.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
OUT=.gpu-payload
rm -rf "$OUT" && mkdir -p "$OUT/wheels" "$OUT/tokenizer"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
	--implementation cp --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	--platform manylinux2014_x86_64 -d "$OUT/wheels" \
	pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
	gguf==0.19.0 llguidance==1.9.1 pytest-asyncio==1.5.0
"$PY" - "$OUT/tokenizer" <<'PYEOF'
import sys

import transformers

from agentx.engine.models.loader import load_checkpoint

folder = sys.argv[1]
tokenizer = load_checkpoint(None).tokenizer
hf = transformers.PreTrainedTokenizerFast(
    tokenizer_object=tokenizer.backend, bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token
)
hf.chat_template = tokenizer.chat_template
hf.save_pretrained(folder)
PYEOF
du -sh "$OUT"
