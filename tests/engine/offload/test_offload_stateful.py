"""A state machine over the KV manager and the offload manager together, as the engine core
drives them: requests allocate (taking prefix hits, held KV and tier hits), decode, are held,
forked, resumed, released, pinned and aborted; a pressure request evicts cached blocks and
reclaims held KV; finished turns are stored to a small host tier and a disk tier below it,
demoted while their tool runs and prefetched back; a request whose prefix is in a tier parks
until its load lands. Transfers land only when the machine says (``StepWorker``), so loads and
stores are in flight across any other step.

After every step: ``check_integrity()`` of the KV manager (counting what in-flight loads
reference), of the offload manager and of its tiers; every cached device block holds the KV
of its own hash (a page loaded from a tier included); no handle the machine released or
spent is held again. At the end nothing is used, pinned in a tier or in flight.

Deterministic (``derandomize``), 200 runs of up to 40 steps, a few seconds."""

import itertools
import shutil
import tempfile

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

from agentx.config import OffloadConfig
from agentx.engine.hints import ToolLatency
from agentx.engine.offload import DiskTier, HostTier, TieredStore
from agentx.engine.offload.manager import OffloadManager
from agentx.engine.request import Request, RequestStatus
from tests.helpers.kv import BLOCK_SIZE, make_kv, make_request
from tests.helpers.offload import DevicePages, StepWorker

NUM_EXAMPLES = 200
NUM_STEPS = 40
NUM_BLOCKS = 14  # 13 usable blocks of 4 tokens: pressure after a few requests
HOST_BLOCKS = 6  # the host tier evicts into the disk tier below it
DISK_BLOCKS = 10
PAGE_BYTES = 16  # a page holds its block's hash: the KV a forward would have written

tokens = st.lists(st.integers(0, 3), min_size=1, max_size=18)  # shared prefixes: hits
salts = st.sampled_from([b"", b"", b"tenant-b"])
tool_seconds = st.one_of(st.none(), st.sampled_from([1.0, 5.0]))


class KVOffloadMachine(RuleBasedStateMachine):
    held = Bundle("held")

    def __init__(self) -> None:
        super().__init__()
        self.kv = make_kv(NUM_BLOCKS)
        self.pages = DevicePages(NUM_BLOCKS, PAGE_BYTES)
        self.folder = tempfile.mkdtemp(prefix="agentx-offload-sm-")
        self.worker = StepWorker()
        tiers = [
            HostTier(PAGE_BYTES, HOST_BLOCKS),
            DiskTier(self.folder, "sm", PAGE_BYTES, DISK_BLOCKS * PAGE_BYTES),
        ]
        self.now = 100.0
        config = OffloadConfig(host_bytes=HOST_BLOCKS * PAGE_BYTES, prefetch_margin_s=0.5)
        self.offload = OffloadManager(
            TieredStore(tiers, worker=self.worker),
            self.kv,
            self.pages,
            config,
            clock=lambda: self.now,
        )
        self.running: dict[str, Request] = {}
        self.parked: dict[str, Request] = {}
        self.first_own: dict[str, int] = {}  # blocks before this index were hits, not written
        self.tokens_of: dict[str, list[int]] = {}  # a held handle's tokens, as the session knows
        self.salt_of: dict[str, bytes] = {}
        self.gone: set[str] = set()  # handles released or spent: never held again
        self.ids = itertools.count()

    # ---- the engine core's side ----------------------------------------------------------

    def _submit(self, prompt, salt, seconds=None, held_kv=None) -> None:
        hints = (ToolLatency(seconds),) if seconds is not None else ()
        request = make_request(
            f"r{next(self.ids)}",
            prompt,
            hold_kv=True,
            held_kv=held_kv,
            cache_salt=salt,
            hints=hints,
        )
        if self.offload.on_request(request):
            self.parked[request.request_id] = request  # its prefix loads from a tier
        else:
            self._admit(request)

    def _admit(self, request: Request) -> None:
        hit, num_hit = self.kv.get_computed_blocks(request)
        new = self.kv.allocate_slots(request, request.num_tokens - num_hit, num_hit, hit)
        if new is None:  # the pool cannot hold it now: it ends unserved
            assert self.kv.get_block_ids(request.request_id) == ([],)
            self._end_unserved(request)
            return
        self.first_own[request.request_id] = num_hit // BLOCK_SIZE
        request.num_computed_tokens = request.num_tokens
        request.status = RequestStatus.RUNNING
        self._spend_held(request)
        self.running[request.request_id] = request
        self._forward(request)

    def _spend_held(self, request: Request) -> None:
        """As the scheduler: adopted or stale, the held KV a request names is spent."""
        handle = request.held_kv
        if handle is None:
            return
        held = self.kv.get_held(handle)
        if held is None or held.cache_salt == request.cache_salt:
            self.kv.release_held(handle)  # a no-op when the request adopted it
            self.gone.add(handle)  # the session moved on from it: nobody names it again
        request.held_kv = None

    def _end_unserved(self, request: Request) -> None:
        request.status = RequestStatus.FINISHED_ABORTED
        self._spend_held(request)

    def _forward(self, request: Request) -> None:
        """The step's forward writes the KV of the request's own blocks, then the offload
        manager stores what the step published."""
        blocks = self.kv.get_blocks(request.request_id).blocks[0]
        for block in blocks[self.first_own[request.request_id] :]:
            if block.block_hash is not None and self.pages.read(block.block_id) != block.block_hash:
                self.pages.write(block.block_id, block.block_hash)
        self.offload.after_step()

    def _requeue(self, ready) -> None:
        """As ``EngineCore._requeue``: a loaded request extends the KV its load made."""
        for request_id, handle in ready:
            request = self.parked.pop(request_id, None)
            if request is None or request.is_finished:
                self.kv.release_held(handle)  # aborted while it loaded
                self.gone.add(handle)
                continue
            if handle in self.kv.held:
                self._spend_held(request)  # the loaded KV replaces what it named
                request.held_kv = handle
            self._admit(request)

    def _pick(self, data, requests: dict[str, Request]) -> Request:
        return requests[data.draw(st.sampled_from(sorted(requests)))]

    # ---- rules -----------------------------------------------------------------------------

    @rule(prompt=tokens, salt=salts, seconds=tool_seconds)
    def start(self, prompt, salt, seconds):
        self._submit(prompt, salt, seconds)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), token=st.integers(0, 3))
    def decode(self, data, token):
        request = self._pick(data, self.running)
        request.append_output_token(token)
        if self.kv.allocate_slots(request, 1) is None:  # preempted: its blocks go back
            self.kv.free(request)
            del self.running[request.request_id]
            request.status = RequestStatus.FINISHED_ABORTED
            return
        request.num_computed_tokens += 1
        self._forward(request)

    @precondition(lambda self: self.running)
    @rule(target=held, data=st.data())
    def hold(self, data):
        request = self._pick(data, self.running)
        del self.running[request.request_id]
        request.status = RequestStatus.FINISHED_STOPPED
        self.kv.finish_turn(request, hold=True)
        self.offload.after_step()  # a tool latency hint: demoted, its prefetch planned
        rid = request.request_id
        self.tokens_of[rid] = request.all_token_ids[: request.num_computed_tokens]
        self.salt_of[rid] = request.cache_salt
        return rid

    @precondition(lambda self: self.running)
    @rule(data=st.data(), aborted=st.booleans())
    def finish(self, data, aborted):
        request = self._pick(data, self.running)
        del self.running[request.request_id]
        if aborted:
            request.status = RequestStatus.FINISHED_ABORTED
            self.kv.free(request)
        else:
            request.status = RequestStatus.FINISHED_STOPPED
            self.kv.finish_turn(request, hold=False)
        self.offload.after_step()

    @precondition(lambda self: self.parked)
    @rule(data=st.data())
    def abort_parked(self, data):
        request = self.parked.pop(self._pick(data, self.parked).request_id)
        request.status = RequestStatus.FINISHED_ABORTED  # its load still lands
        self._spend_held(request)

    @rule(target=held, handle=held)
    def fork(self, handle):
        new = f"{handle}/f{next(self.ids)}"
        copies = self.kv.fork_held(handle, [new])
        if copies is None:
            return handle  # gone (reclaimed) or no room for the tail copy: nothing new
        for copy in copies:  # the runner copies the tail blocks
            self.pages.pages[copy.dst_block_id] = self.pages.pages[copy.src_block_id]
        self.tokens_of[new] = self.tokens_of[handle]
        self.salt_of[new] = self.salt_of[handle]
        return new

    @rule(handle=consumes(held), extra=tokens)
    def resume(self, handle, extra):
        """The session's next turn names its held KV (maybe reclaimed, maybe in a tier)."""
        if handle in self.gone:
            return
        self._submit(self.tokens_of[handle] + extra, self.salt_of[handle], held_kv=handle)

    @rule(handle=consumes(held), drop_cached=st.booleans())
    def release(self, handle, drop_cached):
        if handle in self.gone:
            return
        self.offload.on_release(handle, drop_cached)
        self.kv.release_held(handle, drop_cached)
        self.gone.add(handle)

    @rule(handle=held, pinned=st.booleans())
    def pin(self, handle, pinned):
        if handle not in self.gone:
            self.offload.pin(handle, pinned)
            self.kv.pin_held(handle, pinned)

    @rule(num_blocks=st.integers(1, NUM_BLOCKS - 1))
    def pressure(self, num_blocks):
        """A request of unshared tokens takes ``num_blocks`` (evicting cached blocks,
        reclaiming held KV), then is preempted in the step that scheduled it."""
        base = 1000 + 100 * next(self.ids)
        request = make_request(f"p{base}", list(range(base, base + num_blocks * BLOCK_SIZE)))
        if self.kv.allocate_slots(request, request.num_tokens) is not None:
            self.kv.free(request)

    @rule(num_jobs=st.integers(1, 3))
    def transfer(self, num_jobs):
        self.worker.run(num_jobs)

    @rule()
    def poll(self):
        self._requeue(self.offload.poll())

    @rule(seconds=st.sampled_from([0.3, 1.0, 5.0]))
    def time_passes(self, seconds):
        self.now += seconds
        self._requeue(self.offload.poll())  # prefetches due start here

    @rule()
    def flush(self):
        self.offload.flush()
        self._requeue(self.offload.take_ready())

    # ---- what holds after every step -------------------------------------------------------

    @invariant()
    def integrity(self):
        self.kv.check_integrity(self.offload.get_referenced_blocks())
        self.offload.check_integrity()
        for block in self.kv.pool.blocks[1:]:
            if block.block_hash is not None:
                assert self.pages.read(block.block_id) == block.block_hash, (
                    f"block {block.block_id} is cached with another block's KV"
                )
        resurrected = {h.handle for h in self.kv.held} & self.gone
        assert not resurrected, f"released held KV is held again: {resurrected}"

    def teardown(self):
        for request in self.running.values():
            self.kv.free(request)
        for request in self.parked.values():
            request.status = RequestStatus.FINISHED_ABORTED
            self._spend_held(request)
        self.offload.flush()
        self._requeue(self.offload.take_ready())
        for held in list(self.kv.held):
            self.offload.on_release(held.handle, False)
            self.kv.release_held(held.handle)
        self.offload.after_step()
        self.kv.check_integrity()
        self.offload.check_integrity()
        assert self.kv.get_num_used_blocks() == 0, "a block leaked"
        assert self.offload.tier_pins == {} and self.offload.loads == {}
        for stats in self.offload.store.get_stats():
            assert stats.num_in_flight == 0, f"{stats.name}: {stats.num_in_flight} in flight"
        self.offload.close()
        shutil.rmtree(self.folder, ignore_errors=True)


KVOffloadMachine.TestCase.settings = settings(
    max_examples=NUM_EXAMPLES,
    stateful_step_count=NUM_STEPS,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_kv_and_offload_state_machine = KVOffloadMachine.TestCase
