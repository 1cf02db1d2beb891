"""The model runner: owns the model weights and the KV cache tensors, runs one step.

It turns a :class:`SchedulerOutput` into one flat varlen batch, runs the model under a forward
context, computes logits only for the positions that sample, and samples. It knows nothing of
queues, prefix hashes or requests beyond their ids.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import replace

import torch

from agentx import kernels
from agentx.config import EngineConfig
from agentx.engine.kv_cache import BlockCopy, FullAttentionSpec, KVCacheLayout, LinearStateSpec
from agentx.engine.models.blocks import DecoderLayer
from agentx.engine.models.forward_context import ForwardContext, forward_context
from agentx.engine.models.layers import QuantizableLinear
from agentx.engine.models.moe import SparseMoeBlock
from agentx.engine.models.registry import get_model_class
from agentx.engine.models.spec import ModelSpec
from agentx.engine.outputs import (
    GrammarMasks,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)
from agentx.engine.parallel import SINGLE, ParallelState, PrefillSplit
from agentx.engine.runner.cuda_graph import DecodeGraphs
from agentx.engine.runner.input_batch import BatchInputs, InputBatch
from agentx.engine.runner.kv_layout import allocate_kv_caches, get_layer_specs, plan_kv_layout
from agentx.engine.runner.logprobs import log_softmax, prompt_logprobs, sampled_logprobs
from agentx.engine.runner.sampler import sample
from agentx.engine.runner.warmup import warm_up
from agentx.engine.structured import apply_bitmask
from agentx.errors import ConfigError

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        spec: ModelSpec,
        weights: dict[str, torch.Tensor],
        parallel: ParallelState = SINGLE,
    ) -> None:
        self.config = config
        self.spec = spec
        self.device = torch.device(config.device)
        self.dtype = DTYPES[config.dtype]
        self.max_model_len = resolve_max_model_len(config, spec)
        self.parallel = parallel
        self.num_rows_run = 0  # token rows this rank ran through the model (eagerly), ever
        with torch.device(self.device):
            model = get_model_class(spec.architecture)(spec, parallel, self.dtype)
        model.load_weights(weights)
        fused = finalize_weights(model, config.quantization, self.device)
        self.model = model.eval()
        self.kv_dtype = resolve_kv_dtype(config, self.dtype, fused)
        # the memory this rank holds; ``layout`` is the pool the scheduler plans (the same
        # but for decode context parallel, whose scheduler blocks span every rank's block)
        self.local_layout = plan_rank_layout(config, spec, self.model, self.kv_dtype, parallel)
        self.layout = scheduler_layout(self.local_layout, parallel)
        self.kv_slots, self.kv_caches = allocate_kv_caches(
            self.local_layout, self.device, config.cache.huge_pages
        )
        self.layer_groups = tuple(
            next(g for g, group in enumerate(self.layout.groups) if i in group.layer_ids)
            for i in range(spec.num_layers)
        )
        block_size = self.layout.block_size
        self.input_batch = InputBatch(
            config.scheduler.max_num_seqs,
            -(-self.max_model_len // block_size),
            block_size,
            tuple(isinstance(g.spec, LinearStateSpec) for g in self.layout.groups),
        )
        self.decode_graphs: DecodeGraphs | None = None
        # threads per step on CPU (EngineConfig.small_step_tokens): one for a small step, else
        # the count of the thread that built the runner (the loop thread inherits it)
        self.num_threads = torch.get_num_threads()
        self.step_threads: int | None = None  # what the last step ran on

    @torch.inference_mode()
    def capture_decode_graphs(self) -> bool:
        """Capture the decode CUDA graphs (after the warm-up compiled every kernel); False
        where they do not apply: not CUDA, not Triton, no sizes, or linear-state layers."""
        sizes = tuple(
            n for n in self.config.cuda_graph_batch_sizes if n <= self.config.scheduler.max_num_seqs
        )
        linear = any(isinstance(g.spec, LinearStateSpec) for g in self.layout.groups)
        if self.device.type != "cuda" or not kernels.triton_enabled() or not sizes or linear:
            return False
        graphs = DecodeGraphs(
            self.model,
            self.kv_caches,
            self.layer_groups,
            len(self.layout.groups),
            self.input_batch.block_table.shape[-1],
            self.max_model_len,
            sizes,
            self.device,
        )
        try:
            graphs.capture()
        except RuntimeError:  # a step that cannot be captured still runs, eagerly
            logger.exception("CUDA graph capture failed; decode steps run eagerly")
            return False
        self.decode_graphs = graphs
        return True

    def _graph_fits(self, out: SchedulerOutput) -> bool:
        graphs = self.decode_graphs
        return (
            graphs is not None
            and graphs.bucket(len(out.scheduled)) is not None
            and all(len(it.token_ids) == 1 and it.sample for it in out.scheduled)
        )

    def _set_step_threads(self, num_tokens: int) -> None:
        if self.device.type != "cpu":
            return
        small = num_tokens <= self.config.small_step_tokens
        threads = 1 if small else self.num_threads
        if threads != self.step_threads:  # per thread (OpenMP): the calling loop thread's
            torch.set_num_threads(threads)
            self.step_threads = threads

    def _run_model(self, out: SchedulerOutput, batch: BatchInputs) -> torch.Tensor | None:
        """Logits of the rows that sample (None when none does): a graph replay for a decode
        step it fits, else the model run eagerly."""
        if self._graph_fits(out):
            seq_lens = next(m for m in batch.attn if m is not None).seq_lens
            return self.decode_graphs.replay(batch, seq_lens)
        if self.device.type == "cuda" and kernels.triton_enabled():
            batch = _on_device(batch, self.device)
        split = self._prefill_split(batch)
        ctx = ForwardContext(
            attn=batch.attn,
            layer_groups=self.layer_groups,
            kv_caches=self.kv_caches,
            linear=batch.linear,
            pcp=split,
        )
        input_ids, positions = batch.input_ids, batch.positions
        if split is not None:  # this rank's rows of a long prefill
            own = split.own.to(input_ids.device)
            input_ids, positions = input_ids[own], positions[own]
        self.num_rows_run += len(input_ids)
        # the rows the LM head reads: the last layer computes those alone (none in a prefill
        # chunk that samples nothing); a rank's share of a split prefill keeps every row
        rows = batch.logits_indices
        keep, where = (None, rows) if split is not None else _kept_rows(rows, len(input_ids))
        with forward_context(ctx):
            hidden = self.model(input_ids.to(self.device), positions.to(self.device), keep)
        if not len(rows):
            return None
        if split is not None:  # the same on every rank: the collective lines up
            hidden = split.gather(hidden)  # (T, hidden): every rank samples every row
        return self._logits(hidden[where.to(self.device)])

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head on every thread, also in a one-thread step: one GEMV over the whole
        vocabulary (28M weights for SmolLM2) is long enough to pay for waking the others
        (1.6 -> 0.6-0.7 ms a row on the Zen 4 box); the same bits at any thread count."""
        small = self.step_threads is not None and self.step_threads != self.num_threads
        if not small:
            return self.model.compute_logits(hidden)
        torch.set_num_threads(self.num_threads)
        try:
            return self.model.compute_logits(hidden)
        finally:
            torch.set_num_threads(self.step_threads)

    def _prefill_split(self, batch: BatchInputs) -> PrefillSplit | None:
        """This step's rows per rank under prefill context parallel (None: every rank runs
        every row, as at pcp=1 and in a step with no long enough prefill)."""
        parallel = self.parallel
        if parallel.pcp_size == 1:
            return None
        meta = next(m for m in batch.attn if m is not None)
        starts = meta.query_start_loc
        query_lens = [starts[i + 1] - starts[i] for i in range(len(starts) - 1)]
        return PrefillSplit.build(
            query_lens, parallel.pcp_size, parallel.dcp_rank, parallel.dcp_group
        )

    @torch.inference_mode()
    def execute_idle(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """A step with none of its requests on this rank (data-parallel attention): drop the
        ended ones and serve the other ranks' tokens in every MoE layer, in layer order, as
        their forward reaches it."""
        self._set_step_threads(0)
        for rid in out.finished_request_ids:
            self.input_batch.remove(rid)
        for block in self.model.modules():
            if isinstance(block, SparseMoeBlock):
                block.forward_idle()
        return ModelRunnerOutput({})

    def warm_up(self) -> None:
        """One small forward outside the scheduler (``warmup.py``), before the first step."""
        warm_up(self)

    def get_request_ids(self) -> set[str]:
        """Requests the runner keeps a row for."""
        return set(self.input_batch.row_of)

    def close(self) -> None:
        """Drop the model and the KV pool: the engine closed and no step runs again (nothing
        else to stop in-process; the executor protocol: ``executors/executor.py``)."""
        self.model = None
        self.kv_slots, self.kv_caches = (), []

    def forget(self, request_ids: frozenset[str]) -> None:
        """Drop the state of requests that ended (a step with nothing scheduled still must)."""
        for rid in request_ids:
            self.input_batch.remove(rid)

    @torch.inference_mode()
    def copy_blocks(self, copies: list[BlockCopy]) -> None:
        """Copy whole blocks (every layer) for copy-on-write forks and partial prefix hits:
        every source is read before any destination is written."""
        if not copies:
            return
        src = [c.src_block_id for c in copies]
        dst = [c.dst_block_id for c in copies]
        if set(src).isdisjoint(dst):  # block by block: a page's bytes at memcpy speed
            for slot in self.kv_slots:  # (num_blocks, page_bytes): every group's layers
                for s, d in zip(src, dst, strict=True):
                    slot[d].copy_(slot[s])
            return
        # a block both read and written: gather every source first (uint8 index_put runs
        # byte by byte, ~0.4 ms a SmolLM2 page)
        src_ids = torch.tensor(src, device=self.device)
        dst_ids = torch.tensor(dst, device=self.device)
        for slot in self.kv_slots:
            slot[dst_ids] = slot[src_ids]

    @property
    def page_bytes(self) -> int:
        """Bytes of one block id across every slot (all layers of its group): an offload page."""
        return self.local_layout.page_size_bytes * self.local_layout.num_slots

    @torch.inference_mode()
    def gather_pages(self, block_ids: list[int]) -> torch.Tensor:
        """(n, page_bytes) uint8 copies of the blocks, on the host."""
        ids = torch.tensor(block_ids, device=self.device)
        pages = torch.stack([slot[ids] for slot in self.kv_slots], dim=1)  # (n, slots, page)
        return pages.reshape(len(block_ids), -1).to("cpu", copy=True)

    @torch.inference_mode()
    def scatter_pages(self, block_ids: list[int], pages: torch.Tensor) -> None:
        """Write (n, page_bytes) host pages into the blocks (every slot)."""
        ids = torch.tensor(block_ids, device=self.device)
        pages = pages.to(self.device).view(len(block_ids), len(self.kv_slots), -1)
        for j, slot in enumerate(self.kv_slots):
            slot[ids] = pages[:, j]

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, masks: GrammarMasks | None = None) -> ModelRunnerOutput:
        self._set_step_threads(out.num_scheduled_tokens)
        batch = self.input_batch.prepare(out)
        logits = self._run_model(out, batch)
        if logits is None:
            return ModelRunnerOutput({})
        num_sampled = len(batch.sample_rows)
        prompt_lps = prompt_logprobs(out.scheduled, logits[num_sampled:], list(batch.prompt_rows))
        logits = logits[:num_sampled]
        items = [out.scheduled[i] for i in batch.sample_rows]
        # raw logprobs: taken before the grammar masks the rows in place
        lp_rows = [row for row, it in enumerate(items) if it.sampling.logprobs is not None]
        raw_lps = log_softmax(logits[lp_rows]) if lp_rows else None
        # a request's j-th logits row samples its output token num_output_tokens + j
        offsets = [0] * len(items)
        for row in range(1, len(items)):
            if batch.sample_rows[row] == batch.sample_rows[row - 1]:
                offsets[row] = offsets[row - 1] + 1
        if masks is not None:  # a request's rows are consecutive: its first, then its drafts'
            first = {it.request_id: row for row, it in enumerate(items) if not offsets[row]}
            seen: dict[str, int] = {}
            picked = []
            for rid in masks.request_ids:
                picked.append(first[rid] + seen.get(rid, 0))
                seen[rid] = seen.get(rid, 0) + 1
            rows = torch.tensor(picked, device=self.device)
            constrained = logits[rows].cpu()
            apply_bitmask(constrained, masks.future.result())
            logits[rows] = constrained.to(logits.device)
        token_ids = sample(
            logits,
            [it.sampling for it in items],
            [it.seed for it in items],
            [it.num_output_tokens + j for it, j in zip(items, offsets, strict=True)],
        )
        sampled, extra = _verify(items, offsets, token_ids)
        lps = sampled_logprobs(items, raw_lps, lp_rows, token_ids)
        return ModelRunnerOutput(sampled, extra, lps, prompt_lps)


def _verify(
    items: list[ScheduledRequest], offsets: list[int], token_ids: list[int]
) -> tuple[dict[str, int], dict[str, list[int]]]:
    """Keep, per request, the first sampled token and each one after a draft that matched
    what was sampled before it (the longest accepted prefix; see ScheduledRequest)."""
    sampled: dict[str, int] = {}
    extra: dict[str, list[int]] = {}
    for item, j, token_id in zip(items, offsets, token_ids, strict=True):
        rid = item.request_id
        if j == 0:
            sampled[rid] = token_id
            continue
        kept = extra.get(rid, [])
        previous = kept[-1] if kept else sampled[rid]
        if len(kept) == j - 1 and item.draft_token_ids[j - 1] == previous:
            extra.setdefault(rid, []).append(token_id)
    return sampled, extra


def _kept_rows(rows: torch.Tensor, num_rows: int) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(keep, where): the distinct rows in ``rows``, ascending (None when that is all
    ``num_rows``), and where each of ``rows`` sits among them."""
    keep = torch.unique(rows)  # sorted
    if len(keep) == num_rows:
        return None, rows
    return keep, torch.searchsorted(keep, rows)


def _staged(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """A host tensor's device copy through pinned memory, not waiting for it."""
    if t is None:
        return None
    return t.pin_memory().to(device, non_blocking=True)


def _on_device(batch: BatchInputs, device: torch.device) -> BatchInputs:
    """The step's inputs and the attention metadata the Triton kernels read, on the device
    (the lists and ``decode_ids`` stay: they index host-side)."""
    attn = tuple(
        None
        if m is None
        else dataclasses.replace(
            m,
            slot_mapping=_staged(m.slot_mapping, device),
            block_tables=_staged(m.block_tables, device),
            token_req=_staged(m.token_req, device),
            token_len=_staged(m.token_len, device),
        )
        for m in batch.attn
    )
    return dataclasses.replace(
        batch,
        input_ids=_staged(batch.input_ids, device),
        positions=_staged(batch.positions, device),
        attn=attn,
        logits_indices=_staged(batch.logits_indices, device),
    )


def finalize_weights(model: torch.nn.Module, mode: str, device: torch.device | None = None) -> bool:
    """Fix how every linear layer keeps its weight (quantized or float; ``models/quant.py``),
    then let each decoder layer whose shape allows it run as one fused op; True when any
    does (or would at one rank: the KV cache dtype follows). The compiled kernels are CPU
    kernels: on another device ``auto`` keeps floats and nothing fuses."""
    on_cpu = device is None or device.type == "cpu"
    kernels_ready = kernels.prepare(cpu=on_cpu)  # logs the active kernels once
    for module in model.modules():
        if isinstance(module, QuantizableLinear):
            module.finalize_weights(mode, kernels_ready)
    if not on_cpu:
        return False
    layers = [m for m in model.modules() if isinstance(m, DecoderLayer)]
    fused = [m.fuse() for m in layers]
    # a tensor-parallel rank keeps the KV dtype its layers would read fused at one rank
    return any(fused) or any(m.fusable() for m in layers)


def plan_rank_layout(
    config: EngineConfig,
    spec: ModelSpec,
    model: torch.nn.Module,
    kv_dtype: torch.dtype,
    parallel: ParallelState,
) -> KVCacheLayout:
    """This rank's KV layout. Every rank holds as many blocks as rank 0, which has the most KV
    heads (``ParallelState.head_shard``), fits in ``kv_cache_bytes``: one block id means the same
    tokens on every rank, and the scheduler plans one pool."""
    block_size, cache = config.cache.block_size, config.cache
    if parallel.dcp_size > 1:
        block_size //= parallel.dcp_size  # this rank's share of each scheduler block
    if parallel.tp_rank:
        first = ParallelState(0, parallel.tp_size)
        widest = plan_kv_layout(get_layer_specs(spec, model, block_size, kv_dtype, first), cache)
        cache = replace(cache, num_blocks=widest.num_blocks)
    return plan_kv_layout(get_layer_specs(spec, model, block_size, kv_dtype, parallel), cache)


def scheduler_layout(local: KVCacheLayout, parallel: ParallelState) -> KVCacheLayout:
    """The pool the scheduler plans: this rank's, with blocks ``dcp_size`` times longer (one
    block id names a block on every DCP rank; ``models/attention.py`` has the mapping)."""
    n = parallel.dcp_size
    if n == 1:
        return local
    if any(not isinstance(g.spec, FullAttentionSpec) for g in local.groups):
        raise ConfigError("decode context parallel takes full-attention models only (for now)")
    groups = tuple(
        replace(g, spec=replace(g.spec, block_size=g.spec.block_size * n)) for g in local.groups
    )
    return KVCacheLayout(local.num_blocks, groups, local.page_size_bytes * n)


def resolve_kv_dtype(config: EngineConfig, model_dtype: torch.dtype, fused: bool) -> torch.dtype:
    """The paged cache's element type (``CacheConfig.kv_cache_dtype``)."""
    choice = config.cache.kv_cache_dtype
    if choice == "auto":
        return torch.bfloat16 if fused and model_dtype == torch.float32 else model_dtype
    if choice == "int8":
        if kernels.triton_enabled() and kernels.BACKEND == "triton":
            raise ConfigError(
                "kv_cache_dtype='int8' needs the reference or compiled CPU kernels, "
                "not AGENTX_KERNELS=triton"
            )
        return torch.int8
    return DTYPES[choice]


def resolve_max_model_len(config: EngineConfig, spec: ModelSpec) -> int:
    if config.max_model_len is None:
        return spec.max_position
    if config.max_model_len > spec.max_position:
        raise ConfigError(
            f"max_model_len={config.max_model_len} exceeds the model's context "
            f"of {spec.max_position} tokens"
        )
    return config.max_model_len
