"""Model classes by architecture name (``ModelSpec.architecture``)."""

from __future__ import annotations

from torch import nn

from agentx.engine.models.gemma3 import Gemma3ForCausalLM
from agentx.engine.models.llama import LlamaForCausalLM
from agentx.engine.models.qwen3_next import Qwen3NextForCausalLM
from agentx.errors import ModelLoadError

MODELS: dict[str, type[nn.Module]] = {
    "gemma3": Gemma3ForCausalLM,
    "llama": LlamaForCausalLM,
    "qwen3_next": Qwen3NextForCausalLM,
}


def get_model_class(architecture: str) -> type[nn.Module]:
    try:
        return MODELS[architecture]
    except KeyError:
        known = ", ".join(sorted(MODELS))
        raise ModelLoadError(
            f"unsupported architecture {architecture!r} (known: {known})"
        ) from None
