"""The architecture description every loader produces and every model consumes.

A loader (GGUF, safetensors) reads a checkpoint's metadata into a :class:`ModelSpec`; the model
registry picks the class by ``spec.architecture``. Nothing here knows about files or serving.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Llama 3 style frequency scaling ("llama3"), or plain linear scaling ("linear")."""

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True, slots=True)
class ModelSpec:
    architecture: str  # registry key: "llama" (also Qwen2-style checkpoints with qkv bias)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position: int  # the context length the checkpoint was trained for
    tie_word_embeddings: bool
    attention_bias: bool = False
    rope_scaling: RopeScaling | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Per layer, its attention type: "full_attention", "sliding_attention" or "linear_attention"
    # (empty: every layer is full attention). The runner turns these into KV cache specs.
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None  # tokens a sliding-attention query sees, itself included
    add_bos_token: bool = False  # prepend BOS when encoding a prompt (Gemma)
    # Architecture-specific fields: a frozen dataclass defined beside the model that reads it.
    arch_config: object | None = None

    def get_layer_type(self, layer_id: int) -> str:
        return self.layer_types[layer_id] if self.layer_types else "full_attention"
