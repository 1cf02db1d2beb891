"""Decode steps replayed from CUDA graphs (CUDA with the Triton kernels only).

A decode step of ``n`` requests (one token each, no drafts) replays the graph captured for the
smallest bucket ``B >= n`` of ``EngineConfig.cuda_graph_batch_sizes``; rows ``n .. B - 1`` are
padding. Every graph reads the same persistent device buffers, filled before each replay from
pinned host buffers by non-blocking copies::

    input_ids, positions           (B,)       padding: token 0 at position 0
    seq_lens                       (B,)       padding: 1 (it reads the null block, discarded)
    slot_mapping[g]                (G, B)     padding: -1 (the KV write skips it)
    block_tables[g]                (G, B, W)  padding: the null block
    query_start_loc                0 .. B     fixed: one token per row

The graph runs the model and the LM head; sampling stays outside (it is the step's one host
sync). The pinned buffers are rewritten only after the previous step sampled, which waited for
the copies that read them. Linear-state (hybrid) models are not captured: their state pages
move per request on the host side of the step.
"""

from __future__ import annotations

import torch

from agentx.engine.models.forward_context import AttentionMetadata, ForwardContext, forward_context
from agentx.engine.runner.input_batch import BatchInputs

__all__ = ["DecodeGraphs"]


class DecodeGraphs:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list,
        layer_groups: tuple[int, ...],
        num_groups: int,
        max_blocks_per_req: int,
        max_model_len: int,
        batch_sizes: tuple[int, ...],
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.layer_groups = layer_groups
        self.batch_sizes = batch_sizes
        self.max_model_len = max_model_len
        self.device = device
        max_b = batch_sizes[-1]
        long = dict(dtype=torch.long, device=device)
        self.input_ids = torch.zeros(max_b, **long)
        self.positions = torch.zeros(max_b, **long)
        self.seq_lens = torch.ones(max_b, dtype=torch.int32, device=device)
        self.slot_mapping = torch.full((num_groups, max_b), -1, **long)
        self.block_tables = torch.zeros(num_groups, max_b, max_blocks_per_req, **long)
        self.query_start_loc = torch.arange(max_b + 1, dtype=torch.int32, device=device)
        pinned = dict(pin_memory=device.type == "cuda")  # a CPU device: the tests' eager runs
        self.host_ids = torch.zeros(max_b, dtype=torch.long, **pinned)
        self.host_positions = torch.zeros(max_b, dtype=torch.long, **pinned)
        self.host_seq_lens = torch.ones(max_b, dtype=torch.int32, **pinned)
        self.host_slots = torch.full((num_groups, max_b), -1, dtype=torch.long, **pinned)
        self.host_tables = torch.zeros(
            num_groups, max_b, max_blocks_per_req, dtype=torch.long, **pinned
        )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}

    def bucket(self, num_reqs: int) -> int | None:
        return next((b for b in self.batch_sizes if b >= num_reqs), None)

    def _context(self, size: int) -> ForwardContext:
        from agentx.kernels.triton.attention import choose_num_splits

        # (num_blocks, 2, block_size, num_kv_heads, head_dim): the first attention layer's
        num_kv_heads = next(c for c in self.kv_caches if isinstance(c, torch.Tensor)).shape[3]
        splits = choose_num_splits(self.device, size * num_kv_heads, self.max_model_len, 64)
        attn = tuple(
            AttentionMetadata(
                slot_mapping=self.slot_mapping[g, :size],
                query_start_loc=self.query_start_loc[: size + 1],
                seq_lens=self.seq_lens[:size],
                block_tables=self.block_tables[g, :size],
                decode_ids=torch.arange(size, device=self.device),
                prefill_ids=[],
                max_query_len=1,
                num_splits=splits,
            )
            for g in range(self.slot_mapping.shape[0])
        )
        return ForwardContext(attn=attn, layer_groups=self.layer_groups, kv_caches=self.kv_caches)

    def forward(self, size: int) -> torch.Tensor:
        """The model and LM head over the buffers' first ``size`` rows: what a graph holds."""
        with forward_context(self._context(size)):
            hidden = self.model(self.input_ids[:size], self.positions[:size])
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, in one memory pool (each is run eagerly once
        first, so Triton compiles outside the capture). The buffers hold padding: no KV is
        written."""
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for size in reversed(self.batch_sizes):
                self.forward(size)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        for size in reversed(self.batch_sizes):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[size] = self.forward(size)
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)

    def replay(self, batch: BatchInputs, seq_lens: list[int]) -> torch.Tensor:
        """Logits (n, vocab) of a decode step of n = len(seq_lens) requests."""
        size = self.stage(batch, seq_lens)
        assert size in self.graphs, f"no graph for {len(seq_lens)} requests"
        self.graphs[size].replay()
        return self.logits[size][: len(seq_lens)]

    def stage(self, batch: BatchInputs, seq_lens: list[int]) -> int:
        """Fill the persistent buffers with the step's rows and padding; returns the bucket."""
        n = len(seq_lens)
        size = self.bucket(n)
        assert size is not None, f"{n} requests exceed the largest CUDA graph"
        self.host_ids[:n] = batch.input_ids
        self.host_ids[n:size] = 0
        self.host_positions[:n] = batch.positions
        self.host_positions[n:size] = 0
        self.host_seq_lens[:n] = torch.tensor(seq_lens, dtype=torch.int32)
        self.host_seq_lens[n:size] = 1
        width = 0
        for g, meta in enumerate(batch.attn):
            assert meta is not None
            self.host_slots[g, :n] = meta.slot_mapping
            self.host_slots[g, n:size] = -1
            width = max(width, meta.block_tables.shape[1])
            self.host_tables[g, :n, : meta.block_tables.shape[1]] = meta.block_tables
            self.host_tables[g, n:size, :width] = 0
        self.input_ids[:size].copy_(self.host_ids[:size], non_blocking=True)
        self.positions[:size].copy_(self.host_positions[:size], non_blocking=True)
        self.seq_lens[:size].copy_(self.host_seq_lens[:size], non_blocking=True)
        self.slot_mapping[:, :size].copy_(self.host_slots[:, :size], non_blocking=True)
        # only the columns in use: the kernels never read a row's blocks past its length
        self.block_tables[:, :size, :width].copy_(
            self.host_tables[:, :size, :width], non_blocking=True
        )
        return size
