"""Loading a Hugging Face model folder into a :class:`Checkpoint`.

A folder holds ``config.json``, one or more ``*.safetensors`` files (sharded ones listed in
``model.safetensors.index.json``), ``tokenizer.json`` / ``tokenizer_config.json`` and usually a
``generation_config.json``. Owns reading ``config.json`` into a :class:`ModelSpec` and the
safetensors files into tensors (already in Hugging Face Llama naming). Reading the files needs
the ``safetensors`` package, imported only when a folder is loaded.

Supported ``architectures``: LlamaForCausalLM, MistralForCausalLM and Qwen2ForCausalLM (q/k/v
biases), all mapped to the ``llama`` model; Qwen3NextForCausalLM (the ``qwen3_next`` model).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from agentx.engine.models.loader import Checkpoint
from agentx.engine.models.qwen3_next import Qwen3NextConfig
from agentx.engine.models.spec import ModelSpec, RopeScaling
from agentx.engine.models.tokenizer import Tokenizer
from agentx.errors import ModelLoadError

__all__ = ["load_hf_folder", "read_hf_spec"]

logger = logging.getLogger(__name__)

# Hugging Face class -> whether it always has q/k/v biases (Qwen2 has no config key for them;
# Llama says so in ``attention_bias``).
_ARCHITECTURES = {
    "LlamaForCausalLM": False,
    "MistralForCausalLM": False,
    "Qwen2ForCausalLM": True,
    "Qwen3NextForCausalLM": False,
}
_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints saved; recomputed


def load_hf_folder(path: str | os.PathLike[str], dtype: torch.dtype = torch.float32) -> Checkpoint:
    """Read config, tokenizer and all safetensors shards of a Hugging Face folder, as ``dtype``.

    Raises ModelLoadError for a missing or unsupported config.json, missing weight files, or a
    missing ``safetensors`` package.
    """
    folder = Path(path)
    spec = read_hf_spec(_read_config(folder))
    tokenizer = Tokenizer.from_hf_folder(folder)
    weights = _read_weights(folder, dtype)
    bos = spec.bos_token_id if tokenizer.bos_token_id is None else tokenizer.bos_token_id
    spec = replace(
        spec,
        # transformers leaves lm_head.weight out of the files when it is tied
        tie_word_embeddings=spec.tie_word_embeddings or "lm_head.weight" not in weights,
        bos_token_id=bos,
        eos_token_ids=tuple(sorted(tokenizer.eos_token_ids)),
        add_bos_token=tokenizer.add_bos,
    )
    return Checkpoint(spec=spec, weights=weights, tokenizer=tokenizer, path=folder)


def read_hf_spec(config: dict[str, Any]) -> ModelSpec:
    """A spec from a parsed ``config.json`` (eos ids come from the tokenizer files instead)."""
    architecture = _architecture(config)
    try:
        spec = _spec_from_config(config, always_bias=_ARCHITECTURES[architecture])
        refine = _ARCH_SPECS.get(architecture)
        return refine(spec, config) if refine else spec
    except KeyError as exc:
        raise ModelLoadError(f"config.json has no {exc.args[0]!r}") from exc


def _spec_from_config(config: dict[str, Any], *, always_bias: bool) -> ModelSpec:
    hidden_size = config["hidden_size"]
    num_heads = config["num_attention_heads"]
    bos = config.get("bos_token_id")
    rope = _rope_parameters(config)
    return ModelSpec(
        architecture="llama",
        vocab_size=config["vocab_size"],
        hidden_size=hidden_size,
        intermediate_size=config["intermediate_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=config.get("num_key_value_heads") or num_heads,
        head_dim=config.get("head_dim") or hidden_size // num_heads,
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        max_position=_max_position(config),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=always_bias or bool(config.get("attention_bias", False)),
        rope_scaling=_rope_scaling(rope),
        bos_token_id=bos if isinstance(bos, int) else None,
    )


def _qwen3_next_spec(spec: ModelSpec, config: dict[str, Any]) -> ModelSpec:
    num_layers = config["num_hidden_layers"]
    interval = config.get("full_attention_interval", 4)
    layer_types = config.get("layer_types") or [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention"
        for i in range(num_layers)
    ]
    # transformers 5 moves partial_rotary_factor into rope_parameters; older configs keep it on top
    rotary = _rope_parameters(config).get("partial_rotary_factor")
    arch_config = Qwen3NextConfig(
        linear_num_key_heads=config["linear_num_key_heads"],
        linear_num_value_heads=config["linear_num_value_heads"],
        linear_key_head_dim=config["linear_key_head_dim"],
        linear_value_head_dim=config["linear_value_head_dim"],
        linear_conv_kernel_dim=config["linear_conv_kernel_dim"],
        partial_rotary_factor=float(rotary or config.get("partial_rotary_factor", 0.25)),
        num_experts=config["num_experts"],
        num_experts_per_tok=config["num_experts_per_tok"],
        moe_intermediate_size=config["moe_intermediate_size"],
        shared_expert_intermediate_size=config["shared_expert_intermediate_size"],
        norm_topk_prob=bool(config.get("norm_topk_prob", True)),
        decoder_sparse_step=config.get("decoder_sparse_step", 1),
        mlp_only_layers=tuple(config.get("mlp_only_layers") or ()),
    )
    return replace(
        spec, architecture="qwen3_next", layer_types=tuple(layer_types), arch_config=arch_config
    )


# Hugging Face class -> what its spec adds to the Llama-shaped fields
_ARCH_SPECS = {"Qwen3NextForCausalLM": _qwen3_next_spec}


def _read_config(folder: Path) -> dict[str, Any]:
    file = folder / "config.json"
    if not file.is_file():
        raise ModelLoadError(f"{folder}: no config.json, not a Hugging Face model folder")
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{file}: not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ModelLoadError(f"{file}: not a JSON object")
    return config


def _architecture(config: dict[str, Any]) -> str:
    names = config.get("architectures") or []
    for name in names:
        if name in _ARCHITECTURES:
            return name
    raise ModelLoadError(
        f"architecture {', '.join(names) or config.get('model_type')!r} is not supported "
        f"(supported: {', '.join(_ARCHITECTURES)})"
    )


def _rope_parameters(config: dict[str, Any]) -> dict[str, Any]:
    """transformers 5 writes ``rope_parameters`` (theta and scaling in one dict); older configs
    write ``rope_theta`` and ``rope_scaling`` separately."""
    merged = dict(config.get("rope_scaling") or {})
    merged.update(config.get("rope_parameters") or {})
    if "rope_theta" in config:
        merged.setdefault("rope_theta", config["rope_theta"])
    return merged


def _rope_scaling(parameters: dict[str, Any]) -> RopeScaling | None:
    kind = parameters.get("rope_type", parameters.get("type"))
    if kind in (None, "default"):
        return None
    if kind == "linear":
        return RopeScaling(kind="linear", factor=float(parameters["factor"]))
    if kind == "llama3":
        return RopeScaling(
            kind="llama3",
            factor=float(parameters["factor"]),
            low_freq_factor=float(parameters["low_freq_factor"]),
            high_freq_factor=float(parameters["high_freq_factor"]),
            original_max_position=int(parameters["original_max_position_embeddings"]),
        )
    raise ModelLoadError(f"rope scaling {kind!r} is not supported (only linear and llama3)")


def _max_position(config: dict[str, Any]) -> int:
    """The trained context, capped at the sliding window when one applies: with every prompt
    inside the window, full attention computes exactly what sliding-window attention would."""
    limit = config["max_position_embeddings"]
    window = config.get("sliding_window")
    uses_window = config.get("use_sliding_window", True)  # only Qwen2 has this switch
    if isinstance(window, int) and uses_window and window < limit:
        logger.warning("sliding window %d: capping the context at %d tokens", window, window)
        return window
    return limit


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError) as exc:
            raise ModelLoadError(f"{index}: not a safetensors index: {exc}") from exc
        files = [folder / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors weight files")
    return files


def _read_weights(folder: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    try:
        from safetensors import SafetensorError, safe_open
    except ImportError as exc:
        raise ModelLoadError(
            "loading a Hugging Face folder needs the safetensors package: pip install safetensors"
        ) from exc
    weights: dict[str, torch.Tensor] = {}
    for file in _weight_files(folder):
        try:
            with safe_open(file, framework="pt") as shard:
                for name in shard.keys():
                    if not name.endswith(_SKIPPED_SUFFIXES):
                        weights[name] = shard.get_tensor(name).to(dtype)
        except (OSError, SafetensorError) as exc:
            raise ModelLoadError(f"{file}: cannot read safetensors file: {exc}") from exc
    return weights
