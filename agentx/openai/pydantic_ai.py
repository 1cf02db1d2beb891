"""A pydantic-ai model on agentx: ``Agent(agentx_model(), tools=[...])``.

pydantic-ai's own ``OpenAIChatModel`` on the in-process client (``client.py``), so every
pydantic-ai feature that works against the Chat Completions API works here; the held
conversations make each step of an agent run compute only what the step added. The profile
says what the engine enforces: JSON-schema output (a grammar), ``tool_choice="required"``; no
``allowed_tools``, web search or file URLs. Needs ``pydantic-ai-slim[openai]``.
"""

from __future__ import annotations

from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.profiles.openai import OpenAIModelProfile
from pydantic_ai.providers.openai import OpenAIProvider

from agentx.engine.backend import EngineBackend
from agentx.openai.client import AsyncOpenAI
from agentx.openai.service import DEFAULT_MODEL_NAME

__all__ = ["agentx_model"]


def agentx_model(
    engine: EngineBackend | None = None,
    *,
    client: AsyncOpenAI | None = None,
    model_name: str = DEFAULT_MODEL_NAME,
) -> OpenAIChatModel:
    """A pydantic-ai model answered by ``engine`` (None: the process-wide default), or by an
    existing in-process ``client`` (to share its held conversations)."""
    client = client or AsyncOpenAI(engine, model_name=model_name)
    profile = OpenAIModelProfile(
        supports_json_schema_output=True,
        supports_json_object_output=True,
        supports_forced_tool_choice=True,
        openai_chat_supports_allowed_tools=False,
        openai_chat_supports_web_search=False,
        openai_chat_supports_file_urls=False,
    )
    provider = OpenAIProvider(openai_client=client)
    return OpenAIChatModel(model_name, provider=provider, profile=profile)
