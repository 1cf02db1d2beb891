"""Closed-loop prompts: an agent's next prompt carries what the engine actually generated.

In open loop every prompt is built from its own hash ids alone, so a turn's prompt carries the
trace's tokens where the previous turn's output was. In closed loop, as in a real agent, a turn
that extends the agent's previous turn (its hash ids start with the previous prompt's full
blocks, and it is at least the previous prompt plus output long) is sent as::

    previous prompt's segments | the ids the engine generated | new text (tool result, user)
    `----- exactly the previous turn's token ids, then its output ------'

so turn k+1's token ids start with turn k's prompt and generated ids, exactly (segments are
tokenized one by one: :mod:`agentx.bench.segments`). The new text covers the trace's tokens past
the previous prompt plus output, from the request's own blocks. The trace still sets the shape:
turns, lengths, forks, think times. A subagent forks its parent's context at the spawn, so its
first turn extends the parent's last one. A turn that does not extend (a compacted context, the
first turn, another agent's prompt) is built open loop and starts a new context.
"""

from __future__ import annotations

from dataclasses import dataclass

from agentx.bench.prompts import PromptSource
from agentx.bench.segments import Prompt, Segment
from agentx.bench.trace import TraceRequest


@dataclass(slots=True)
class AgentContext:
    """An agent's context so far: its last request and what its next prompt extends (that
    request's prompt segments, then its generated ids). Empty before the first turn."""

    last: TraceRequest | None = None
    segments: tuple[Segment, ...] = ()

    def fork(self) -> AgentContext:
        return AgentContext(self.last, self.segments)

    @property
    def num_trace_tokens(self) -> int:
        """Trace tokens the context stands for: the last prompt plus its output."""
        return 0 if self.last is None else self.last.num_input_tokens + self.last.num_output_tokens

    def extended_by(self, request: TraceRequest, block_size: int) -> bool:
        last = self.last
        if last is None or request.num_input_tokens < self.num_trace_tokens:
            return False
        num_full = last.num_input_tokens // block_size
        return request.hash_ids[:num_full] == last.hash_ids[:num_full]

    def prompt_for(
        self, request: TraceRequest, source: PromptSource, scope: str, filler_key: str
    ) -> Prompt:
        """The request's prompt: extending this context when the trace says it does."""
        if not self.extended_by(request, source.block_size):
            whole = source.segment(scope, request.hash_ids, request.num_input_tokens, filler_key)
            return Prompt((whole,))
        num_new = request.num_input_tokens - self.num_trace_tokens
        if num_new == 0:
            return Prompt(self.segments)
        first_block = self.num_trace_tokens // source.block_size
        new = source.segment(scope, request.hash_ids[first_block:], num_new, filler_key)
        return Prompt((*self.segments, new))

    def complete(self, request: TraceRequest, prompt: Prompt, token_ids: tuple[int, ...]) -> None:
        """The request finished with ``token_ids``: the next turn extends them."""
        self.last = request
        self.segments = (*prompt.segments, tuple(token_ids))

    def reset(self) -> None:
        """The request failed: the next turn starts a new context."""
        self.last, self.segments = None, ()
