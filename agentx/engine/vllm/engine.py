"""VLLMEngine: the Session's engine interface on vLLM's engine, in the caller's process.

    engine = VLLMEngine(VLLMConfig(engine_args={"tensor_parallel_size": 2}))
    async with Session(engine=engine) as s: ...

vLLM 0.32 runs its engine core in the caller's process only as the synchronous ``LLMEngine``
with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (``AsyncLLM`` always starts a child process); this
backend owns a loop thread that adds requests, applies aborts and calls ``step()``, exactly as
agentx's own :class:`~agentx.engine.client.Engine` drives its core, and hands deltas to the same
:class:`RequestStream` records. Prompts go in as token ids (``TokensPrompt``; the chat template
and tokenizer are agentx's), text comes from agentx's detokenizer, cached tokens from vLLM's
``num_cached_tokens``.

Held KV: vLLM has no per-request hold, so a handle here is bookkeeping over vLLM's automatic
prefix cache: the next turn (or a fork's first turn) hits every whole block of the previous
turn that is still cached, which is all of them unless memory ran short. Hints map to what vLLM
offers (priority -> priority scheduling, session affinity -> ``data_parallel_rank`` when DP > 1);
pin, release-drop and tool latency are not honoured: ``capabilities()`` says so and the first
request asking for one logs a warning. Process-wide state vLLM changes: process_state.py.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import replace

from agentx.engine.backend import EngineCapabilities, Prompt, UnsupportedWarnings
from agentx.engine.hints import Pin, Release, ToolLatency
from agentx.engine.loop_backend import LoopBackend
from agentx.engine.models.detokenizer import IncrementalDetokenizer
from agentx.engine.outputs import EngineStats, RequestOutput
from agentx.engine.request import RequestOptions
from agentx.engine.sampling import SamplingParams
from agentx.engine.streams import RequestStream
from agentx.engine.text_state import TextState
from agentx.engine.vllm.config import VLLMConfig
from agentx.engine.vllm.convert import to_vllm_sampling
from agentx.engine.vllm.held import HeldHandles
from agentx.engine.vllm.live import LiveRequest
from agentx.engine.vllm.startup import (
    check_installed,
    load_model,
    shutdown_llm_engine,
    start_llm_engine,
)
from agentx.errors import InvalidRequestError, PromptTooLongError, RequestAbortedError

__all__ = ["VLLMEngine"]

logger = logging.getLogger(__name__)


class VLLMEngine(LoopBackend[tuple[str, LiveRequest]]):
    """The vLLM backend. ``engine_args`` keywords are merged into ``config.engine_args``."""

    _loop_name = "vLLM"

    def __init__(self, config: VLLMConfig | None = None, **engine_args) -> None:
        super().__init__()
        config = config or VLLMConfig()
        if engine_args:
            config = replace(config, engine_args={**config.engine_args, **engine_args})
        self.config = config
        check_installed()
        import torch

        self._num_threads = config.num_threads or torch.get_num_threads()
        self.tokenizer, model_dir = load_model(config)
        self._warnings = UnsupportedWarnings("vllm")
        self._live: dict[str, LiveRequest] = {}  # loop thread only (under the step lock)
        self._held = HeldHandles()
        self._counts = dict.fromkeys(("queries", "query_tokens", "hit_tokens", "generated"), 0)
        self._num_steps = 0
        # vLLM is built on the thread that steps it: stepped from another thread than the one
        # that built (and compiled) it, its CPU decode measured ~40% slower here
        started: list[BaseException | None] = []
        ready = threading.Event()
        self._thread = threading.Thread(
            target=self._run_loop,
            args=(config, model_dir, started, ready),
            name="agentx-vllm",
            daemon=True,
        )
        self._thread.start()
        ready.wait()
        if started[0] is not None:
            self._thread.join()
            raise started[0]
        self.max_model_len = self._llm.model_config.max_model_len
        self._vocab_size = self._llm.model_config.get_vocab_size()

    # ---- requests ----------------------------------------------------------------------------

    def _admit(
        self, rid: str, prompt: Prompt, sampling: SamplingParams, options: RequestOptions
    ) -> tuple[RequestStream, tuple[str, LiveRequest]]:
        token_ids = self._tokenize(prompt)
        if len(token_ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {len(token_ids)} tokens; the model context is {self.max_model_len}"
                " (the prompt must leave room for at least one output token)"
            )
        self._warn_unsupported(options)
        text = TextState(
            IncrementalDetokenizer(self.tokenizer, token_ids[-8:]),
            sampling.stop,
            sampling.include_stop_str_in_output,
        )
        affinity = self._held.lineage_of(options.held_kv, rid)
        stream = RequestStream.for_sampling(rid, token_ids, sampling)
        return stream, (rid, LiveRequest(stream, token_ids, sampling, options, text, affinity))

    def _tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            token_ids = list(prompt)
            bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < self._vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"token ids outside the vocabulary [0, {self._vocab_size}): {bad[:5]}"
                )
        if not token_ids:
            raise InvalidRequestError("empty prompt: give at least one token")
        return token_ids

    def _warn_unsupported(self, options: RequestOptions) -> None:
        for hint in options.hints:
            if isinstance(hint, Pin) and hint.pinned:
                self._warnings.warn("Pin", "vLLM's prefix cache evicts by LRU only")
            elif isinstance(hint, Release) and hint.drop_cached:
                self._warnings.warn("Release(drop_cached)", "vLLM can only reset its whole cache")
            elif isinstance(hint, ToolLatency):
                self._warnings.warn(
                    "ToolLatency",
                    "no demote/prefetch by deadline (vLLM offloads by LRU; its "
                    "KV offloading connectors are CUDA-only in 0.32)",
                )

    def wait_ready(self, timeout: float | None = None) -> bool:
        """vLLM warms up inside its start-up: always ready once constructed."""
        return True

    # ---- held KV: bookkeeping over vLLM's prefix cache ---------------------------------------

    def fork_held(self, handle: str, num_forks: int) -> list[str]:
        self._check_alive()
        new = [f"{handle}/fork-{next(self._ids)}" for _ in range(num_forks)]
        return new if self._held.fork(handle, new) else []

    def release_held_soon(self, handle: str, drop_cached: bool = False) -> None:
        if drop_cached:
            self._warnings.warn("Release(drop_cached)", "vLLM can only reset its whole cache")
        self.release_held_eventually(handle)

    def release_held_eventually(self, handle: str) -> None:
        self._held.release_eventually(handle)

    def pin_held_soon(self, handle: str, pinned: bool = True) -> None:
        if pinned:
            self._warnings.warn("Pin", "vLLM's prefix cache evicts by LRU only")

    # ---- state -------------------------------------------------------------------------------

    def capabilities(self) -> EngineCapabilities:
        return EngineCapabilities(
            name="vllm",
            block_size=self.config.block_size,
            exact_held_kv=False,
            grammar_budget=False,
            pin=False,
            release_drop_cached=False,
            tool_latency=False,
            draft_from_context=False,
            export_held=False,
            session_affinity=self.config.data_parallel_size > 1,
            branch_point=False,
            turns_left=False,
        )

    @property
    def unsupported_warned(self) -> frozenset[str]:
        """The features a request asked for that were warned about (once each)."""
        return self._warnings.warned

    def stats(self) -> EngineStats:
        with self._cond:
            num_live, num_held = len(self._streams), len(self._held)
        with self._step_lock:
            running = sum(1 for live in self._live.values() if live.num_output > 0)
            c = dict(self._counts)
            num_steps = self._num_steps
        return EngineStats(
            num_steps=num_steps,
            num_running=running,
            num_waiting=num_live - running,
            num_preemptions=0,
            prefix_cache_queries=c["queries"],
            prefix_cache_query_tokens=c["query_tokens"],
            num_cached_tokens=c["hit_tokens"],
            num_computed_tokens=c["query_tokens"] - c["hit_tokens"] + c["generated"],
            num_generated_tokens=c["generated"],
            kv_num_blocks=0,
            kv_num_used_blocks=0,
            kv_num_cached_blocks=0,
            kv_usage=0.0,
            kv_num_held=num_held,
        )

    def check_integrity(self) -> None:
        with self._cond, self._step_lock:
            live = set(self._live) | {rid for rid, _ in self._new}
            assert set(self._streams) == live, f"streams drifted: {set(self._streams) ^ live}"
            self._held.check_integrity(live)
            if not live:
                assert not self._llm.has_unfinished_requests(), "vLLM still runs requests"

    # ---- the loop thread ---------------------------------------------------------------------

    def _run_loop(
        self,
        config: VLLMConfig,
        model_dir: str,
        started: list[BaseException | None],
        ready: threading.Event,
    ) -> None:
        import torch

        torch.set_num_threads(self._num_threads)  # OpenMP thread counts are per thread
        try:
            self._llm, self.process_changes, self.process_restored = start_llm_engine(
                config, model_dir
            )
        except BaseException as exc:  # noqa: BLE001 - the constructor raises it
            started.append(exc)
            ready.set()
            return
        torch.set_num_threads(self._num_threads)  # vLLM's start sets 1 "for serving"
        started.append(None)
        ready.set()
        self._run_steps()

    def _after_steps(self) -> None:
        with self._step_lock:
            if self._live:
                self._llm.abort_request(list(self._live))
            self._live.clear()
        shutdown_llm_engine(self._llm)

    def _has_work(self) -> bool:
        return bool(self._live)

    def _step(self, new: list[tuple[str, LiveRequest]], aborts: list[str]) -> None:
        for _, live in new:  # a held turn is adopted by the request that continues it
            self._held.adopt(live.options.held_kv)
        with self._step_lock:
            for rid, live in new:
                self._start(rid, live)
            aborted = [rid for rid in aborts if self._live.pop(rid, None) is not None]
            if aborted:
                self._llm.abort_request(aborted)
            outputs = self._llm.step() if self._live else []
            self._num_steps += 1
            done = [self._take(out) for out in outputs]
        for rid in aborted:
            self._finish(rid, None, RequestAbortedError(f"request {rid} was aborted"))
        for item in done:
            if item is not None:
                self._finish(*item)

    def _start(self, rid: str, live: LiveRequest) -> None:
        from vllm import TokensPrompt

        prompt = TokensPrompt(prompt_token_ids=live.prompt)
        if live.options.cache_salt:
            prompt["cache_salt"] = live.options.cache_salt
        try:
            self._llm.add_request(
                rid,
                prompt,
                to_vllm_sampling(live.sampling),
                priority=live.options.priority,
                session_id=live.affinity,
            )
        except Exception as exc:  # noqa: BLE001 - vLLM's validation fails this request only
            error = InvalidRequestError(f"vLLM rejected the request: {exc}")
            self._finish(rid, None, error)
            return
        self._live[rid] = live
        self._counts["queries"] += 1
        self._counts["query_tokens"] += len(live.prompt)

    def _take(self, out) -> tuple[str, RequestOutput, None, LiveRequest] | None:
        """One vLLM delta as agentx's; returns what to dispatch (under the step lock)."""
        live = self._live.get(out.request_id)
        if live is None:
            return None
        first = live.num_output == 0
        delta, stop_string = live.take(out)
        self._counts["hit_tokens"] += delta.num_cached_tokens if first else 0
        self._counts["generated"] += len(delta.new_token_ids)
        if stop_string:
            self._llm.abort_request([out.request_id])  # a stop string ended it: vLLM stops too
        if delta.finished:
            del self._live[out.request_id]
        return out.request_id, delta, None, live

    def _finish(
        self,
        rid: str,
        delta: RequestOutput | None,
        error: BaseException | None,
        live: LiveRequest | None = None,
    ) -> None:
        """Hand a delta (or an error) to the request's stream; a finished one leaves, and a
        completed one asked to hold its KV is held under its id."""
        with self._cond:
            stream = self._streams.get(rid)
            if stream is None:
                return
            if error is not None or delta.finished:
                del self._streams[rid]
            completed = delta is not None and delta.finish_reason in ("stop", "length")
            if completed and live is not None and live.options.hold_kv and not self._closed:
                self._held.hold(rid, live.affinity)
        if error is not None:
            stream.fail(error)
        else:
            stream.put(delta)
