"""Model runner: the flat varlen batch, the forward, logits and sampling."""

from agentx.engine.runner.model_runner import ModelRunner

__all__ = ["ModelRunner"]
