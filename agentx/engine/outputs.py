"""Typed hand-off records between the scheduler, the runner, the core and the client.

Scheduler --SchedulerOutput--> ModelRunner --ModelRunnerOutput--> Scheduler
Scheduler --RequestOutput (per request delta)--> Engine client --> collectors
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from agentx.engine.sampling import SamplingParams
from agentx.errors import warn_renamed


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One position's logprobs: the token at it, its raw logprob (log-softmax of the model's
    logits, before temperature and masks), its rank in the vocabulary (1: the most likely) and
    the top-k ``(token id, logprob)`` pairs, most likely first."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request's share of a step.

    ``token_ids`` are the tokens to compute at positions ``[start_position, start_position +
    len(token_ids))``. ``new_block_ids`` are the blocks appended (per KV group) since the runner
    last saw the request; when ``is_new`` the runner forgets what it had and they are the whole
    block table (a first schedule, or a resume after preemption). Otherwise, when
    ``num_kept_blocks`` is set, the runner first cuts its table to that many blocks (the blocks
    of drafts rejected since it last saw the request went back to the pool).

    The last ``num_draft_tokens`` of ``token_ids`` are drafts (engine/draft.py): the runner
    samples after each of them as well as after the last real token, and keeps the longest
    prefix of drafts that matches what it sampled::

        token_ids   [ ... real | d0 d1 d2 ]      sampled after:  real -> s0, d0 -> s1, ...
        kept        s0 (always), then s(i+1) while s(i) == d(i)
    """

    request_id: str
    token_ids: list[int]
    start_position: int
    new_block_ids: tuple[list[int], ...]
    is_new: bool
    sample: bool  # these tokens reach the end of the request: sample the next one
    sampling: SamplingParams
    seed: int  # the request's resolved seed: sampling is a pure function of (seed, index)
    num_output_tokens: int  # tokens sampled so far: the index of the next one
    num_draft_tokens: int = 0
    num_kept_blocks: int | None = None
    # with prompt logprobs: the prompt tokens that this chunk's rows predict (row i predicts
    # the token after token_ids[i]); empty otherwise
    prompt_targets: tuple[int, ...] = ()

    @property
    def draft_token_ids(self) -> list[int]:
        return self.token_ids[len(self.token_ids) - self.num_draft_tokens :]


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """Copy one block's KV (every layer of its group) before the destination is used."""

    src_block_id: int
    dst_block_id: int


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    num_scheduled_tokens: int
    finished_request_ids: frozenset[str]  # the runner drops their state
    # partial prefix hits' block copies (kv_cache/manager.py), run in order before the forward
    block_copies: list[BlockCopy] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True, slots=True)
class GrammarMasks:
    """Token bitmasks for the constrained requests sampling this step: a request's rows are
    its first logits row and one per draft, in order, each named in ``request_ids``; ``future``
    resolves to an int32 (N, ceil(V / 32)) tensor."""

    request_ids: list[str]
    future: Future


@dataclass(frozen=True, slots=True)
class ModelRunnerOutput:
    sampled_token_ids: dict[str, int]  # only requests that sampled this step
    # requests that drafted: the tokens sampled after their accepted drafts, in order
    # (sampled_token_ids holds the first); absent when no draft was accepted
    extra_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # requests with logprobs: one record per sampled row (the first, then one per draft)
    logprobs: dict[str, list[RowLogprobs]] = field(default_factory=dict)
    # requests with prompt logprobs: the prompt tokens this step's rows predicted, in order
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RowLogprobs:
    """The logprobs of one sampled logits row, for whichever token the request appends: the
    sampled one, or (a grammar's budget may put another in its place) any other, from
    ``full``, the row's whole log-softmax, kept only for requests with a grammar."""

    sampled: TokenLogprob
    full: torch.Tensor | None = None  # (V,) float32

    def get(self, token_id: int) -> TokenLogprob:
        if token_id == self.sampled.token_id:
            return self.sampled
        if self.full is None:
            raise ValueError(f"token {token_id} was not sampled from this row")
        value = self.full[token_id]
        rank = int((self.full > value).sum()) + 1
        return TokenLogprob(token_id, float(value), rank, self.sampled.top)


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one step produced for one request: new tokens, and the finish if it finished."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort", "error" or None while running
    # the EOS / stop token id or stop string; a grammar's: "grammar" (it ended), "grammar_budget"
    # (complete and valid, closed early to fit max_tokens), "grammar_incomplete" (cut short)
    stop_reason: int | str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    new_text: str = ""
    num_draft_tokens: int = 0  # tokens drafted for this request so far (engine/draft.py)
    num_accepted_tokens: int = 0  # of those, accepted by verification
    logprobs: tuple[TokenLogprob, ...] = ()  # one per new token, with SamplingParams.logprobs
    # with SamplingParams.prompt_logprobs, on the first delta: one per prompt token (the first
    # has none: None)
    prompt_logprobs: tuple[TokenLogprob | None, ...] = ()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_steps: int
    num_running: int
    num_waiting: int
    num_preemptions: int
    prefix_cache_queries: int  # requests that looked up the prefix cache
    prefix_cache_query_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache (or held KV) instead
    num_computed_tokens: int  # tokens run through the model
    num_generated_tokens: int
    kv_num_blocks: int
    kv_num_used_blocks: int
    kv_num_cached_blocks: int
    kv_usage: float
    kv_num_held: int  # finished turns whose KV is held for the next turn (kv_cache/held.py)
    kv_policy_errors: int = 0  # KV policy answers refused (kv_cache/policy_guard.py)
    # linear-state checkpoints retention planned but a step left out: the pool had no room
    kv_dropped_checkpoints: int = 0
    offload_loaded_blocks: int = 0  # blocks loaded from a lower tier instead of recomputed
    offload_stored_blocks: int = 0  # blocks written down to the tiers
    offload_failed_blocks: int = 0  # loads that failed (recomputed instead)
    offload_num_prefetches: int = 0  # sessions brought back before their tool returned
    num_draft_tokens: int = 0  # tokens drafted from context and verified (engine/draft.py)
    num_accepted_tokens: int = 0  # of those, accepted: tokens a step gained over one
    # of num_cached_tokens, those copied from a partly shared cached block (a partial hit)
    num_copied_tokens: int = 0

    @property
    def draft_acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def kv_num_held_sequences(self) -> int:
        """Deprecated name of ``kv_num_held``."""
        warn_renamed("EngineStats.kv_num_held_sequences", "kv_num_held")
        return self.kv_num_held

    @property
    def prefix_cache_hit_tokens(self) -> int:
        """Deprecated name of ``num_cached_tokens``."""
        warn_renamed("EngineStats.prefix_cache_hit_tokens", "num_cached_tokens")
        return self.num_cached_tokens

    @property
    def num_reused_tokens(self) -> int:
        """Deprecated name of ``num_cached_tokens``."""
        warn_renamed("EngineStats.num_reused_tokens", "num_cached_tokens")
        return self.num_cached_tokens

    @property
    def prefix_cache_hit_rate(self) -> float:
        q = self.prefix_cache_query_tokens
        return self.num_cached_tokens / q if q else 0.0
