"""An OpenAI Agents SDK agent on agentx: the model runs in this process and calls a tool.

    python examples/openai_agents_sdk.py

``AgentxModelProvider`` gives every agent of the run the SDK's Chat Completions model over
agentx's in-process OpenAI client; tracing is disabled so nothing leaves the machine.
"""

import asyncio

from agents import Agent, ModelSettings, RunConfig, Runner, function_tool

from agentx.openai.agents_sdk import AgentxModelProvider


@function_tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    print(f"-> tool call add({a}, {b})")
    return a + b


async def main() -> None:
    provider = AgentxModelProvider()
    agent = Agent(
        name="calculator",
        instructions="You add numbers with the add tool.",
        tools=[add],
        # the first turn must call a tool (a 135M model rarely does on its own); the SDK resets
        # tool_choice after a call, so the next turn answers from the result
        model_settings=ModelSettings(temperature=0, max_tokens=64, tool_choice="required"),
    )
    config = RunConfig(model_provider=provider, tracing_disabled=True)
    result = await Runner.run(agent, "What is 17 plus 25?", run_config=config, max_turns=4)
    print("answer:", result.final_output)
    for response in result.raw_responses:
        usage = response.usage
        cached = usage.input_tokens_details.cached_tokens
        print(f"turn: {usage.input_tokens} prompt tokens, {cached} cached")
    await provider.client.close()


if __name__ == "__main__":
    asyncio.run(main())
