"""An OpenAI Agents SDK model provider on agentx.

    Runner.run(agent, "...", run_config=RunConfig(model_provider=AgentxModelProvider(),
                                                  tracing_disabled=True))

Every agent of the run (handoffs included) gets the SDK's own ``OpenAIChatCompletionsModel`` on
one in-process client (``client.py``), so they share the engine and its held conversations.
The SDK exports traces to OpenAI unless told otherwise: pass ``tracing_disabled=True`` (or call
``agents.set_tracing_disabled(True)``) when no network is wanted. Needs ``openai-agents``.
"""

from __future__ import annotations

from agents import Model, ModelProvider, OpenAIChatCompletionsModel

from agentx.engine.backend import EngineBackend
from agentx.openai.client import AsyncOpenAI
from agentx.openai.service import DEFAULT_MODEL_NAME

__all__ = ["AgentxModelProvider"]


class AgentxModelProvider(ModelProvider):
    """Models answered by ``engine`` (None: the process-wide default) or an existing
    in-process ``client``; an agent's model name is echoed back, the engine's model answers."""

    def __init__(
        self,
        engine: EngineBackend | None = None,
        *,
        client: AsyncOpenAI | None = None,
        model_name: str = DEFAULT_MODEL_NAME,
    ) -> None:
        self.client = client or AsyncOpenAI(engine, model_name=model_name)
        self.model_name = model_name

    def get_model(self, model_name: str | None) -> Model:
        return OpenAIChatCompletionsModel(
            model=model_name or self.model_name, openai_client=self.client
        )
