"""agentx: an in-process LLM runtime for agent loops.

from agentx import Engine, SamplingParams

with Engine() as engine:                       # the embedded SmolLM2-135M-Instruct
    [gen] = engine.generate(["The capital of France is"], SamplingParams(max_tokens=16))
    print(gen.text, gen.usage)
"""

from agentx import env

env.apply_cpu_defaults()  # before anything below imports torch

from agentx.config import (
    CacheConfig,
    DisaggConfig,
    EngineConfig,
    OffloadConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from agentx.engine.backend import EngineBackend, EngineCapabilities
from agentx.engine.client import Engine
from agentx.engine.kv_cache.policy import (
    CheckpointPlan,
    HeldCandidate,
    KVPolicy,
    LRUPolicy,
    ToolWait,
    ToolWaitDecision,
    TurnEnd,
    TurnEndDecision,
)
from agentx.engine.kv_cache.retention import IntervalRetention, MarconiRetention, NoRetention
from agentx.engine.offload.interface import KVExport
from agentx.engine.outputs import EngineStats, RequestOutput
from agentx.engine.request import RequestOptions
from agentx.engine.sampling import SamplingParams
from agentx.engine.streams import Generation, RequestStream, RequestUsage
from agentx.engine.structured import StructuredOutput
from agentx.engine.vllm import VLLMConfig, VLLMEngine
from agentx.errors import (
    AgentXError,
    ConfigError,
    EngineClosedError,
    EngineDeadError,
    InstanceDeadError,
    InvalidRequestError,
    KVPolicyError,
    ModelLoadError,
    ModelNotFoundError,
    OffloadError,
    PromptTooLongError,
    RequestAbortedError,
    RequestFailedError,
    SamplingParamsError,
    SessionClosedError,
    SessionError,
    TraceError,
    TurnInProgressError,
    UnknownToolCallError,
)
from agentx.session import (
    AssistantMessage,
    BranchPoint,
    Message,
    Pin,
    Priority,
    Release,
    Session,
    SystemMessage,
    TextDelta,
    Tool,
    ToolCall,
    ToolCallEvent,
    ToolLatency,
    ToolMessage,
    Turn,
    TurnDone,
    TurnEvent,
    TurnsLeft,
    Usage,
    UserMessage,
    tool,
)

__version__ = "0.1.0"

__all__ = [
    "AgentXError",
    "AssistantMessage",
    "BranchPoint",
    "CacheConfig",
    "CheckpointPlan",
    "ConfigError",
    "DisaggConfig",
    "Engine",
    "EngineBackend",
    "EngineCapabilities",
    "EngineClosedError",
    "EngineConfig",
    "EngineDeadError",
    "EngineStats",
    "Generation",
    "HeldCandidate",
    "InstanceDeadError",
    "IntervalRetention",
    "InvalidRequestError",
    "KVExport",
    "KVPolicy",
    "KVPolicyError",
    "LRUPolicy",
    "MarconiRetention",
    "Message",
    "ModelLoadError",
    "ModelNotFoundError",
    "NoRetention",
    "OffloadConfig",
    "OffloadError",
    "ParallelConfig",
    "Pin",
    "Priority",
    "PromptTooLongError",
    "Release",
    "RequestAbortedError",
    "RequestFailedError",
    "RequestOptions",
    "RequestOutput",
    "RequestStream",
    "RequestUsage",
    "SamplingParams",
    "SamplingParamsError",
    "SchedulerConfig",
    "Session",
    "SessionClosedError",
    "SessionError",
    "SpeculativeConfig",
    "StructuredOutput",
    "SystemMessage",
    "TextDelta",
    "Tool",
    "ToolCall",
    "ToolCallEvent",
    "ToolLatency",
    "ToolMessage",
    "ToolWait",
    "ToolWaitDecision",
    "TraceError",
    "Turn",
    "TurnDone",
    "TurnEnd",
    "TurnEndDecision",
    "TurnEvent",
    "TurnInProgressError",
    "TurnsLeft",
    "UnknownToolCallError",
    "Usage",
    "UserMessage",
    "VLLMConfig",
    "VLLMEngine",
    "tool",
]
