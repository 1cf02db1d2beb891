"""The vLLM backend: the Session API on vLLM's engine, in the caller's process (optional: the
``agentx[vllm]`` extra). Importing this package does not import vLLM; building an engine does."""

from agentx.engine.vllm.config import VLLMConfig
from agentx.engine.vllm.engine import VLLMEngine

__all__ = ["VLLMConfig", "VLLMEngine"]
