"""Write a Hugging Face model folder from a checkpoint agentx can load (default: the embedded GGUF).

The vLLM and transformers peers load Hugging Face folders; this gives them the very weights agentx
runs (the GGUF dequantized to fp32 by agentx's own loader), so every engine of the benchmark
computes with the same numbers. Runs in agentx's venv:

    PYTHONPATH=. .venv/bin/python benchmarks/peers/export_hf.py [--model GGUF] [--out DIR]

Writes config.json, generation_config.json, model.safetensors (fp32, or --dtype),
tokenizer.json and tokenizer_config.json; prints the folder. The default folder is
``${AGENTX_PEERS_DIR:-~/.cache/agentx/peers}/models/<gguf stem>-hf``; an up-to-date folder is kept.
The code lives in ``agentx.engine.models.hf_export`` (the vLLM backend uses it too).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from agentx.engine.models.hf_export import _DTYPES, default_hf_dir, export
from agentx.engine.models.loader import default_model_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="GGUF file (default: embedded)")
    parser.add_argument("--out", type=Path, default=None, help="output folder")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    args = parser.parse_args()
    model = args.model or default_model_path()
    out = args.out or default_hf_dir(model, args.dtype)
    print(export(model, out, args.dtype), file=sys.stdout)


if __name__ == "__main__":
    main()
