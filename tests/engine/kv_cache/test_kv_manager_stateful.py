"""A state machine over the KV manager: requests allocate (taking prefix hits and held KV),
decode, are held, forked, continued, released and freed in any order, under a pool small
enough that held KV is reclaimed (evicted) to make room; ``check_integrity()`` holds after
every step, and nothing is left used once every request is freed and every handle released.
With partial hits (``PartialHitsMachine``) steps begin and end too: every copy a hit asks for
reads a block published before the step, holding the tokens the hit counts as cached, and
writes the block the request computes next.

Deterministic (``derandomize``): 100 runs of up to 30 steps, a few seconds. The offload tiers
join in ``tests/engine/offload/test_offload_stateful.py``."""

import itertools

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)

from agentx.engine.request import RequestStatus
from tests.helpers.kv import make_manager, make_request

NUM_BLOCKS = 12  # 11 usable blocks of 4 tokens: pressure after a few requests
# a small alphabet: prompts share prefixes, so the prefix cache hits
tokens = st.lists(st.integers(0, 3), min_size=1, max_size=14)


class KVManagerMachine(RuleBasedStateMachine):
    held = Bundle("held")

    partial_hits = False

    def __init__(self) -> None:
        super().__init__()
        self.kv = make_manager(NUM_BLOCKS, partial_hits=self.partial_hits)
        self.running: dict[str, object] = {}
        self.ids = itertools.count()

    def _admit(self, prompt: list[int], held_kv: str | None = None) -> None:
        request = make_request(f"r{next(self.ids)}", prompt, hold_kv=True, held_kv=held_kv)
        hit, num_hit = self.kv.get_computed_blocks(request)
        src = hit.partial_src
        if src is not None:
            start = num_hit - num_hit % 4  # a partial hit ends inside a block
            assert src.cached_step < self.kv.pool.step and src.block_hash is not None
            assert list(src.token_ids[: num_hit - start]) == prompt[start:num_hit]
        if self.kv.allocate_slots(request, request.num_tokens - num_hit, num_hit, hit) is None:
            assert self.kv.get_blocks(request.request_id).get_block_ids() == ([],)
            assert self.kv.take_block_copies() == []
            return  # the pool cannot hold it now: nothing changed for it
        copies = self.kv.take_block_copies()
        if src is None:
            assert copies == []
        else:
            blocks = self.kv.get_block_ids(request.request_id)[0]
            assert [(c.src_block_id, c.dst_block_id) for c in copies] == [
                (src.block_id, blocks[start // 4])
            ]
        request.num_computed_tokens = request.num_tokens
        self.running[request.request_id] = request

    @rule()
    def next_step(self):
        self.kv.begin_step()

    @rule(prompt=tokens)
    def start(self, prompt):
        self._admit(prompt)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), token=st.integers(0, 3))
    def decode(self, data, token):
        rid = data.draw(st.sampled_from(sorted(self.running)))
        request = self.running[rid]
        request.append_output_token(token)
        if self.kv.allocate_slots(request, 1) is None:  # preempted: its blocks go back
            self.kv.free(request)
            del self.running[rid]
            return
        request.num_computed_tokens += 1

    @precondition(lambda self: self.running)
    @rule(target=held, data=st.data())
    def hold(self, data):
        rid = data.draw(st.sampled_from(sorted(self.running)))
        request = self.running.pop(rid)
        request.status = RequestStatus.FINISHED_STOPPED
        self.kv.hold(request)
        return rid

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.running)))
        self.kv.free(self.running.pop(rid))

    @rule(target=held, handle=held)
    def fork(self, handle):
        new = f"{handle}/f{next(self.ids)}"
        copies = self.kv.fork_held(handle, [new])
        if copies is None:
            return None  # gone (reclaimed) or no room for the tail copy
        assert all(c.src_block_id != c.dst_block_id for c in copies)
        return new

    @rule(handle=consumes(held), extra=tokens)
    def resume(self, handle, extra):
        """The next turn of a held sequence adopts it (or the prefix cache if it was
        reclaimed)."""
        held = self.kv.get_held(handle)
        if held is not None:
            self._admit(held.token_ids + extra, held_kv=handle)
            self.kv.release_held(handle)  # a no-op when the request adopted it

    @rule(handle=consumes(held), drop_cached=st.booleans())
    def release(self, handle, drop_cached):
        self.kv.release_held(handle, drop_cached)

    @rule(handle=held, pinned=st.booleans())
    def pin(self, handle, pinned):
        self.kv.pin_held(handle, pinned)

    @invariant()
    def integrity(self):
        self.kv.check_integrity()

    def teardown(self):
        for request in self.running.values():
            self.kv.free(request)
        for held in list(self.kv.held):
            self.kv.release_held(held.handle)
        self.kv.check_integrity()
        assert self.kv.get_num_used_blocks() == 0, "a block leaked"


KVManagerMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=30,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_kv_manager_state_machine = KVManagerMachine.TestCase


class PartialHitsMachine(KVManagerMachine):
    partial_hits = True


PartialHitsMachine.TestCase.settings = KVManagerMachine.TestCase.settings
test_kv_manager_partial_hits_state_machine = PartialHitsMachine.TestCase
