"""Write a Hugging Face model folder from a checkpoint agentx can load (default: the embedded GGUF).

The vLLM and transformers peers load Hugging Face folders; this gives them the very weights agentx
runs (the GGUF dequantized to fp32 by agentx's own loader), so every engine of the benchmark
computes with the same numbers. Runs in agentx's venv:

    PYTHONPATH=. .venv/bin/python benchmarks/peers/export_hf.py [--model GGUF] [--out DIR]

Writes config.json, generation_config.json, model.safetensors (fp32, or --dtype),
tokenizer.json and tokenizer_config.json; prints the folder. The default folder is
``${AGENTX_PEERS_DIR:-~/.cache/agentx/peers}/models/<gguf stem>-hf``; an up-to-date folder is kept.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from agentx.engine.models.loader import Checkpoint, default_model_path, load_checkpoint

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_STAMP = "agentx_export.json"  # what the folder was written from; a match skips the export


def peers_dir() -> Path:
    return Path(os.environ.get("AGENTX_PEERS_DIR", Path.home() / ".cache/agentx/peers"))


def hf_config(ckpt: Checkpoint, dtype: str) -> dict:
    spec = ckpt.spec
    if (
        spec.architecture != "llama"
        or spec.layer_types
        and set(spec.layer_types) != {"full_attention"}
    ):
        raise SystemExit(f"export_hf: only full-attention Llama checkpoints, got {spec}")
    config = {
        "architectures": ["Qwen2ForCausalLM" if spec.attention_bias else "LlamaForCausalLM"],
        "model_type": "qwen2" if spec.attention_bias else "llama",
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "rope_scaling": _rope_scaling(spec.rope_scaling),
        "tie_word_embeddings": spec.tie_word_embeddings,
        "attention_bias": spec.attention_bias,
        "mlp_bias": False,
        "bos_token_id": ckpt.tokenizer.bos_token_id,
        "eos_token_id": ckpt.tokenizer.eos_token_id,
        "torch_dtype": dtype,
        "use_cache": True,
    }
    return config


def _rope_scaling(scaling) -> dict | None:
    if scaling is None:
        return None
    if scaling.kind == "linear":
        return {"rope_type": "linear", "factor": scaling.factor}
    return {
        "rope_type": "llama3",
        "factor": scaling.factor,
        "low_freq_factor": scaling.low_freq_factor,
        "high_freq_factor": scaling.high_freq_factor,
        "original_max_position_embeddings": scaling.original_max_position,
    }


def tokenizer_config(ckpt: Checkpoint) -> dict:
    tok = ckpt.tokenizer
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "unk_token": tok.eos_token,
        "pad_token": tok.eos_token,
        "add_bos_token": tok.add_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": ckpt.spec.max_position,
        "chat_template": tok.chat_template,
    }


def generation_config(ckpt: Checkpoint) -> dict:
    eos = sorted(ckpt.tokenizer.eos_token_ids)
    return {
        "bos_token_id": ckpt.tokenizer.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else eos,
        "do_sample": False,
    }


def export(model: Path, out: Path, dtype: str) -> Path:
    stamp = {"source": str(model.resolve()), "mtime_ns": model.stat().st_mtime_ns, "dtype": dtype}
    stamp_file = out / _STAMP
    if stamp_file.is_file() and json.loads(stamp_file.read_text()) == stamp:
        return out
    ckpt = load_checkpoint(model, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    weights = {name: t.to(_DTYPES[dtype]).contiguous() for name, t in ckpt.weights.items()}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out / "config.json", hf_config(ckpt, dtype))
    _write_json(out / "generation_config.json", generation_config(ckpt))
    _write_json(out / "tokenizer_config.json", tokenizer_config(ckpt))
    ckpt.tokenizer.backend.save(str(out / "tokenizer.json"))
    _write_json(stamp_file, stamp)  # last: a half-written folder is re-exported next time
    return out


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="GGUF file (default: embedded)")
    parser.add_argument("--out", type=Path, default=None, help="output folder")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    args = parser.parse_args()
    model = args.model or default_model_path()
    suffix = "" if args.dtype == "float32" else f"-{args.dtype}"
    out = args.out or peers_dir() / "models" / f"{model.stem}-hf{suffix}"
    print(export(model, out, args.dtype), file=sys.stdout)


if __name__ == "__main__":
    main()
