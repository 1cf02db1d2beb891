"""Data-parallel attention beside expert parallel (DEP): which rank runs each request, in the
caller's process (``MultiprocExecutor`` asks it every step).

The scheduler and the KV manager plan one block-id space for all ranks; a block's KV exists
only on the rank that wrote it (each rank's pool is written only for its own requests). So a
request must run where its prefix is::

    new request (is_new)   its hit blocks (the first ceil(start / block_size) of its table)
                           have an owner r      -> rank r
                           none (no hit, or hit blocks every rank holds) -> the rank running
                                                   the fewest requests (the lowest on a tie)
    running request        the rank it was placed on (sticky: its KV and linear state are there)

Every block handed to a request becomes its rank's. A prefix chain never spans two ranks: a
request that extends a chain hit it, so it runs where the chain is. A preempted request comes
back as new and is placed again; if it moves, its old rank is told to drop its row (through
that rank's ``finished_request_ids``). Copy-on-write copies run on every rank; the copy belongs
to the source's rank. Offload pages are read from a block's rank and written to every rank
(then any rank may run a request that hits them: ``ALL_RANKS``).
"""

from __future__ import annotations

from agentx.engine.kv_cache import BlockCopy
from agentx.engine.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput

__all__ = ["ALL_RANKS", "AttentionRankManager"]

ALL_RANKS = -1  # a block written to every rank (a loaded offload page)


class AttentionRankManager:
    """Places requests on ranks and splits each step's work by rank (see the module)."""

    def __init__(self, num_ranks: int, block_size: int) -> None:
        self.num_ranks = num_ranks
        self.block_size = block_size
        self.rank_of: dict[str, int] = {}
        self.num_requests = [0] * num_ranks  # requests placed on each rank
        self.block_owner: dict[int, int] = {}  # block id -> the rank holding its KV
        # hit blocks a request's rank lacks: (block id, from rank, to rank), copied before the
        # step runs (take_copies)
        self._copies: list[tuple[int, int, int]] = []

    def split(self, out: SchedulerOutput) -> list[SchedulerOutput]:
        """One SchedulerOutput per rank: its requests' items, and the ended requests (plus
        those that moved away) whose rows it drops."""
        for rid in out.finished_request_ids:
            self._drop(rid)
        items: list[list[ScheduledRequest]] = [[] for _ in range(self.num_ranks)]
        moved: list[set[str]] = [set() for _ in range(self.num_ranks)]
        for item in out.scheduled:
            rank = self._place(item, moved)
            items[rank].append(item)
            for block_ids in item.new_block_ids:
                for block_id in block_ids:
                    if block_id:  # 0: the null block, never anyone's
                        self.block_owner[block_id] = rank
        return [
            SchedulerOutput(
                mine,
                sum(len(it.token_ids) for it in mine),
                out.finished_request_ids | frozenset(gone),
            )
            for mine, gone in zip(items, moved, strict=True)
        ]

    def split_masks(
        self, masks: tuple[list[str], object] | None
    ) -> list[tuple[list[str], object] | None]:
        """The grammar bitmask rows (request ids, (N, W) int32) of each rank's requests."""
        if masks is None:
            return [None] * self.num_ranks
        request_ids, bitmask = masks
        parts: list[tuple[list[str], object] | None] = []
        for rank in range(self.num_ranks):
            rows = [i for i, rid in enumerate(request_ids) if self.rank_of[rid] == rank]
            parts.append(([request_ids[i] for i in rows], bitmask[rows]) if rows else None)
        return parts

    @staticmethod
    def merge(outputs: list[ModelRunnerOutput]) -> ModelRunnerOutput:
        """The ranks' outputs as one (each request sampled on exactly one rank)."""
        merged = ModelRunnerOutput({})
        for part in outputs:
            merged.sampled_token_ids.update(part.sampled_token_ids)
            merged.extra_token_ids.update(part.extra_token_ids)
            merged.logprobs.update(part.logprobs)
            merged.prompt_logprobs.update(part.prompt_logprobs)
        return merged

    def forget(self, request_ids: frozenset[str]) -> None:
        for rid in request_ids:
            self._drop(rid)

    def copy_blocks(self, copies: list[BlockCopy]) -> None:
        for copy in copies:
            self.block_owner[copy.dst_block_id] = self.owner_of(copy.src_block_id)

    def mark_everywhere(self, block_ids: list[int]) -> None:
        """The blocks were written to every rank (offload pages loaded)."""
        for block_id in block_ids:
            self.block_owner[block_id] = ALL_RANKS

    def owner_of(self, block_id: int) -> int:
        """The rank holding the block's KV (``ALL_RANKS``: every one, or none wrote it)."""
        return self.block_owner.get(block_id, ALL_RANKS)

    def check_integrity(self, rows_per_rank: list[set[str]]) -> None:
        """Each rank keeps rows only of requests placed on it; the counts match the places."""
        for rank, rows in enumerate(rows_per_rank):
            strays = {rid for rid in rows if self.rank_of.get(rid) != rank}
            assert not strays, f"rank {rank} keeps rows of requests placed elsewhere: {strays}"
        counts = [0] * self.num_ranks
        for rank in self.rank_of.values():
            counts[rank] += 1
        assert counts == self.num_requests, f"request counts {self.num_requests} != {counts}"

    def _place(self, item: ScheduledRequest, moved: list[set[str]]) -> int:
        rid = item.request_id
        old = self.rank_of.get(rid)
        if not item.is_new:
            if old is None:
                raise RuntimeError(f"request {rid!r} continues but was never placed on a rank")
            return old
        self._drop(rid)
        rank = self._hit_rank(item)
        if rank is None:
            rank = min(range(self.num_ranks), key=lambda r: (self.num_requests[r], r))
        self._copies.extend((b, o, rank) for b, o in self._hit_owners(item) if o != rank)
        if old is not None and old != rank:
            moved[old].add(rid)
        self.rank_of[rid] = rank
        self.num_requests[rank] += 1
        return rank

    def take_copies(self) -> list[tuple[int, int, int]]:
        """Drain the hit blocks to copy between ranks before this step: (block id, from, to)."""
        copies, self._copies = self._copies, []
        return copies

    def _hit_rank(self, item: ScheduledRequest) -> int | None:
        """The rank holding the request's prefix hit, None when no hit block has one."""
        owners = [o for _, o in self._hit_owners(item)]
        return owners[-1] if owners else None

    def _hit_owners(self, item: ScheduledRequest) -> list[tuple[int, int]]:
        """(block id, rank) of the request's hit blocks that one rank holds. Two requests
        that computed the same prefix in one step on two ranks leave a cached chain on both
        (the prefix on one, a suffix on the other): its blocks are copied (take_copies)."""
        num_hit_blocks = -(-item.start_position // self.block_size)
        found = []
        for block_ids in item.new_block_ids:
            for block_id in block_ids[:num_hit_blocks]:
                owner = self.owner_of(block_id)
                if block_id and owner != ALL_RANKS:
                    found.append((block_id, owner))
        return found

    def _drop(self, rid: str) -> None:
        rank = self.rank_of.pop(rid, None)
        if rank is not None:
            self.num_requests[rank] -= 1
