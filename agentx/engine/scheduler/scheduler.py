"""The token-budget scheduler.

Each step hands out one budget of ``max_num_batched_tokens``: running requests first (in
admission order), then waiting ones in policy order. A request is given
``num_tokens - num_computed_tokens`` new tokens, capped by ``long_prefill_token_threshold`` and
by what is left of the budget. There are no prefill or decode phases: a decode is a request one
token behind, a chunked prefill is a request the budget clipped.

When the pool runs out, the policy's victim is preempted by recompute: its blocks go back to the
pool with their cached content, so on resume it takes a prefix hit on what survived.
"""

from __future__ import annotations

from collections.abc import Iterable

from agentx.config import SchedulerConfig
from agentx.engine.kv_cache import KVCacheBlocks, KVCacheManager
from agentx.engine.outputs import (
    ModelRunnerOutput,
    RequestOutput,
    ScheduledRequest,
    SchedulerOutput,
)
from agentx.engine.request import FINISH_REASONS, Request, RequestStatus
from agentx.engine.scheduler.queues import QUEUES
from agentx.errors import PromptTooLongError

_COMPLETED = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, kv_manager: KVCacheManager, max_model_len: int
    ) -> None:
        self.config = config
        self.kv = kv_manager
        self.max_model_len = max_model_len
        self.queue_cls = QUEUES[config.policy]
        self.waiting = self.queue_cls()
        self.running: list[Request] = []
        self.parked: dict[str, Request] = {}  # waiting on an offload load, out of line
        self.requests: dict[str, Request] = {}
        self._finished_ids: set[str] = set()  # not yet reported to the runner
        self._known_to_runner: set[str] = set()
        self.num_steps = 0
        self.num_preemptions = 0
        self.num_computed_tokens = 0
        self.num_reused_tokens = 0
        self.num_generated_tokens = 0

    # ---- admission -------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request; reject one the pool could never hold, even alone."""
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        max_len = min(request.num_prompt_tokens + request.sampling.max_tokens, self.max_model_len)
        num_blocks = self.kv.get_max_num_blocks(max_len)
        if num_blocks > self.kv.pool.num_blocks - 1:
            raise PromptTooLongError(
                f"request needs up to {max_len} tokens of KV cache "
                f"({request.num_prompt_tokens} prompt + up to {request.sampling.max_tokens} "
                f"output), {num_blocks} blocks, but the pool holds "
                f"{self.kv.pool.num_blocks - 1}: lower max_tokens or grow the pool"
            )
        self.requests[request.request_id] = request
        self.waiting.add(request)

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
        budget = self.config.max_num_batched_tokens
        # request id -> (request, n tokens, new KV blocks)
        scheduled: dict[str, tuple[Request, int, KVCacheBlocks]] = {}
        preempted_any = False

        for request in list(self.running):
            if budget <= 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = self._clip(request.num_tokens - request.num_computed_tokens, budget)
            while (new_blocks := self.kv.allocate_slots(request, num_new)) is None:
                victim = self.queue_cls.pick_victim(self.running)
                budget += self._preempt(victim, scheduled)
                preempted_any = True
                if victim is request:
                    break
            if new_blocks is None:
                continue
            scheduled[request.request_id] = (request, num_new, new_blocks)
            budget -= num_new

        if not preempted_any and self._may_admit():
            budget = self._admit_waiting(budget, scheduled)

        return self._build_output(scheduled)

    def _clip(self, num_new: int, budget: int) -> int:
        threshold = self.config.long_prefill_token_threshold
        if threshold:
            num_new = min(num_new, threshold)
        return min(num_new, budget)

    def _may_admit(self) -> bool:
        interval = self.config.prefill_schedule_interval
        return interval == 1 or not self.running or self.num_steps % interval == 0

    def _admit_waiting(
        self, budget: int, scheduled: dict[str, tuple[Request, int, KVCacheBlocks]]
    ) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            hit_blocks, num_hit = self.kv.get_computed_blocks(request)
            num_new = self._clip(request.num_tokens - num_hit, budget)
            new_blocks = self.kv.allocate_slots(request, num_new, num_hit, hit_blocks)
            if new_blocks is None:
                break  # the pool is full; running requests will free blocks
            self.waiting.pop()
            if request.extends is not None:
                # adopted or stale: either way the handle is spent once its request runs
                self.kv.release_held(request.extends)
                request.extends = None
            self.running.append(request)
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            request.num_computed_tokens = num_hit
            request.status = RequestStatus.RUNNING
            self.num_reused_tokens += num_hit
            self._known_to_runner.discard(request.request_id)
            scheduled[request.request_id] = (request, num_new, new_blocks)
            budget -= num_new
        return budget

    def _preempt(
        self, victim: Request, scheduled: dict[str, tuple[Request, int, KVCacheBlocks]]
    ) -> int:
        """Preempt by recompute; returns the budget the victim had taken this step."""
        self.running.remove(victim)
        self._free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add_preempted(victim)
        taken = scheduled.pop(victim.request_id, None)
        return taken[1] if taken else 0

    def _build_output(
        self, scheduled: dict[str, tuple[Request, int, KVCacheBlocks]]
    ) -> SchedulerOutput:
        items = []
        for rid, (request, num_new, new_blocks) in scheduled.items():
            start = request.num_computed_tokens
            is_new = rid not in self._known_to_runner
            block_ids = self.kv.get_block_ids(rid) if is_new else new_blocks.get_block_ids()
            items.append(
                ScheduledRequest(
                    request_id=rid,
                    token_ids=request.all_token_ids[start : start + num_new],
                    start_position=start,
                    new_block_ids=block_ids,
                    is_new=is_new,
                    sample=start + num_new == request.num_tokens,
                    sampling=request.sampling,
                    seed=request.seed,
                    num_output_tokens=request.num_output_tokens,
                )
            )
            self._known_to_runner.add(rid)
            request.num_computed_tokens += num_new
            self.num_computed_tokens += num_new
        finished, self._finished_ids = frozenset(self._finished_ids), set()
        self.num_steps += 1
        return SchedulerOutput(items, sum(len(s.token_ids) for s in items), finished)

    def update_from_output(
        self, output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[RequestOutput]:
        """Append sampled tokens, finish requests that stop, and report deltas."""
        deltas = []
        for item in output.scheduled:
            token_id = runner_output.sampled_token_ids.get(item.request_id)
            request = self.requests.get(item.request_id)
            if token_id is None or request is None or request.status != RequestStatus.RUNNING:
                continue  # a chunk that did not reach the end, or a request aborted meanwhile
            token_id = request.append_output_token(token_id)  # a grammar's budget may swap it
            self.num_generated_tokens += 1
            if request.check_stop(self.max_model_len):
                self.running.remove(request)
                self._free(request)
            deltas.append(make_output(request, [token_id]))
        return deltas

    def _free(self, request: Request) -> None:
        completed = request.status in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
        )
        if request.retain_kv and completed:
            self.kv.hold(request)
        else:
            self.kv.free(request)
        if request.request_id in self._known_to_runner:
            self._known_to_runner.discard(request.request_id)
            self._finished_ids.add(request.request_id)
        if request.is_finished:
            del self.requests[request.request_id]

    def get_runner_request_ids(self) -> set[str]:
        """Requests the runner may still hold state for: known to it, or ended but not yet
        reported in a SchedulerOutput."""
        return self._known_to_runner | self._finished_ids

    def check_integrity(self) -> None:
        self.kv.check_integrity()
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


def make_output(request: Request, new_token_ids: list[int]) -> RequestOutput:
    return RequestOutput(
        request_id=request.request_id,
        new_token_ids=new_token_ids,
        finish_reason=FINISH_REASONS.get(request.status),
        stop_reason=request.stop_reason,
        num_prompt_tokens=request.num_prompt_tokens,
        num_cached_tokens=max(request.num_cached_tokens, 0),
        num_output_tokens=request.num_output_tokens,
    )
