"""What the P/D coordinator keeps per request and per session, and its counters."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from agentx.engine.outputs import RequestOutput
from agentx.engine.request import RequestOptions
from agentx.engine.sampling import SamplingParams
from agentx.engine.streams import RequestStream
from agentx.errors import EngineClosedError, EngineDeadError


@dataclass(slots=True)
class SessionKV:
    """A session's KV between its turns: held on one D instance."""

    decode: int  # the D instance that holds it
    handle: str  # its held KV there
    token_ids: list[int]  # the tokens that KV covers


@dataclass(slots=True, eq=False)
class Flight:
    """One request on its way: prefill -> export -> import -> decode (a local turn: decode)."""

    request_id: str
    stream: RequestStream
    prompt: list[int]
    sampling: SamplingParams
    options: RequestOptions
    session_id: str | None
    stage: str
    prefill: int | None = None
    decode: int | None = None
    first: RequestOutput | None = None  # P's delta (a hand-over turn)
    output_ids: list[int] = field(default_factory=list)
    aborted: bool = False
    release_on_finish: bool = False  # its held KV was released before it finished

    def take_decoded(self, out: RequestOutput) -> RequestOutput:
        """A delta from D as the caller sees it: counted over the whole request (D's prompt
        ends with P's first token; ``num_cached_tokens`` are P's hits)."""
        self.output_ids.extend(out.new_token_ids)
        if self.first is None:  # a local turn: D's request is the whole request
            return out
        return replace(
            out,
            num_prompt_tokens=len(self.prompt),
            num_cached_tokens=self.first.num_cached_tokens,
            num_output_tokens=len(self.output_ids),
        )

    def get_held_token_ids(self) -> list[int]:
        """The tokens of the KV D holds when the request finished: all but the last sampled."""
        return self.prompt + self.output_ids[:-1]


@dataclass(slots=True)
class DisaggCounters:
    num_remote_prefills: int = 0  # turns prefilled on a P instance
    num_local_prefills: int = 0  # warm turns prefilled on the D instance holding their KV
    num_handovers: int = 0  # hand-overs P -> D that reached D's decode
    num_handover_tail_tokens: int = 0  # tokens of partial last blocks handed over
    num_finished_on_prefill: int = 0  # ended at their first token (EOS, a stop, max_tokens=1)
    num_failed: int = 0  # requests failed by an instance's death, an abort or a close
    num_moved_sessions: int = 0  # sessions whose D instance died: their next turn ran cold


def num_new_tokens(held: list[int], prompt: list[int]) -> int:
    """Tokens of ``prompt`` the held KV does not cover (all of them if it does not lead it)."""
    if len(held) <= len(prompt) and prompt[: len(held)] == held:
        return len(prompt) - len(held)
    return len(prompt)


def call_quietly(call: Callable, *args) -> None:
    """Call an instance where its death or close changes nothing (a release, an abort)."""
    try:
        call(*args)
    except (EngineDeadError, EngineClosedError):
        pass
