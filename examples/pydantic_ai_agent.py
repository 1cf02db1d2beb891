"""A pydantic-ai agent on agentx: the model runs in this process and calls a Python tool.

    python examples/pydantic_ai_agent.py

The agent's model is pydantic-ai's OpenAIChatModel over agentx's in-process OpenAI client, so
each step re-sends the conversation as pydantic-ai always does, and agentx continues it from the
previous step's KV (the cached tokens printed below).
"""

import asyncio

from pydantic_ai import Agent
from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.settings import ModelSettings

from agentx.openai.pydantic_ai import agentx_model


def add(a: int, b: int) -> int:
    """Add two integers."""
    print(f"-> tool call add({a}, {b})")
    return a + b


class CallToolFirst(AbstractCapability):
    """The first step must call a tool (a 135M model rarely does on its own); later steps
    answer freely. agentx enforces the choice with a grammar, so the call parses."""

    def get_model_settings(self):
        return lambda ctx: ModelSettings(tool_choice="required") if ctx.run_step <= 1 else {}


async def main() -> None:
    model = agentx_model()
    settings = ModelSettings(temperature=0, max_tokens=64)
    agent = Agent(model, tools=[add], model_settings=settings, capabilities=[CallToolFirst()])
    result = await agent.run("What is 17 plus 25?")
    print("answer:", result.output)
    for message in result.all_messages():
        usage = getattr(message, "usage", None)
        if usage is not None:
            print(f"step: {usage.input_tokens} prompt tokens, {usage.cache_read_tokens} cached")
    print("total usage:", result.usage)
    await model.client.close()


if __name__ == "__main__":
    asyncio.run(main())
