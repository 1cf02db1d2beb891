"""VLLMConfig: how the vLLM backend builds its in-process engine. Frozen, validated once.

The fields agentx needs to decide (prefix caching on, priority scheduling, the guidance
structured-output backend, token-id prompts) are fixed by the backend; everything else vLLM
takes passes through ``engine_args`` unchanged (``tensor_parallel_size``,
``data_parallel_size``, ``decode_context_parallel_size``, ``enable_expert_parallel``,
``kv_transfer_config``, ``gpu_memory_utilization``, ...), so the multi-GPU and multi-node
configurations of vLLM are configurations here too.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from agentx.errors import ConfigError

__all__ = ["FIXED_ENGINE_ARGS", "VLLMConfig"]

# Set by the backend: a session's turns must hit the prefix cache, hints' priorities must order
# the queue, grammars must behave as agentx's llguidance ones, and prompts arrive as token ids.
FIXED_ENGINE_ARGS = ("enable_prefix_caching", "scheduling_policy", "skip_tokenizer_init")
_DTYPES = ("float32", "float16", "bfloat16", "auto")


@dataclass(frozen=True, slots=True)
class VLLMConfig:
    # a Hugging Face folder; None: the embedded default GGUF, exported once to a folder
    # (agentx.engine.models.hf_export) with the weights and tokenizer agentx itself runs
    model: str | None = None
    dtype: str = "float32"
    block_size: int = 32  # the prefix-cache unit (CPU attention: a multiple of 32)
    max_model_len: int | None = 8192
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    # CPU only: the KV cache size (vLLM's VLLM_CPU_KVCACHE_SPACE, GiB) and OpenMP threads
    cpu_kv_cache_gib: int = 1
    num_threads: int | None = None
    enforce_eager: bool = True  # no torch.compile: start in seconds, not minutes, on CPU
    seed: int = 0
    engine_args: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.model is not None and not isinstance(self.model, str):
            raise ConfigError(f"model must be a folder path (str) or None, got {self.model!r}")
        if self.dtype not in _DTYPES:
            raise ConfigError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "cpu_kv_cache_gib"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")
        for name in ("max_model_len", "num_threads"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ConfigError(f"{name} must be a positive int or None, got {value!r}")
        if not isinstance(self.engine_args, Mapping):
            raise ConfigError(f"engine_args must be a mapping, got {self.engine_args!r}")
        fixed = sorted(set(self.engine_args) & set(FIXED_ENGINE_ARGS))
        if fixed:
            raise ConfigError(f"the vLLM backend sets {fixed} itself; leave them out")
        object.__setattr__(self, "engine_args", MappingProxyType(dict(self.engine_args)))

    @property
    def data_parallel_size(self) -> int:
        return int(self.engine_args.get("data_parallel_size", 1))

    def to_engine_args(self, model_dir: str) -> dict[str, Any]:
        """Keyword arguments for vLLM's ``EngineArgs``."""
        args: dict[str, Any] = dict(
            model=model_dir,
            dtype=self.dtype,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            enforce_eager=self.enforce_eager,
            seed=self.seed,
            enable_prefix_caching=True,
            scheduling_policy="priority",
            skip_tokenizer_init=False,  # structured outputs compile against vLLM's tokenizer
        )
        args.update(self.engine_args)
        return args
