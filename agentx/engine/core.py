"""EngineCore: one step = schedule -> execute -> update -> outputs.

Synchronous: the engine client drives ``step()`` and every state change from its loop thread,
under its step lock. Three things run on other threads: ``make_request`` on the caller's (it
tokenizes, checks sizes fixed at start, draws a seed and compiles a grammar under the grammar
lock; it touches no scheduler or KV state), grammar bitmasks on a worker thread while the model
runs, and offload transfers on the offload transfer worker. The core validates requests before
they reach the scheduler, detokenizes outputs incrementally and applies stop strings (which
need text, so the scheduler cannot).
"""

from __future__ import annotations

import copy
import random
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import torch

from agentx.config import EngineConfig
from agentx.engine.block_hash import salt_key
from agentx.engine.draft import Drafter, DraftSource
from agentx.engine.executors.executor import Executor, make_executor
from agentx.engine.kv_cache import KVCacheManager
from agentx.engine.kv_cache.policy import KVPolicy
from agentx.engine.kv_cache.retention import make_retention
from agentx.engine.models.detokenizer import IncrementalDetokenizer
from agentx.engine.models.loader import load_checkpoint
from agentx.engine.models.tokenizer import Tokenizer
from agentx.engine.offload.build import store_from_config
from agentx.engine.offload.fingerprint import checkpoint_digest, page_fingerprint
from agentx.engine.offload.interface import KVExport, NullOffload, Offload
from agentx.engine.offload.manager import OffloadManager
from agentx.engine.outputs import EngineStats, GrammarMasks, RequestOutput, SchedulerOutput
from agentx.engine.parallel.bootstrap import refuse_spawn_while_bootstrapping
from agentx.engine.request import Request, RequestOptions, RequestStatus
from agentx.engine.runner.model_runner import DTYPES
from agentx.engine.sampling import SamplingParams
from agentx.engine.scheduler import Scheduler, StepClock, make_output
from agentx.engine.structured import GrammarBackend
from agentx.engine.text_state import TextState as _TextState
from agentx.errors import ConfigError, InvalidRequestError


class EngineCore:
    def __init__(self, config: EngineConfig, step_clock: StepClock | None = None) -> None:
        """``step_clock``: a step index shared with other data-parallel replicas (their
        prefill windows align: scheduler/step_clock.py); None: this engine's own."""
        self.config = config
        if config.parallel.dp > 1:
            raise ConfigError("parallel.dp > 1 needs a ReplicaRouter (engine/router.py)")
        if config.parallel.world_size > 1:  # before the checkpoint loads in a doomed child
            refuse_spawn_while_bootstrapping()
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        checkpoint = load_checkpoint(
            config.model_path, DTYPES[config.dtype], keep_quantized=config.quantization != "none"
        )
        self.tokenizer: Tokenizer = copy.copy(checkpoint.tokenizer)
        self.tokenizer.tool_call_format = config.tool_call_format
        self.spec = checkpoint.spec
        self.runner: Executor = make_executor(config, checkpoint)
        checkpoint_path = checkpoint.path
        del checkpoint
        try:
            self._build_cache(config, checkpoint_path, step_clock)
        except BaseException:  # worker processes do not outlive a failed start
            self.runner.close()
            raise
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids) | frozenset(
            self.spec.eos_token_ids
        )
        self._texts: dict[str, _TextState] = {}
        self._rng = random.Random(config.seed)
        self._grammar: GrammarBackend | None = None  # built by prepare() or on first use
        self._grammar_lock = threading.Lock()
        self._mask_worker: ThreadPoolExecutor | None = None
        spec = config.speculative
        # a linear state cannot roll back rejected drafts: such layouts never draft
        self._speculate = spec.enabled and not self.kv.coordinator.has_linear
        self.draft_source = DraftSource(spec.num_engine_outputs)  # recent outputs, engine-wide
        self.is_idle = False  # the last step had nothing to schedule
        self.wait_when_idle = True

    def _build_cache(
        self, config: EngineConfig, checkpoint_path: Path, step_clock: StepClock | None = None
    ) -> None:
        """The KV manager, the scheduler and the offload tiers, over the runner's layout."""
        self.max_model_len = self.runner.max_model_len
        cache = config.cache
        self.kv = KVCacheManager(
            self.runner.layout,
            cache.enable_prefix_caching,
            make_retention(cache.retention_policy, cache.prefix_cache_retention_interval),
            _make_policy(cache.kv_policy),
            cache.kv_policy_errors,
            partial_hits=cache.partial_block_hits,
        )
        self.scheduler = Scheduler(
            config.scheduler, self.kv, self.max_model_len, step_clock=step_clock
        )
        self.offload: Offload = NullOffload()
        if config.offload.enabled:
            fingerprint = page_fingerprint(
                checkpoint_digest(checkpoint_path),
                config.dtype,
                config.quantization,
                self.runner.layout,
                self.spec.architecture,
            )
            store, master = store_from_config(config.offload, self.runner.page_bytes, fingerprint)
            try:
                if store is not None:
                    self.offload = OffloadManager(
                        store, self.kv, self.runner, config.offload, master
                    )
            except BaseException:  # nothing started for this engine outlives its failure
                if store is not None:
                    store.close()
                if master is not None:
                    master.stop()
                raise

    # ---- requests ----------------------------------------------------------------------------

    def make_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        sampling: SamplingParams,
        *,
        options: RequestOptions | None = None,
    ) -> Request:
        """Validate and build a request; raises InvalidRequestError before anything is queued."""
        options = options or RequestOptions()
        token_ids = self.tokenize(prompt)
        self.scheduler.check_fits(len(token_ids), sampling.max_tokens)
        seed = sampling.seed if sampling.seed is not None else self._rng.getrandbits(62)
        grammar = None
        if sampling.structured is not None:  # compiled here, on the caller's thread
            num_output = min(sampling.max_tokens, self.max_model_len - len(token_ids))
            grammar = self._grammar_backend().new_matcher(sampling.structured, num_output)
        return Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling=sampling,
            eos_token_ids=self.eos_token_ids,
            block_size=self.kv.block_size,
            priority=options.priority,
            cache_salt=salt_key(options.cache_salt),
            seed=seed,
            hold_kv=options.hold_kv,
            held_kv=options.held_kv,
            hints=options.hints,
            grammar=grammar,
            **self._drafting(options),
        )

    def _drafting(self, options: RequestOptions) -> dict:
        """A request's drafter and the sources its output goes to. A constrained request
        drafts only what its grammar accepts (the scheduler asks it), and each drafted
        position is sampled under the grammar's mask there."""
        if not self._speculate:
            return {}
        sources = tuple(
            s for s in (options.draft_source, self.draft_source) if s is not None and s.max_entries
        )
        spec = self.config.speculative
        drafter = Drafter(spec.num_speculative_tokens, sources, spec.num_first_draft_tokens)
        return {"drafter": drafter, "draft_sinks": sources}

    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        """The prompt's token ids as a request would hold them; InvalidRequestError for ids
        outside the vocabulary or an empty prompt."""
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            if isinstance(prompt, bytes | bytearray | memoryview):  # iterates as ints
                raise InvalidRequestError("a prompt is a str or a sequence of token ids, not bytes")
            token_ids = list(prompt)
            vocab = self.spec.vocab_size
            bad = [
                t
                for t in token_ids
                if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab
            ]
            if bad:
                raise InvalidRequestError(
                    f"token ids outside the vocabulary [0, {vocab}): {bad[:5]}"
                )
        if not token_ids:
            raise InvalidRequestError("empty prompt: give at least one token")
        return token_ids

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)
        self._texts[request.request_id] = _TextState(
            IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids[-8:]),
            request.sampling.stop,
            request.sampling.include_stop_str_in_output,
        )
        if self.offload.on_request(request):
            self.scheduler.park(request)  # its prefix loads from a tier; others run meanwhile

    def abort_requests(self, request_ids: Sequence[str]) -> list[RequestOutput]:
        ended = self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        outputs = []
        for request in ended:
            text = self._texts.pop(request.request_id)
            outputs.append(replace(make_output(request, []), new_text=text.flush()))
        return outputs

    # ---- structured output (structured.py) -----------------------------------------------

    def _grammar_backend(self) -> GrammarBackend:
        with self._grammar_lock:
            if self._grammar is None:
                self._grammar = GrammarBackend(
                    self.tokenizer.backend.to_str(), self.spec.vocab_size, self.eos_token_ids
                )
            return self._grammar

    def _grammar_masks(self, sched_out: SchedulerOutput) -> GrammarMasks | None:
        """Start the token bitmasks of constrained requests that sample this step (one row,
        and one more per draft); they are computed on a worker thread while the model runs."""
        requests = self.scheduler.requests
        constrained = [
            (requests[item.request_id], item.draft_token_ids)
            for item in sched_out.scheduled
            if item.sample and requests[item.request_id].grammar is not None
        ]
        if not constrained:
            return None
        backend = self._grammar_backend()
        if self._mask_worker is None:
            self._mask_worker = ThreadPoolExecutor(1, thread_name_prefix="agentx-grammar")

        def fill() -> torch.Tensor:
            bitmask = backend.allocate_bitmask(sum(1 + len(d) for _, d in constrained))
            row = 0
            for request, drafts in constrained:
                request.grammar.fill_draft_bitmasks(bitmask, row, drafts)
                row += 1 + len(drafts)
            return bitmask

        request_ids = [r.request_id for r, drafts in constrained for _ in range(1 + len(drafts))]
        return GrammarMasks(request_ids, self._mask_worker.submit(fill))

    # ---- held KV (kv_cache/held.py) -------------------------------------------------------

    def fork_held(self, handle: str, new_handles: list[str]) -> bool:
        """Fork held KV into ``new_handles``; False if it is gone or there is no room."""
        copies = self.kv.fork_held(handle, new_handles)
        if copies is None:
            return False
        self.runner.copy_blocks(copies)
        return True

    def release_held(self, handle: str, drop_cached: bool = False) -> bool:
        self.offload.on_release(handle, drop_cached)  # while its blocks are still there
        return self.kv.release_held(handle, drop_cached)

    def pin_held(self, handle: str, pinned: bool = True) -> bool:
        self.offload.pin(handle, pinned)  # a soft pin in every tier
        return self.kv.pin_held(handle, pinned)

    def export_held(self, handle: str, include_tail: bool = False) -> KVExport | None:
        """Held KV's prefix as another engine sharing a tier can import it (``include_tail``:
        all of it, each group's last page too)."""
        return self.offload.export(handle, include_tail)

    def import_held(self, export: KVExport, handle: str) -> int:
        """Load an exported prefix from the shared tiers as held KV ``handle``."""
        num = self.offload.import_(export, handle)
        self._requeue(self.offload.take_ready())
        return num

    def flush_offload(self, timeout: float = 30.0) -> None:
        """Wait until every queued tier transfer has landed (a session about to move to
        another replica finds its blocks in the shared tier)."""
        self.offload.flush(timeout)
        self._requeue(self.offload.take_ready())

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self.offload.has_pending()

    def _requeue(self, ready: list[tuple[str, str]]) -> None:
        """Put requests whose prefix finished loading back in line, extending the loaded KV."""
        for request_id, handle in ready:
            request = self.scheduler.unpark(request_id)
            if request is None:
                self.kv.release_held(handle)  # aborted while it loaded
            elif handle in self.kv.held:
                # the held KV it named did not continue its prompt (that is why it loaded): it
                # is spent, as admission would have spent it, before the loaded one replaces it
                stale = self.kv.get_held(request.held_kv)
                if stale is not None and stale.cache_salt == request.cache_salt:
                    self.kv.release_held(request.held_kv)
                request.held_kv = handle

    # ---- start-up ----------------------------------------------------------------------------

    def prepare(self) -> None:
        """Build what requests would otherwise build on first use: the grammar tokenizer tables
        (~0.5 s for a 49K vocabulary) and the compiled chat template. Thread-safe, so the client
        runs it beside the first steps; a failure surfaces again at the request that needs it."""
        self._grammar_backend()
        self.tokenizer.get_compiled_chat_template()

    def warm_up(self) -> None:
        """One small forward outside the scheduler (``runner/warmup.py``); loop thread only,
        before the first step."""
        self.runner.warm_up()

    def close(self) -> None:
        """Loop thread only, after its last step: the tiers close and the model and KV pool
        go, so a closed engine that something still references holds no large memory."""
        self.offload.close()
        if self._mask_worker is not None:
            self._mask_worker.shutdown(wait=True)
        self.runner.close()

    # ---- one step ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One step. With nothing to schedule it waits a little for a transfer, unless
        ``wait_when_idle`` is off: the client then waits itself, outside its step lock
        (``is_idle`` says the step was idle)."""
        self._requeue(self.offload.poll() + self.offload.take_ready())
        sched_out = self.scheduler.schedule()
        self.runner.copy_blocks(sched_out.block_copies)  # partial hits' shared tokens
        self.is_idle = sched_out.is_empty
        if sched_out.is_empty:
            self.runner.forget(sched_out.finished_request_ids)
            if self.wait_when_idle:
                self.offload.idle_wait()
            return []
        masks = self._grammar_masks(sched_out)
        runner_out = self.runner.execute(sched_out, masks)
        deltas = self.scheduler.update_from_output(sched_out, runner_out)
        self.offload.after_step()  # this step's KV is written: store what it published
        return [self._with_text(d) for d in deltas]

    def _with_text(self, delta: RequestOutput) -> RequestOutput:
        state = self._texts[delta.request_id]
        if state.stop and len(delta.new_token_ids) > 1:
            delta, new_text = self._push_until_stop(state, delta)
        else:
            new_text = state.push(self._text_token_ids(delta, state))
        if state.matched is not None and delta.stop_reason != state.matched:
            if not delta.finished:
                self.scheduler.finish_requests([delta.request_id], RequestStatus.FINISHED_STOPPED)
            delta = replace(delta, finish_reason="stop", stop_reason=state.matched)
        if delta.finished:
            new_text += state.flush()
            del self._texts[delta.request_id]
        return replace(delta, new_text=new_text)

    def _text_token_ids(self, delta: RequestOutput, state: _TextState) -> list[int]:
        token_ids = delta.new_token_ids
        if _ends_on_stop_token(delta, self.eos_token_ids) and not state.include_stop:
            token_ids = token_ids[:-1]  # an EOS or stop token ends the text, it is not text
        return token_ids

    def _push_until_stop(
        self, state: _TextState, delta: RequestOutput
    ) -> tuple[RequestOutput, str]:
        """A step that kept drafts added several tokens: push them one at a time, so a stop
        string ends the output at the token it would have ended it at without drafting."""
        token_ids = self._text_token_ids(delta, state)
        new_text = ""
        for i, token_id in enumerate(token_ids):
            new_text += state.push([token_id])
            if state.matched is None or i + 1 == len(delta.new_token_ids):
                continue
            num_cut = len(delta.new_token_ids) - (i + 1)
            request = self.scheduler.requests.get(delta.request_id)
            if request is not None and not request.is_finished:
                request.truncate(request.num_tokens - num_cut)
            ids = delta.new_token_ids[: i + 1]
            delta = replace(
                delta,
                new_token_ids=ids,
                logprobs=delta.logprobs[: i + 1],
                num_output_tokens=delta.num_output_tokens - num_cut,
                finish_reason=None,
                stop_reason=None,
            )
            break
        return delta, new_text

    # ---- introspection -----------------------------------------------------------------------

    def get_stats(self) -> EngineStats:
        s, kv = self.scheduler, self.kv
        return EngineStats(
            num_steps=s.num_steps,
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            num_preemptions=s.num_preemptions,
            prefix_cache_queries=kv.stats.num_queries,
            prefix_cache_query_tokens=kv.stats.num_query_tokens,
            num_cached_tokens=kv.stats.num_hit_tokens,
            num_copied_tokens=kv.stats.num_copied_tokens,
            num_computed_tokens=s.num_computed_tokens,
            num_generated_tokens=s.num_generated_tokens,
            kv_num_blocks=kv.pool.num_blocks - 1,
            kv_num_used_blocks=kv.get_num_used_blocks(),
            kv_num_cached_blocks=len(kv.pool.cached),
            kv_usage=kv.get_usage(),
            kv_num_held=len(kv.held),
            kv_policy_errors=kv.policy.num_errors,
            kv_dropped_checkpoints=kv.stats.num_dropped_checkpoints,
            **self.offload.get_stats(),
            num_draft_tokens=s.num_draft_tokens,
            num_accepted_tokens=s.num_accepted_tokens,
        )

    def check_integrity(self) -> None:
        self.scheduler.check_integrity(self.offload.get_referenced_blocks())
        self.offload.check_integrity()
        assert set(self._texts) == set(self.scheduler.requests), "text state drifted"
        rows = self.runner.get_request_ids()
        known = self.scheduler.get_runner_request_ids()
        assert rows <= known, f"the runner keeps rows of finished requests: {rows - known}"


def _ends_on_stop_token(delta: RequestOutput, eos_token_ids: frozenset[int]) -> bool:
    """The delta's last token is the EOS or stop token that ended the request (a budget that
    closed a grammar in an accepting state ends it with EOS too)."""
    if isinstance(delta.stop_reason, int):
        return True
    ids = delta.new_token_ids
    return delta.stop_reason == "grammar_budget" and bool(ids) and ids[-1] in eos_token_ids


def _make_policy(policy: object) -> KVPolicy | None:
    """The configured KV policy: an instance as is, a callable (a class) called once here."""
    if policy is None or isinstance(policy, KVPolicy):
        return policy
    made = policy()
    if not isinstance(made, KVPolicy):
        raise ConfigError(f"cache.kv_policy made {made!r}, not a KVPolicy")
    return made
