"""A request inside the engine: its tokens, how many are computed, and why it finished.

``RequestOptions`` is what a caller says about a request besides its prompt and sampling; it is
backend-neutral (no block sizes, no hashes), so any engine backend the Session drives takes it.

The scheduler thinks in tokens only: ``num_computed_tokens`` catches up to ``num_tokens``.
A prefill, a chunk of one, a decode step and a recompute after preemption are all the same
thing: computing ``num_tokens - num_computed_tokens`` more tokens.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from agentx.engine.block_hash import BlockHash, extend_block_hashes
from agentx.engine.draft import Drafter, DraftSource
from agentx.engine.hints import HINT_TYPES, Hint
from agentx.engine.outputs import TokenLogprob
from agentx.engine.sampling import SamplingParams
from agentx.engine.structured import GrammarMatcher
from agentx.errors import InvalidRequestError


@dataclass(frozen=True, slots=True)
class RequestOptions:
    """How to run one request, besides its prompt and sampling params."""

    priority: int = 0  # lower runs first under the priority policy
    cache_salt: str | None = None  # isolates this request's prefix-cache entries from others'
    hold_kv: bool = False  # when it finishes, hold its KV under its request id (kv_cache/held.py)
    held_kv: str | None = None  # the handle of held KV this request continues
    hints: tuple[Hint, ...] = ()  # what the agent knows about the future (engine/hints.py)
    # tokens this request may draft from besides its own (engine/draft.py): a session passes
    # its tree's source; the engine adds the request's output to it when it finishes
    draft_source: DraftSource | None = None

    def __post_init__(self) -> None:
        # checked here, on the caller's thread: a bad value reaching the loop thread (an
        # unhashable held_kv is a dict key there) would kill the engine for every caller
        if not isinstance(self.priority, int) or isinstance(self.priority, bool):
            raise InvalidRequestError(f"priority must be an int, got {self.priority!r}")
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise InvalidRequestError(f"cache_salt must be a str or None, got {self.cache_salt!r}")
        if not isinstance(self.hold_kv, bool):
            raise InvalidRequestError(f"hold_kv must be a bool, got {self.hold_kv!r}")
        if self.held_kv is not None and not isinstance(self.held_kv, str):
            raise InvalidRequestError(f"held_kv must be a handle (str) or None: {self.held_kv!r}")
        if isinstance(self.hints, str | bytes | dict):
            raise InvalidRequestError(f"hints must be a sequence of hints, got {self.hints!r}")
        try:
            hints = tuple(self.hints)
        except TypeError:
            raise InvalidRequestError(f"hints must be a sequence, got {self.hints!r}") from None
        bad = [h for h in hints if not isinstance(h, HINT_TYPES)]
        if bad:
            raise InvalidRequestError(f"not hints: {bad[:3]!r}")
        object.__setattr__(self, "hints", hints)


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    block_size: int = 16
    priority: int = 0  # lower runs first under the priority policy
    cache_salt: bytes = b""
    seed: int = 0  # sampling.seed, or one drawn by the engine when that is None
    hold_kv: bool = False  # when it finishes, hold its KV under its id (see kv_cache/held.py)
    held_kv: str | None = None  # the handle of held KV this request continues
    hints: tuple = ()  # the session's hints (agentx.session.hints) for tiers and policies
    grammar: GrammarMatcher | None = None  # set when sampling.structured is
    drafter: Drafter | None = None  # set when it may speculate (engine/draft.py)
    draft_sinks: tuple[DraftSource, ...] = ()  # receive its output when it completes
    arrival_time: float = field(default_factory=time.monotonic)
    all_token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix hit when first scheduled; -1 until then
    num_preemptions: int = 0
    in_cold_lane: bool = False  # admitted as a cold first turn (engine/scheduler/lanes.py)
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    block_hashes: list[BlockHash] = field(init=False, default_factory=list)
    # with sampling.prompt_logprobs: one record per prompt token computed so far (the first
    # token has none), handed out once, on the first delta
    prompt_logprobs: list[TokenLogprob | None] = field(init=False, default_factory=list)
    prompt_logprobs_sent: bool = False

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        self._update_block_hashes()
        if self.sampling.prompt_logprobs is not None:
            self.prompt_logprobs.append(None)

    def add_prompt_logprobs(self, start_position: int, records: list[TokenLogprob]) -> None:
        """Records of the prompt tokens after ``start_position``, in order; those already
        recorded (a recompute after preemption) are skipped."""
        skip = len(self.prompt_logprobs) - (start_position + 1)
        self.prompt_logprobs.extend(records[max(skip, 0) :])

    def take_prompt_logprobs(self) -> tuple[TokenLogprob | None, ...]:
        """The prompt's records, the first time they are whole; () after and before."""
        if self.prompt_logprobs_sent or len(self.prompt_logprobs) < self.num_prompt_tokens:
            return ()
        self.prompt_logprobs_sent = True
        return tuple(self.prompt_logprobs)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids) :]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> int:
        """Append a sampled token, or the one the grammar's budget puts in its place; returns
        the token appended."""
        if self.grammar is not None:
            token_id = self.grammar.commit(token_id)
        self.all_token_ids.append(token_id)
        if self.num_tokens % self.block_size == 0:
            self._update_block_hashes()
        return token_id

    def truncate(self, num_tokens: int) -> None:
        """Drop output tokens past ``num_tokens`` (a stop string ended the output inside a
        step's accepted drafts); computed KV past the new end is forgotten too."""
        assert self.num_prompt_tokens < num_tokens <= self.num_tokens
        del self.all_token_ids[num_tokens:]
        del self.block_hashes[num_tokens // self.block_size :]
        self.num_computed_tokens = min(self.num_computed_tokens, num_tokens - 1)

    @property
    def num_draft_tokens(self) -> int:
        return self.drafter.num_draft_tokens if self.drafter is not None else 0

    @property
    def num_accepted_tokens(self) -> int:
        return self.drafter.num_accepted_tokens if self.drafter is not None else 0

    def _update_block_hashes(self) -> None:
        extend_block_hashes(self.block_hashes, self.all_token_ids, self.block_size, self.cache_salt)

    def check_stop(self, max_model_len: int) -> bool:
        """Finish the request if its last token ends it. Returns True if it did."""
        last = self.all_token_ids[-1]
        sampling = self.sampling
        if self.grammar is not None and self.grammar.is_error:
            # the matcher rejected a token: the output is not what the grammar promised
            self.status, self.stop_reason = RequestStatus.FINISHED_ERROR, "grammar_error"
        elif self.grammar is not None and self.grammar.budget_closed and self.grammar.is_terminated:
            # complete and valid, but the budget chose where it ended
            self.status, self.stop_reason = RequestStatus.FINISHED_LENGTH, "grammar_budget"
        elif self.grammar is not None and self.grammar.is_terminated:
            reason = last if last in self.eos_token_ids else "grammar"
            self.status, self.stop_reason = RequestStatus.FINISHED_STOPPED, reason
        elif not sampling.ignore_eos and last in self.eos_token_ids:
            self.status, self.stop_reason = RequestStatus.FINISHED_STOPPED, last
        elif last in sampling.stop_token_ids:
            self.status, self.stop_reason = RequestStatus.FINISHED_STOPPED, last
        elif self.num_output_tokens >= sampling.max_tokens or self.num_tokens >= max_model_len:
            self.status = RequestStatus.FINISHED_LENGTH
            if self.grammar is not None and not self.grammar.is_accepting:
                self.stop_reason = "grammar_incomplete"  # cut off before the grammar could end
            elif self.grammar is not None and self.grammar.budget_closed:
                self.stop_reason = "grammar_budget"
        return self.status.is_finished
