"""What an agent author touches: Session, turns and their events, tools, hints, messages."""

from agentx.session.events import TextDelta, ToolCallEvent, TurnDone, TurnEvent
from agentx.session.hints import BranchPoint, Pin, Priority, Release, ToolLatency, TurnsLeft
from agentx.session.messages import (
    AssistantMessage,
    Message,
    SystemMessage,
    ToolCall,
    ToolMessage,
    Usage,
    UserMessage,
)
from agentx.session.session import Session
from agentx.session.tools import Tool, tool
from agentx.session.turn import Turn

__all__ = [
    "AssistantMessage",
    "BranchPoint",
    "Message",
    "Pin",
    "Priority",
    "Release",
    "Session",
    "SystemMessage",
    "TextDelta",
    "Tool",
    "ToolCall",
    "ToolCallEvent",
    "ToolLatency",
    "ToolMessage",
    "Turn",
    "TurnDone",
    "TurnEvent",
    "TurnsLeft",
    "Usage",
    "UserMessage",
    "tool",
]
