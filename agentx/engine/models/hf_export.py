"""Write a Hugging Face model folder from a checkpoint agentx can load (default: the embedded GGUF).

vLLM (the ``agentx.engine.vllm`` backend, and the vLLM / transformers benchmark peers) loads
Hugging Face folders; this gives it the very weights agentx runs (the GGUF dequantized to fp32 by
agentx's own loader) and the tokenizer agentx rebuilds from the GGUF, so both backends compute
with the same numbers and the same token ids. Writes config.json, generation_config.json,
model.safetensors, tokenizer.json and tokenizer_config.json; an up-to-date folder is kept (a
stamp file names the source and its mtime). Full-attention Llama / Qwen2 checkpoints only.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from agentx.engine.models.loader import Checkpoint, default_model_path, load_checkpoint
from agentx.env import peers_dir
from agentx.errors import ModelLoadError

__all__ = ["default_hf_dir", "export", "export_default"]

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_STAMP = "agentx_export.json"  # what the folder was written from; a match skips the export


def hf_config(ckpt: Checkpoint, dtype: str) -> dict:
    spec = ckpt.spec
    if (
        spec.architecture != "llama"
        or spec.layer_types
        and set(spec.layer_types) != {"full_attention"}
    ):
        raise ModelLoadError(f"export_hf: only full-attention Llama checkpoints, got {spec}")
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


def default_hf_dir(model: Path | None = None, dtype: str = "float32") -> Path:
    """``<AGENTX_PEERS_DIR>/models/<gguf stem>-hf[-dtype]``: where ``export_default`` writes."""
    model = model or default_model_path()
    suffix = "" if dtype == "float32" else f"-{dtype}"
    return peers_dir() / "models" / f"{model.stem}-hf{suffix}"


def export_default(model: Path | None = None, dtype: str = "float32") -> Path:
    """Export ``model`` (default: the embedded GGUF) to its default folder; returns the folder."""
    model = model or default_model_path()
    return export(model, default_hf_dir(model, dtype), dtype)
