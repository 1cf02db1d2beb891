"""Running the Python tools a turn called: concurrently, every failure an answer for the model.

A malformed call, an unknown tool, arguments that do not validate, an exception inside the
tool and a tool still running after ``timeout`` seconds all become an error string (with
``is_error`` set) for the model to read; nothing raises.
"""

from __future__ import annotations

import anyio

from agentx.session.messages import ToolCall
from agentx.session.tools import Tool, ToolArgumentsError


async def execute_calls(
    tools: dict[str, Tool], calls: list[ToolCall], timeout: float | None = None
) -> list[tuple[str, bool]]:
    """``(content, is_error)`` per call, in call order; the calls run concurrently, each for at
    most ``timeout`` seconds (None: no limit)."""
    results: list[tuple[str, bool]] = [("", True)] * len(calls)

    async def run_one(i: int, call: ToolCall) -> None:
        results[i] = await execute_call(tools, call, timeout)

    async with anyio.create_task_group() as tg:
        for i, call in enumerate(calls):
            tg.start_soon(run_one, i, call)
    return results


async def execute_call(
    tools: dict[str, Tool], call: ToolCall, timeout: float | None = None
) -> tuple[str, bool]:
    if not call.ok:
        return f"error: the tool call could not be parsed ({call.error})", True
    tool = tools.get(call.name)
    if tool is None or tool.fn is None:
        known = ", ".join(sorted(tools)) or "none"
        return f"error: no tool named {call.name!r} (tools: {known})", True
    try:
        with anyio.fail_after(timeout):
            return await tool.invoke(call.arguments), False
    except TimeoutError:
        return f"error: the tool {call.name!r} did not finish within {timeout:g} s", True
    except ToolArgumentsError as exc:
        return f"error: {exc}", True
    except Exception as exc:  # noqa: BLE001 - the model sees the tool's failure
        return f"error: {type(exc).__name__}: {exc}", True
