"""The OpenAI Chat Completions API on an in-process engine (the ``openai`` extra).

``AsyncOpenAI`` / ``OpenAI`` are the official client classes answered in this process;
``ChatService`` is the engine-side implementation they and ``agentx serve`` share. Framework
adapters live in ``agentx.openai.pydantic_ai`` and ``agentx.openai.agents_sdk``; the HTTP
server in ``agentx.openai.server`` (the ``serve`` extra).
"""

from agentx.openai.client import AsyncOpenAI, OpenAI
from agentx.openai.service import ChatService

__all__ = ["AsyncOpenAI", "ChatService", "OpenAI"]
