"""P/D disaggregation: prefill (P) and decode (D) instances behind one coordinator.

Each instance is a whole Engine in a process of its own (worker.py, instance.py); they share
an offload tier (a disk folder, or one Mooncake master: ``mooncake="auto"`` starts one for the
run). The coordinator lives in the caller's process and routes each turn::

    cold turn   P: prompt, max_tokens=1, hold_kv       -> the first token, to the caller
                P.export_held(include_tail)            full blocks + the partial last block
                D.import_held(export)                  through the shared tier
                D: prompt + [first], held_kv=imported  -> the rest, to the same stream
    warm turn   on the D instance holding the session's KV (its last turn ran there):
                new tokens <= local_prefill_tokens     D prefills them itself (no hand-over)
                more                                   D.flush_offload, then a cold turn: P
                                                       loads D's blocks from the tier, prefills
                                                       the rest and hands over again

The coordinator is an :class:`EngineBackend` (``Session(coordinator)``): a request naming held
KV (``held_kv``) continues the session whose last turn left that handle on its D instance; one
holding KV without naming any (``hold_kv``) starts a session named by its request id. Forks,
pins, grammars and logprobs are not handed over (``capabilities`` says so).

The caller sees one :class:`RequestStream` per request, as from an Engine: the first delta from
P, the rest from D, usage counted over the whole request (``num_cached_tokens``: P's hits).
Greedy tokens equal a colocated engine's: D continues from exactly the KV P computed, the
partial block included (tests/engine/disagg/test_disagg.py).

Faults: an instance whose process dies fails the requests it ran or was handing over with
:class:`InstanceDeadError` (its reader thread sees the death at once, so nobody waits on it);
sessions whose KV it held start cold on their next turn; the other instances keep serving.

Threads: instance reader threads deliver deltas (sinks below, never calling an instance);
hand-overs and releases run on a small pool, since they call two instances in turn. The lock
guards the coordinator's own maps only, never a call.
"""

from __future__ import annotations

import itertools
import multiprocessing
import threading
from collections import Counter
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields, replace

from agentx.config import DisaggConfig, EngineConfig
from agentx.engine.backend import EngineBackend, EngineCapabilities, Prompt, UnsupportedWarnings
from agentx.engine.disagg.flight import (
    DisaggCounters,
    Flight,
    SessionKV,
    call_quietly,
    num_new_tokens,
)
from agentx.engine.disagg.instance import EngineInstance
from agentx.engine.models.tokenizer import Tokenizer
from agentx.engine.offload.mooncake_master import MooncakeMaster
from agentx.engine.outputs import EngineStats, RequestOutput
from agentx.engine.parallel.bootstrap import refuse_spawn_while_bootstrapping
from agentx.engine.request import RequestOptions
from agentx.engine.router import has_shared_tier
from agentx.engine.sampling import SamplingParams
from agentx.engine.streams import RequestStream
from agentx.errors import (
    AgentXError,
    ConfigError,
    EngineClosedError,
    EngineDeadError,
    InstanceDeadError,
    InvalidRequestError,
    RequestAbortedError,
)

HandoverHook = Callable[[str, str], None]  # (stage: "export" | "import", request id)


class DisaggCoordinator(EngineBackend):
    """``disagg.num_prefill`` P and ``disagg.num_decode`` D instances built from ``config``.

    Raises ConfigError without a tier the instances share, InstanceDeadError if an instance
    fails to start (the others are closed). ``handover_hook(stage, request_id)`` runs on the
    hand-over thread before each stage (tests kill an instance there).
    """

    def __init__(
        self,
        config: EngineConfig,
        disagg: DisaggConfig | None = None,
        *,
        handover_hook: HandoverHook | None = None,
    ) -> None:
        self.disagg = disagg or DisaggConfig()
        if config.parallel.dp != 1:
            raise ConfigError("P/D instances are single engines: use parallel.dp=1")
        self.master: MooncakeMaster | None = None
        if config.offload.mooncake == "auto":  # one master for every instance
            self.master = MooncakeMaster(allow_network=config.offload.mooncake_allow_network)
            self.master.start()
            config = replace(config, offload=replace(config.offload, mooncake=self.master.address))
        if not has_shared_tier(config.offload):
            raise ConfigError(
                "P/D disaggregation hands KV over through a tier every instance reads: "
                "OffloadConfig(disk_path=...) or mooncake (an address, or 'auto')"
            )
        self.config = config
        self.handover_hook = handover_hook
        self.counters = DisaggCounters()
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._flights: dict[str, Flight] = {}
        self._sessions: dict[str, SessionKV] = {}
        self._releases: set[futures.Future] = set()  # queued by _release_soon
        self._closed = False
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="agentx-handover")
        refuse_spawn_while_bootstrapping()
        context = multiprocessing.get_context("spawn")  # fork would copy the caller's threads
        self.prefill: list[EngineInstance] = []
        self.decode: list[EngineInstance] = []
        try:
            for i in range(self.disagg.num_prefill):
                self.prefill.append(EngineInstance(f"prefill-{i}", config, context))
            for i in range(self.disagg.num_decode):
                self.decode.append(EngineInstance(f"decode-{i}", config, context))
            for instance in self.instances:
                instance.wait_started()
            tokenizer, self.max_model_len, self._block_size = self.prefill[0].call("describe")
        except BaseException:
            self.close()
            raise
        self.tokenizer = Tokenizer.from_cache_json(tokenizer)
        self._warnings = UnsupportedWarnings("agentx-pd")

    @property
    def instances(self) -> list[EngineInstance]:
        return self.prefill + self.decode

    # ---- requests ----------------------------------------------------------------------------

    def add_request(
        self,
        prompt: Prompt,
        sampling: SamplingParams | None = None,
        *,
        session_id: str | None = None,
        request_id: str | None = None,
        options: RequestOptions | None = None,
    ) -> RequestStream:
        """Route and queue a request; its deltas arrive on the returned stream. A session's
        turns must each extend the last one's prompt and output (as ``held_kv`` requires);
        the coordinator holds the KV between turns (``end_session`` releases it)."""
        sampling = sampling or SamplingParams()
        options = options or RequestOptions()
        if sampling.structured is not None:
            raise InvalidRequestError("a grammar's state is not handed over P -> D")
        if sampling.logprobs is not None or sampling.prompt_logprobs is not None:
            raise InvalidRequestError("logprobs are not handed over P -> D: use one Engine")
        if options.hold_kv or options.held_kv is not None:
            if session_id is not None:
                raise InvalidRequestError("the coordinator holds KV per session_id or per handle")
            session_id = self._session_of(options.held_kv, request_id)
            request_id = request_id if request_id is not None else f"pd-{next(self._ids)}"
            session_id = session_id or request_id  # a new session, named by its first turn
            options = replace(options, hold_kv=False, held_kv=None)
        if options.draft_source is not None:
            options = replace(options, draft_source=None)  # another process drafts its own
        self._check_open()
        prompt_ids = self._encode(prompt)
        with self._lock:
            flight, placed = self._route(prompt_ids, sampling, options, session_id, request_id)
        local = flight.stage == "decode"  # the stage moves on on other threads from here
        try:
            if local:
                self._start_decode(flight, prompt_ids, placed.handle)
            else:
                if placed is not None:  # P finds the session's blocks in the tier
                    self.decode[placed.decode].call("flush_offload")
                self._start_prefill(flight)
            with self._lock:
                if local:
                    self.counters.num_local_prefills += 1
                else:
                    self.counters.num_remote_prefills += 1
        except BaseException:
            with self._lock:
                self._flights.pop(flight.request_id, None)
            raise
        return flight.stream

    def _route(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        options: RequestOptions,
        session_id: str | None,
        request_id: str | None,
    ) -> tuple[Flight, SessionKV | None]:
        """Under the lock: the new flight (its stage says the path) and the session's KV."""
        rid = request_id if request_id is not None else f"pd-{next(self._ids)}"
        if rid in self._flights:
            raise ValueError(f"request id {rid!r} is already live")
        if session_id is not None and any(
            f.session_id == session_id for f in self._flights.values()
        ):
            raise InvalidRequestError(f"session {session_id!r} has a turn in flight")
        placed = self._sessions.get(session_id) if session_id is not None else None
        if placed is not None and not self.decode[placed.decode].alive:
            del self._sessions[session_id]  # its KV died with its instance: a cold turn
            placed = None
            self.counters.num_moved_sessions += 1
        stream = RequestStream(rid, prompt_ids)
        flight = Flight(rid, stream, prompt_ids, sampling, options, session_id, "prefill")
        if placed is not None:
            flight.decode = placed.decode
            if num_new_tokens(placed.token_ids, prompt_ids) <= self.disagg.local_prefill_tokens:
                flight.stage = "decode"
        if flight.stage == "prefill":
            flight.prefill = self._choose(self.prefill, "prefill")
            if flight.decode is None:
                flight.decode = self._choose(self.decode, "decode")
        self._flights[rid] = flight
        return flight, placed

    def _choose(self, instances: list[EngineInstance], kind: str) -> int:
        """The live instance with the fewest live requests, then sessions, then lowest index."""
        held = Counter(kv.decode for kv in self._sessions.values()) if kind == "decode" else {}
        alive = [i for i, instance in enumerate(instances) if instance.alive]
        if not alive:
            raise InstanceDeadError(f"no {kind} instance is alive", kind)
        return min(alive, key=lambda i: (instances[i].get_num_live_requests(), held.get(i, 0)))

    def _encode(self, prompt: Prompt) -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)
        with self._lock:
            index = self._choose(self.prefill, "prefill")
        return self.prefill[index].call("encode", prompt)

    def abort(self, request_id: str) -> None:
        """Abort a live request wherever it is; its stream fails with RequestAbortedError."""
        with self._lock:
            flight = self._flights.get(request_id)
            if flight is None:
                return
            flight.aborted = True  # a hand-over in progress stops before D's decode
            stage, prefill, decode = flight.stage, flight.prefill, flight.decode
        instance = self.prefill[prefill] if stage == "prefill" else self.decode[decode]
        if stage in ("prefill", "decode"):
            call_quietly(instance.call, "abort", request_id)

    # ---- held KV as handles (the EngineBackend interface) -------------------------------------

    def _session_of(self, handle: str | None, request_id: str | None) -> str | None:
        """The session whose held KV ``handle`` names (None: none does)."""
        if handle is None:
            return None
        with self._lock:
            for session_id, kv in self._sessions.items():
                if kv.handle == handle:
                    return session_id
        return None

    def fork_held(self, handle: str, num_forks: int) -> list[str]:
        """Not handed over: forks start cold (``capabilities().fork_held`` is False)."""
        self._warnings.warn("fork_held", "a fork's first turn prefills its whole context on P")
        return []

    def release_held_soon(self, handle: str, drop_cached: bool = False) -> None:
        """Release a session's KV; a request still in flight under ``handle`` (a caller that
        aborted it and released its id, which may finish first) releases it when it ends."""
        with self._lock:
            found = [(s, kv) for s, kv in self._sessions.items() if kv.handle == handle]
            for session_id, _ in found:
                del self._sessions[session_id]
            flight = self._flights.get(handle)
            if flight is not None:
                flight.release_on_finish = True
        for _, kv in found:
            self._release_soon(self.decode[kv.decode], kv.handle)

    def release_held_eventually(self, handle: str) -> None:
        """On the hand-over pool: a finalizer's thread may hold the coordinator's lock."""
        self._submit(self.release_held_soon, handle)

    def pin_held_soon(self, handle: str, pinned: bool = True) -> None:
        if pinned:
            self._warnings.warn("Pin", "held KV on a D instance is not pinned")

    def capabilities(self) -> EngineCapabilities:
        """Held KV is exact (D continues from P's KV, partial block included); what does not
        cross processes is off."""
        return EngineCapabilities(
            name="agentx-pd",
            block_size=self._block_size,
            fork_held=False,
            structured_outputs=False,
            grammar_budget=False,
            pin=False,
            tool_latency=False,
            draft_from_context=False,
            export_held=False,
            branch_point=False,
        )

    def stats(self) -> EngineStats:
        """The live instances' counters summed (``kv_usage``: their mean)."""
        per = list(self.instance_stats().values())
        summed = {f.name: sum(getattr(s, f.name) for s in per) for f in fields(EngineStats)}
        summed["kv_usage"] = summed["kv_usage"] / max(1, len(per))
        return EngineStats(**summed)

    @property
    def closed(self) -> bool:
        return self._closed

    def end_session(self, session_id: str) -> None:
        """The session ended: release its KV on its D instance."""
        with self._lock:
            placed = self._sessions.pop(session_id, None)
        if placed is not None:
            call_quietly(self.decode[placed.decode].call, "release_held", placed.handle)

    # ---- the prefill side --------------------------------------------------------------------

    def _start_prefill(self, flight: Flight) -> None:
        sampling = replace(flight.sampling, max_tokens=1)
        options = replace(flight.options, hold_kv=True, held_kv=None)
        instance = self.prefill[flight.prefill]
        instance.add_request(
            flight.prompt,
            sampling,
            flight.request_id,
            options,
            lambda item: self._on_prefill(flight, item),
        )
        self._abort_if_aborted(flight, instance)

    def _on_prefill(self, flight: Flight, item: RequestOutput | BaseException) -> None:
        """P's reader thread: the first token goes to the caller, then the hand-over."""
        if isinstance(item, BaseException):
            self._fail(flight, item)
            return
        flight.output_ids.extend(item.new_token_ids)
        if not item.finished:
            flight.stream.put(item)
            return
        if item.finish_reason == "length" and flight.sampling.max_tokens > len(flight.output_ids):
            flight.first = item
            flight.stream.put(replace(item, finish_reason=None, stop_reason=None))
            self._submit(self._hand_over, flight)
        else:  # the turn ended at its first token
            self._submit(self._finish_on_prefill, flight, item)

    def _finish_on_prefill(self, flight: Flight, out: RequestOutput) -> None:
        call_quietly(self.prefill[flight.prefill].call, "release_held", flight.request_id)
        with self._lock:
            self._flights.pop(flight.request_id, None)  # a session keeps its KV on D: still valid
            self.counters.num_finished_on_prefill += 1
        flight.stream.put(out)

    def _hand_over(self, flight: Flight) -> None:
        """Hand-over thread: P's KV (partial last block included) to D, then D decodes."""
        prefill, decode = self.prefill[flight.prefill], self.decode[flight.decode]
        rid = flight.request_id
        handle = None
        try:
            try:
                self._run_hook("export", flight)
                export = prefill.call("export_held", rid, True)
                self._run_hook("import", flight)
                flight.stage = "import"
                handle = decode.call("import_held", export, None) if export is not None else None
            finally:
                call_quietly(prefill.call, "release_held", rid)  # the tier (and D) hold it now
            with self._lock:
                placed = self._sessions.get(flight.session_id) if flight.session_id else None
            if placed is not None and placed.decode == flight.decode:
                # the import found the old turn's blocks on D's device: they live on in it
                decode.call("release_held", placed.handle)
            self._start_decode(flight, flight.prompt + flight.output_ids, handle)
            with self._lock:
                self.counters.num_handovers += 1
                if handle is not None:
                    self.counters.num_handover_tail_tokens += len(export.tail_token_ids)
        except BaseException as exc:  # noqa: BLE001 - every failure reaches the stream
            if handle is not None:  # imported, never decoded (an abort, D refused it)
                call_quietly(decode.call, "release_held", handle)
            self._fail(flight, exc)

    def _run_hook(self, stage: str, flight: Flight) -> None:
        if self.handover_hook is not None:
            self.handover_hook(stage, flight.request_id)

    # ---- the decode side ---------------------------------------------------------------------

    def _start_decode(self, flight: Flight, prompt: list[int], held: str | None) -> None:
        with self._lock:
            if flight.aborted:
                raise RequestAbortedError(f"request {flight.request_id} was aborted")
            flight.stage = "decode"
        remaining = flight.sampling.max_tokens - len(flight.output_ids)
        sampling = replace(flight.sampling, max_tokens=remaining)
        options = replace(flight.options, hold_kv=flight.session_id is not None, held_kv=held)
        instance = self.decode[flight.decode]
        instance.add_request(
            prompt, sampling, flight.request_id, options, lambda item: self._on_decode(flight, item)
        )
        self._abort_if_aborted(flight, instance)

    def _abort_if_aborted(self, flight: Flight, instance: EngineInstance) -> None:
        """An abort that raced the add (its call may have reached the instance first, when
        the request was not there yet) is sent again, now that the request is."""
        with self._lock:
            aborted = flight.aborted
        if aborted:
            call_quietly(instance.call, "abort", flight.request_id)

    def _on_decode(self, flight: Flight, item: RequestOutput | BaseException) -> None:
        """D's reader thread: deltas to the caller, counted over the whole request."""
        if isinstance(item, BaseException):
            self._fail(flight, item)
            return
        out = flight.take_decoded(item)
        release = False
        if out.finished:
            with self._lock:  # before the caller sees the end: the next turn finds the KV
                self._flights.pop(flight.request_id, None)
                if flight.session_id is not None and flight.release_on_finish:
                    self._sessions.pop(flight.session_id, None)  # this request adopted it
                    release = True
                elif flight.session_id is not None:
                    kv = SessionKV(flight.decode, flight.request_id, flight.get_held_token_ids())
                    self._sessions[flight.session_id] = kv
        if release:  # released by its caller while it ran: nobody continues from it
            self._release_soon(self.decode[flight.decode], flight.request_id)
        flight.stream.put(out)

    # ---- failures ----------------------------------------------------------------------------

    def _fail(self, flight: Flight, exc: BaseException) -> None:
        with self._lock:
            if self._flights.pop(flight.request_id, None) is None:
                return
            self.counters.num_failed += 1
            placed = None
            if flight.session_id is not None and flight.stage in ("import", "decode"):
                placed = self._sessions.pop(flight.session_id, None)  # spent or gone with D
        if placed is not None:
            self._release_soon(self.decode[placed.decode], placed.handle)
        if not isinstance(exc, AgentXError):
            error = EngineDeadError(f"the P/D hand-over of {flight.request_id} failed: {exc!r}")
            error.__cause__ = exc
            exc = error
        flight.stream.fail(exc)

    def _release_soon(self, instance: EngineInstance, handle: str) -> None:
        """Release held KV from a thread that may be the instance's reader (a sink): on the
        pool. ``instance_stats`` and ``check_integrity`` wait for these first."""
        try:
            future = self._pool.submit(call_quietly, instance.call, "release_held", handle)
        except RuntimeError:  # closed: the instance is gone with its KV
            return
        with self._lock:
            self._releases.add(future)
        future.add_done_callback(self._releases.discard)

    def _wait_for_releases(self) -> None:
        with self._lock:
            releases = list(self._releases)
        futures.wait(releases)

    def _submit(self, fn: Callable, *args) -> None:
        try:
            self._pool.submit(fn, *args)
        except RuntimeError:  # closed: the pool takes no more work
            pass

    # ---- state -------------------------------------------------------------------------------

    def get_num_live_requests(self) -> int:
        with self._lock:
            return len(self._flights)

    def instance_stats(self) -> dict[str, EngineStats]:
        """Every live instance's EngineStats, by name ("prefill-0", "decode-0", ...)."""
        self._wait_for_releases()
        return {i.name: i.call("stats") for i in self.instances if i.alive}

    def check_integrity(self) -> None:
        """A session's KV is held once, on a D instance; a session has one turn in flight at
        most; every live instance passes its own check; with nothing in flight every D
        instance holds exactly its sessions' KV and every P instance holds none."""
        self._wait_for_releases()
        with self._lock:
            handles = [kv.handle for kv in self._sessions.values()]
            assert len(set(handles)) == len(handles), f"a held KV serves two sessions: {handles}"
            assert all(0 <= kv.decode < len(self.decode) for kv in self._sessions.values())
            busy = [f.session_id for f in self._flights.values() if f.session_id is not None]
            assert len(set(busy)) == len(busy), f"a session has two turns in flight: {busy}"
            idle = not self._flights
            held = Counter(kv.decode for kv in self._sessions.values())
        for instance in self.instances:
            if instance.alive:
                instance.call("check_integrity")
        if not idle:
            return
        for instance in self.prefill:
            if instance.alive:
                assert instance.call("stats").kv_num_held == 0, f"{instance.name} holds KV"
        for i, instance in enumerate(self.decode):
            if instance.alive:
                num = instance.call("stats").kv_num_held
                assert num == held[i], f"{instance.name} holds {num} KV, sessions {held[i]}"

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("the P/D coordinator is closed")

    # ---- lifecycle ---------------------------------------------------------------------------

    def close(self) -> None:
        """Close every instance (their processes are reaped), fail what is still in flight
        with EngineClosedError, stop a master this coordinator started. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for instance in self.instances:
            instance.close()
        self._pool.shutdown(wait=True)
        with self._lock:
            flights, self._flights = list(self._flights.values()), {}
        for flight in flights:
            flight.stream.fail(EngineClosedError("the P/D coordinator was closed"))
        if self.master is not None:
            self.master.stop()
