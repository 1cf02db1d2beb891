"""The token-budget scheduler.

Each step hands out one budget of ``max_num_batched_tokens``: running requests first (in
admission order), then waiting ones in policy order. A request is given
``num_tokens - num_computed_tokens`` new tokens, capped by ``long_prefill_token_threshold`` and
by what is left of the budget. There are no prefill or decode phases: a decode is a request one
token behind, a chunked prefill is a request the budget clipped.

While some running request decodes, requests given more than one token (chunks) also share a
smaller part of the budget: what the step cost model (step_cost.py) says keeps the step near
``decode_step_target_ms``, so a decode never waits behind a whole long chunk. The target is a
time per output token: where verification keeps a decode's drafts, a step gives it several
tokens and may take that many targets (the fewest any decode kept, over the last steps), its
drafts' rows counted in the step. The scheduler times each step (schedule() to
update_from_output()) and feeds the model.

When the pool runs out, the policy's victim is preempted by recompute: its blocks go back to the
pool with their cached content, so on resume it takes a prefix hit on what survived.

A request whose tokens reach its end this step may add drafts (engine/draft.py): tokens it
guesses come next, computed optimistically in the same step (``num_computed_tokens`` counts
them); the runner keeps the longest prefix it would have sampled anyway, and the rejected ones
are taken back (``num_computed_tokens`` drops, their blocks return to the pool). Drafts take
budget but not the chunk share, never preempt anything and never release held KV.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

from agentx.config import SchedulerConfig
from agentx.engine.kv_cache import KVBlock, KVCacheBlocks, KVCacheManager
from agentx.engine.outputs import (
    ModelRunnerOutput,
    RequestOutput,
    ScheduledRequest,
    SchedulerOutput,
    TokenLogprob,
)
from agentx.engine.request import FINISH_REASONS, Request, RequestStatus
from agentx.engine.scheduler.lanes import FirstTurnLanes
from agentx.engine.scheduler.queues import QUEUES
from agentx.engine.scheduler.step_clock import PrefillCadence, StepClock
from agentx.engine.scheduler.step_cost import StepCostModel, make_step_cost
from agentx.errors import PromptTooLongError

# steps with decodes that the chunk share's estimate of drafts kept averages over
_DECODE_WINDOW = 8
# drafted tokens after which a request's own kept fraction decides whether it drafts in a
# step that computes prompt tokens (before them: the engine's recent fraction)
PREFILL_DRAFTS_OWN_MIN = 8
_RECENT_DECAY = 0.98  # ~50 verifications: the engine's recent kept fraction


@dataclass(slots=True)
class _StepBudget:
    """What is left of one step's budget: tokens for every request, the share of requests given
    more than one token (chunks; the whole budget unless something decodes), and the tokens
    short turns may still take past that share."""

    num_tokens: int
    num_chunk_tokens: int
    num_short_tokens: int = 0

    def clip(self, num_new: int) -> int:
        """Tokens a request asking for ``num_new`` gets (0: the chunk share is spent)."""
        if num_new > 1:
            num_new = min(num_new, self.num_chunk_tokens)
        return min(num_new, self.num_tokens)

    def fits_whole(self, num_new: int) -> bool:
        """Whether a short turn of ``num_new`` tokens fits whole, past the chunk share."""
        over = max(0, num_new - self.num_chunk_tokens)
        return 1 < num_new <= self.num_tokens and over <= self.num_short_tokens

    def take(self, num_new: int, num_draft: int = 0) -> None:
        self.num_tokens -= num_new + num_draft
        if num_new > 1:  # a short turn admitted whole may take more than the share left
            self.num_short_tokens -= max(0, num_new - self.num_chunk_tokens)
            self.num_chunk_tokens = max(0, self.num_chunk_tokens - num_new)

    def give_back(self, num_new: int, num_draft: int = 0) -> None:
        """A preempted request's tokens (what it took past the share is not given back)."""
        self.num_tokens += num_new + num_draft
        if num_new > 1:
            self.num_chunk_tokens += num_new


class _Scheduled(NamedTuple):
    """One request's share of the step being built."""

    request: Request
    num_new: int  # real tokens (those in all_token_ids)
    new_blocks: KVCacheBlocks
    draft_token_ids: list[int]


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_manager: KVCacheManager,
        max_model_len: int,
        cost_model: StepCostModel | None = None,
        clock: Callable[[], float] = time.perf_counter,
        step_clock: StepClock | None = None,
    ) -> None:
        """``cost_model``: None builds the configured one. ``clock``: seconds, for step times
        (tests pass a fake one). ``step_clock``: a step index shared with other replicas, so
        their ``prefill_schedule_interval`` windows align (step_clock.py); None: this one's."""
        self.config = config
        self.kv = kv_manager
        self.max_model_len = max_model_len
        self.queue_cls = QUEUES[config.policy]
        self.lanes = (
            FirstTurnLanes(config.cold_prefill_tokens, config.cold_prefill_share)
            if config.cold_prefill_tokens
            else None
        )
        self._chunk_share = 0  # the chunk tokens of the step being built
        # per recent step with decodes: the tokens the step's slowest decode kept (1 + accepted
        # drafts) and the rows a decode ran (1 + drafts), for the chunk share
        self._decode_steps: deque[tuple[int, float]] = deque(maxlen=_DECODE_WINDOW)
        self.waiting = self.queue_cls()
        self.running: list[Request] = []
        self.parked: dict[str, Request] = {}  # waiting on an offload load, out of line
        self.requests: dict[str, Request] = {}
        self._finished_ids: set[str] = set()  # not yet reported to the runner
        self._known_to_runner: set[str] = set()
        self.num_steps = 0
        self.cadence = PrefillCadence(config.prefill_schedule_interval, step_clock)
        self._window_open = True  # this step may start new prefills (the cadence's window)
        self.num_preemptions = 0
        self.num_computed_tokens = 0
        self.num_generated_tokens = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        # drafts and kept drafts, each verification's weighing _RECENT_DECAY of the one before
        self._recent_drafted = 0.0
        self._recent_kept = 0.0
        self._kept_blocks: dict[str, int] = {}  # trimmed after rejected drafts, runner not told
        self.cost_model = cost_model if cost_model is not None else make_step_cost(config)
        self.clock = clock
        self._step_started: float | None = None  # clock() when the scheduled step left

    # ---- admission -------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request; reject one the pool could never hold, even alone."""
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self.check_fits(request.num_prompt_tokens, request.sampling.max_tokens)
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raise PromptTooLongError for a request that could never run: a prompt that leaves
        the model context no room for an output token, or one the pool could not hold even
        alone. No side effects; safe from any thread (it reads sizes fixed at start)."""
        if num_prompt_tokens >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {num_prompt_tokens} tokens; the model context is "
                f"{self.max_model_len} (the prompt must leave room for at least one output token)"
            )
        max_len = min(num_prompt_tokens + max_tokens, self.max_model_len)
        num_blocks = self.kv.get_max_num_blocks(max_len)
        if num_blocks > self.kv.pool.num_blocks - 1:
            raise PromptTooLongError(
                f"request needs up to {max_len} tokens of KV cache ({num_prompt_tokens} prompt "
                f"+ up to {max_tokens} output), {num_blocks} blocks, but the pool holds "
                f"{self.kv.pool.num_blocks - 1}: lower max_tokens or grow "
                "CacheConfig.kv_cache_bytes"
            )

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """End requests from outside the step (abort); returns those that were still live."""
        ended = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif self.parked.pop(rid, None) is None:
                self.waiting.remove(request)
            self._spend_held(request)  # ended before it ran: what it named is spent all the same
            request.status = status
            self._free(request)
            ended.append(request)
        return ended

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or bool(self.waiting) or bool(self.parked)

    def get_num_unfinished_requests(self) -> int:
        return len(self.running) + len(self.waiting) + len(self.parked)

    def park(self, request: Request) -> None:
        """Take a waiting request out of line while its prefix loads from an offload tier;
        others are scheduled meanwhile."""
        self.waiting.remove(request)
        self.parked[request.request_id] = request

    def unpark(self, request_id: str) -> Request | None:
        """Back in line (None if it was aborted while parked)."""
        request = self.parked.pop(request_id, None)
        if request is not None:
            self.waiting.add(request)
        return request

    # ---- one step ----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self.kv.begin_step()
        self._chunk_share = self._get_chunk_share()
        self._window_open = self.cadence.tick()
        budget = _StepBudget(
            self.config.max_num_batched_tokens, self._chunk_share, self.config.short_turn_tokens
        )
        scheduled: dict[str, _Scheduled] = {}
        lanes = self.lanes
        cold = [r for r in self.running if lanes.is_cold(r)] if lanes is not None else []
        warm = [r for r in self.running if r not in cold] if cold else list(self.running)
        # while a cold prefill runs, its lane's share is kept for it
        reserved = min(lanes.get_cold_share(self._chunk_share), self._chunk_share) if cold else 0
        budget.num_chunk_tokens -= reserved
        preempted_any = self._schedule_running(warm, budget, scheduled)
        admit = not preempted_any and self._may_admit()
        if admit:
            self._admit_waiting(budget, scheduled, None if lanes is None else False)
        budget.num_chunk_tokens += reserved
        if lanes is not None:
            self._schedule_cold_lane(cold, admit, budget, scheduled)
        self._add_drafts(budget, scheduled)

        output = self._build_output(scheduled)
        self._step_started = None if output.is_empty else self.clock()
        return output

    def _schedule_running(
        self, requests: list[Request], budget: _StepBudget, scheduled: dict[str, _Scheduled]
    ) -> bool:
        """Give running requests their tokens in order, preempting for blocks; whether any
        request was preempted."""
        preempted_any = False
        for request in requests:
            if budget.num_tokens <= 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            num_new = self._clip(request.num_tokens - request.num_computed_tokens, budget)
            if num_new == 0:
                continue  # the chunk share is spent; decodes behind it still run
            while (new_blocks := self.kv.allocate_slots(request, num_new)) is None:
                fitting = self._fit_alone(request, num_new, 0, None)
                if fitting:
                    num_new = fitting
                    continue
                victim = self.queue_cls.pick_victim(self.running)
                budget.give_back(*self._preempt(victim, scheduled))
                preempted_any = True
                if victim is request:
                    break
            if new_blocks is None:
                continue
            scheduled[request.request_id] = _Scheduled(request, num_new, new_blocks, [])
            budget.take(num_new)
        return preempted_any

    def _schedule_cold_lane(
        self,
        cold: list[Request],
        admit: bool,
        budget: _StepBudget,
        scheduled: dict[str, _Scheduled],
    ) -> None:
        """The cold lane: running cold prefills, then cold waiting turns. While warm work was
        left wanting (a warm chunk clipped, a warm turn still waiting) only the lane's share;
        otherwise whatever the warm lane left."""
        left = budget.num_chunk_tokens
        if self._warm_left_wanting(scheduled):
            budget.num_chunk_tokens = min(left, self.lanes.get_cold_share(self._chunk_share))
        before = budget.num_chunk_tokens
        preempted_any = self._schedule_running(cold, budget, scheduled)
        if admit and not preempted_any:
            self._admit_waiting(budget, scheduled, True)
        budget.num_chunk_tokens = left - (before - budget.num_chunk_tokens)

    def _computes_prompt(self, scheduled: dict[str, _Scheduled]) -> bool:
        """The step computes prompt tokens (some request was given more than one token), or
        leaves some wanting."""
        return any(item.num_new > 1 for item in scheduled.values()) or self._prompt_left_wanting(
            scheduled
        )

    def _prompt_left_wanting(self, scheduled: dict[str, _Scheduled]) -> bool:
        """Some request's tokens did not all fit this step: a turn still waiting, or a running
        request (a prefill chunk) clipped."""
        if self.waiting:
            return True
        for request in self.running:
            item = scheduled.get(request.request_id)
            if (item.num_new if item else 0) < request.num_tokens - request.num_computed_tokens:
                return True
        return False

    def _warm_left_wanting(self, scheduled: dict[str, _Scheduled]) -> bool:
        for request in self.running:
            if self.lanes.is_cold(request):
                continue
            item = scheduled.get(request.request_id)
            if (item.num_new if item else 0) < request.num_tokens - request.num_computed_tokens:
                return True
        return any(not self._joins_cold_lane(r) for r in self.waiting)

    def _joins_cold_lane(self, request: Request) -> bool:
        num_hit = self.kv.get_computed_blocks(request)[1]
        return self.lanes.joins_cold_lane(request.num_tokens, num_hit)

    def _get_chunk_share(self) -> int:
        """Tokens that requests given more than one token may take this step: the whole budget,
        unless some running request decodes (has one new token); then what keeps the step near
        ``decode_step_target_ms`` beside the decodes, by the cost model, but never less than
        ``decode_step_min_prefill_tokens``."""
        budget = self.config.max_num_batched_tokens
        target_ms = self.config.decode_step_target_ms
        num_decoding = sum(r.num_tokens - r.num_computed_tokens == 1 for r in self.running)
        if not target_ms or not num_decoding:
            return budget
        cost = self.cost_model.get_cost()
        # The target is a time per output token: a decode whose drafts verification keeps gains
        # several tokens a step, so the step may take that many targets and the decode still
        # reaches the rate; its drafts' rows count toward the step's time.
        kept, rows = self._decode_yield()
        share = cost.get_num_tokens(target_ms * kept, round(num_decoding * rows), num_decoding)
        return min(max(share, self.config.decode_step_min_prefill_tokens), budget)

    def _decode_yield(self) -> tuple[float, float]:
        """(tokens the slowest decode of a step kept, rows a decode ran), averaged over the
        recent steps with decodes; (1, 1) before any, and without drafts."""
        if not self._decode_steps:
            return 1.0, 1.0
        n = len(self._decode_steps)
        kept = sum(k for k, _ in self._decode_steps) / n
        return kept, sum(r for _, r in self._decode_steps) / n

    def _add_drafts(self, budget: _StepBudget, scheduled: dict[str, _Scheduled]) -> None:
        """Drafts go last, with what is left of the budget and the free blocks: they never
        take a block or a token that real tokens of this step need, nor release held KV. In a
        step that computes prompt tokens only requests that keep at least
        ``prefill_drafts_min_kept`` of their drafts draft (whether it does is asked once, and
        only if one would yield)."""
        min_kept = self.config.prefill_drafts_min_kept
        computes_prompt: bool | None = None
        for rid, item in scheduled.items():
            if budget.num_tokens <= 0:
                break
            if item.request.drafter is None:
                continue
            if min_kept > 0 and self.get_kept_fraction(item.request) < min_kept:
                if computes_prompt is None:
                    computes_prompt = self._computes_prompt(scheduled)
                if computes_prompt:
                    continue
            drafts = self._propose(item.request, item.num_new, budget)
            if not drafts:
                continue
            more_blocks = self.kv.allocate_slots(
                item.request, item.num_new + len(drafts), reclaim_held=False
            )
            if more_blocks is None:
                continue  # no room for them: this request decodes without
            pairs = zip(item.new_blocks.blocks, more_blocks.blocks, strict=True)
            blocks = tuple(a + b for a, b in pairs)
            new_blocks = KVCacheBlocks(blocks, item.new_blocks.held_kv)
            scheduled[rid] = item._replace(new_blocks=new_blocks, draft_token_ids=drafts)
            budget.take(0, len(drafts))

    def get_kept_fraction(self, request: Request) -> float:
        """The fraction of its drafts verification is expected to keep: the request's own once
        it has drafted ``PREFILL_DRAFTS_OWN_MIN`` tokens, else the engine's recent one (0 before
        any verification)."""
        drafter = request.drafter
        if drafter is not None and drafter.num_draft_tokens >= PREFILL_DRAFTS_OWN_MIN:
            return drafter.num_accepted_tokens / drafter.num_draft_tokens
        if self._recent_drafted <= 0:
            return 0.0
        return self._recent_kept / self._recent_drafted

    def _propose(self, request: Request, num_new: int, budget: _StepBudget) -> list[int]:
        """Drafts to follow the request's tokens, when these ``num_new`` reach its end: within
        the budget left, and never past ``max_tokens`` or the model context (all drafts
        accepted add one token more than their count); a constrained request's only as far as
        its grammar accepts them."""
        drafter = request.drafter
        if drafter is None or request.num_computed_tokens + num_new != request.num_tokens:
            return []
        max_num = min(
            budget.num_tokens - num_new,
            request.sampling.max_tokens - request.num_output_tokens - 1,
            self.max_model_len - request.num_tokens - 1,
        )
        drafts = drafter.propose(request.all_token_ids, max_num)
        if request.grammar is not None:
            drafts = request.grammar.draftable(drafts)
        return drafts

    def _clip(self, num_new: int, budget: _StepBudget) -> int:
        threshold = self.config.long_prefill_token_threshold
        if threshold:
            num_new = min(num_new, threshold)
        return budget.clip(num_new)

    def _clip_admitted(self, num_new: int, budget: _StepBudget) -> int:
        """A waiting request's tokens this step: a short turn's whole (up to
        ``long_prefill_token_threshold``), past the chunk share (``short_turn_tokens``: the
        turn's tokens, and those the step's short turns take past the share); anything else as
        ``_clip``."""
        if num_new <= self.config.short_turn_tokens and budget.fits_whole(num_new):
            threshold = self.config.long_prefill_token_threshold
            return min(num_new, threshold) if threshold else num_new
        return self._clip(num_new, budget)

    def _may_admit(self) -> bool:
        return self._window_open or not self.running

    def _admit_waiting(
        self, budget: _StepBudget, scheduled: dict[str, _Scheduled], cold: bool | None = None
    ) -> None:
        """Admit waiting requests in queue order while they fit; with lanes (``cold`` not None)
        only those of one lane, passing over the other's."""
        for request in list(self.waiting):
            if budget.num_tokens <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            hit_blocks, num_hit = self.kv.get_computed_blocks(request)
            is_cold = cold is not None and self.lanes.joins_cold_lane(request.num_tokens, num_hit)
            if cold is not None and is_cold != cold:
                continue
            num_new = self._clip_admitted(request.num_tokens - num_hit, budget)
            if num_new == 0:
                break  # the chunk share is spent; admission keeps the queue's order
            new_blocks = self.kv.allocate_slots(request, num_new, num_hit, hit_blocks)
            if new_blocks is None and (
                fitting := self._fit_alone(request, num_new, num_hit, hit_blocks)
            ):
                num_new = fitting
                new_blocks = self.kv.allocate_slots(request, num_new, num_hit, hit_blocks)
            if new_blocks is None:
                break  # the pool is full; running requests will free blocks
            self.waiting.remove(request)
            request.in_cold_lane = is_cold
            self._spend_held(request)
            self.running.append(request)
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            request.num_computed_tokens = num_hit
            request.status = RequestStatus.RUNNING
            self._known_to_runner.discard(request.request_id)
            scheduled[request.request_id] = _Scheduled(request, num_new, new_blocks, [])
            budget.take(num_new)

    def _fit_alone(
        self, request: Request, num_new: int, num_hit: int, hit_blocks: KVCacheBlocks | None
    ) -> int:
        """A smaller chunk for a request whose ``num_new`` tokens do not fit while no other
        request runs (nobody will free a block for it: it would wait forever, or preempt
        itself and come back to the same wall); 0 when it is not alone or no smaller one
        fits. ``check_fits`` ensured one block's worth always does, with the pool empty."""
        others = [r for r in self.running if r is not request]
        if others or num_new <= 1:
            return 0
        fitting = self.kv.get_num_fitting_tokens(request, num_new, num_hit, hit_blocks)
        return fitting if fitting < num_new else 0

    def _spend_held(self, request: Request) -> None:
        """Adopted or stale, the held KV a request names is spent once it runs or ends (held KV
        of another cache salt is not this request's to spend: it is left alone)."""
        if request.held_kv is None:
            return
        held = self.kv.get_held(request.held_kv)
        if held is not None and held.cache_salt == request.cache_salt:
            self.kv.release_held(request.held_kv)
        request.held_kv = None

    def _preempt(self, victim: Request, scheduled: dict[str, _Scheduled]) -> tuple[int, int]:
        """Preempt by recompute; returns the budget (real, draft tokens) the victim had taken
        this step."""
        self.running.remove(victim)
        self._free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add_preempted(victim)
        taken = scheduled.pop(victim.request_id, None)
        return (taken.num_new, len(taken.draft_token_ids)) if taken else (0, 0)

    def _build_output(self, scheduled: dict[str, _Scheduled]) -> SchedulerOutput:
        items = []
        for rid, (request, num_new, new_blocks, drafts) in scheduled.items():
            start = request.num_computed_tokens
            is_new = rid not in self._known_to_runner
            block_ids = self.kv.get_block_ids(rid) if is_new else new_blocks.get_block_ids()
            num_kept_blocks = self._kept_blocks.pop(rid, None)
            items.append(
                ScheduledRequest(
                    request_id=rid,
                    token_ids=request.all_token_ids[start : start + num_new] + drafts,
                    start_position=start,
                    new_block_ids=block_ids,
                    is_new=is_new,
                    sample=start + num_new == request.num_tokens,
                    sampling=request.sampling,
                    seed=request.seed,
                    num_output_tokens=request.num_output_tokens,
                    num_draft_tokens=len(drafts),
                    num_kept_blocks=None if is_new else num_kept_blocks,
                    prompt_targets=_prompt_targets(request, start, num_new),
                )
            )
            self._known_to_runner.add(rid)
            request.num_computed_tokens += num_new + len(drafts)  # drafts: until verified
            self.num_computed_tokens += num_new + len(drafts)
        finished, self._finished_ids = frozenset(self._finished_ids), set()
        self.num_steps += 1
        copies = self.kv.take_block_copies()
        return SchedulerOutput(items, sum(len(s.token_ids) for s in items), finished, copies)

    def update_from_output(
        self, output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[RequestOutput]:
        """Append sampled tokens (after drafts: every one verification kept), take rejected
        drafts back, finish requests that stop, and report deltas."""
        self._observe_step(output)
        deltas = []
        decodes: list[tuple[int, int]] = []  # (tokens kept, rows run) of this step's decodes
        for item in output.scheduled:
            token_id = runner_output.sampled_token_ids.get(item.request_id)
            request = self.requests.get(item.request_id)
            if request is not None and item.request_id in runner_output.prompt_logprobs:
                request.add_prompt_logprobs(
                    item.start_position, runner_output.prompt_logprobs[item.request_id]
                )
            if token_id is None or request is None or request.status != RequestStatus.RUNNING:
                continue  # a chunk that did not reach the end, or a request aborted meanwhile
            token_ids = [token_id, *runner_output.extra_token_ids.get(item.request_id, ())]
            rows = runner_output.logprobs.get(item.request_id)
            appended, logprobs = [], []
            for token_id in token_ids:
                if appended and request.grammar is not None and request.grammar.is_forced:
                    break  # its mask was the grammar's, not the budget's: sample it again
                appended.append(request.append_output_token(token_id))  # a grammar may swap it
                if rows is not None:
                    logprobs.append(rows[len(appended) - 1].get(appended[-1]))
                self.num_generated_tokens += 1
                if request.check_stop(self.max_model_len) or appended[-1] != token_id:
                    break  # after a swapped token, the drafts' KV is not this output's
            if len(item.token_ids) - item.num_draft_tokens == 1:
                decodes.append((len(appended), len(item.token_ids)))
            if item.num_draft_tokens:
                self._take_back_drafts(request, item.num_draft_tokens, len(appended) - 1)
            if request.is_finished:
                self.running.remove(request)
                self._free(request)
            elif item.num_draft_tokens and self.kv.trim_slots(request):
                self._kept_blocks[request.request_id] = -(
                    -request.num_computed_tokens // self.kv.block_size
                )
            deltas.append(make_output(request, appended, tuple(logprobs)))
        if decodes:
            rows = sum(r for _, r in decodes) / len(decodes)
            self._decode_steps.append((min(k for k, _ in decodes), rows))
        return deltas

    def _take_back_drafts(self, request: Request, num_drafted: int, num_accepted: int) -> None:
        """Verification kept the first ``num_accepted`` drafts: the rest were never tokens.
        The last token appended is computed next step (and after a stop inside the accepted
        drafts, what followed it was never output)."""
        request.num_computed_tokens = request.num_tokens - 1
        request.drafter.observe(num_drafted, num_accepted)
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        self._recent_drafted = self._recent_drafted * _RECENT_DECAY + num_drafted
        self._recent_kept = self._recent_kept * _RECENT_DECAY + num_accepted

    def _observe_step(self, output: SchedulerOutput) -> None:
        """Tell the cost model how long the step since schedule() took (the runner's time)."""
        if self._step_started is None or output.is_empty:
            return
        step_ms = (self.clock() - self._step_started) * 1e3
        self._step_started = None
        self.cost_model.observe(output.num_scheduled_tokens, len(output.scheduled), step_ms)

    def _free(self, request: Request) -> None:
        completed = request.status in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
        )
        if completed:  # a turn's end: the KV policy decides what stays
            self.kv.finish_turn(request, hold=request.hold_kv)
        else:
            self.kv.free(request)
        self._kept_blocks.pop(request.request_id, None)
        if completed:
            for sink in request.draft_sinks:
                sink.add(request.output_token_ids)
        if request.request_id in self._known_to_runner:
            self._known_to_runner.discard(request.request_id)
            self._finished_ids.add(request.request_id)
        if request.is_finished:
            del self.requests[request.request_id]

    def get_runner_request_ids(self) -> set[str]:
        """Requests the runner may still hold state for: known to it, or ended but not yet
        reported in a SchedulerOutput."""
        return self._known_to_runner | self._finished_ids

    def check_integrity(self, other_refs: Iterable[KVBlock] = ()) -> None:
        """``other_refs``: blocks referenced outside requests and held KV (loads in flight)."""
        self.kv.check_integrity(other_refs)
        running_ids = {r.request_id for r in self.running}
        waiting_ids = {r.request_id for r in self.waiting}
        assert not running_ids & waiting_ids, "a request is both running and waiting"
        parked_ids = set(self.parked)
        assert not parked_ids & (running_ids | waiting_ids), "a parked request is in line"
        assert running_ids | waiting_ids | parked_ids == set(self.requests), "index drifted"
        assert len(self.running) <= self.config.max_num_seqs
        held = set(self.kv.coordinator.managers[0].req_to_blocks)
        assert held <= running_ids, f"requests not running hold blocks: {held - running_ids}"
        for r in self.running:
            assert r.status == RequestStatus.RUNNING
            assert 0 <= r.num_computed_tokens <= r.num_tokens


def _prompt_targets(request: Request, start: int, num_new: int) -> tuple[int, ...]:
    """With prompt logprobs: the prompt tokens that the rows of positions ``[start, start +
    num_new)`` predict (the last prompt position predicts the first output: it samples)."""
    if request.sampling.prompt_logprobs is None:
        return ()
    end = min(start + num_new, request.num_prompt_tokens - 1)  # the last target position
    return tuple(request.all_token_ids[start + 1 : end + 1])


def make_output(
    request: Request, new_token_ids: list[int], logprobs: tuple[TokenLogprob, ...] = ()
) -> RequestOutput:
    return RequestOutput(
        request_id=request.request_id,
        new_token_ids=new_token_ids,
        finish_reason=FINISH_REASONS.get(request.status),
        stop_reason=request.stop_reason,
        num_prompt_tokens=request.num_prompt_tokens,
        num_cached_tokens=max(request.num_cached_tokens, 0),
        num_output_tokens=request.num_output_tokens,
        num_draft_tokens=request.num_draft_tokens,
        num_accepted_tokens=request.num_accepted_tokens,
        logprobs=logprobs,
        prompt_logprobs=request.take_prompt_logprobs() if new_token_ids else (),
    )
