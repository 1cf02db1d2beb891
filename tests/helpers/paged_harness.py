"""A hand-built stand-in for the runner: paged KV for attention layers, paged state for linear
layers, and one step's forward context built from (sequence, new tokens, save points)."""

from dataclasses import dataclass, field

import torch

from agentx.engine.models.forward_context import (
    AttentionMetadata,
    ForwardContext,
    LinearStateMetadata,
    forward_context,
)

BLOCK_SIZE = 16


@dataclass
class Seq:
    """One sequence's cache: attention blocks and linear-state pages, as a runner would keep."""

    tokens: list[int] = field(default_factory=list)  # computed so far
    blocks: list[int] = field(default_factory=list)
    page: int = -1  # running linear-state page
    src_page: int = -1  # where the state comes from before the running page exists (a fork)
    checkpoints: dict[int, int] = field(default_factory=dict)  # num tokens -> saved page


class Harness:
    """Paged caches for every layer and hand-built step metadata. Block and page 0 are null;
    blocks are handed out in a shuffled order so nothing relies on contiguity."""

    def __init__(self, model, num_blocks: int = 160, num_pages: int = 96) -> None:
        self.model = model
        spec = model.spec
        self.linear_layers = [
            i for i in range(spec.num_layers) if spec.get_layer_type(i) == "linear_attention"
        ]
        shapes = model.get_linear_state_shapes() if self.linear_layers else ()
        dtype = model.linear_state_dtype if self.linear_layers else None
        self.kv_caches = []
        for i in range(spec.num_layers):
            if i in self.linear_layers:
                pages = tuple(
                    torch.full((num_pages, *s), float("nan"), dtype=dtype) for s in shapes
                )
                self.kv_caches.append(pages)
            else:
                kv_shape = (num_blocks, 2, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim)
                self.kv_caches.append(torch.zeros(kv_shape, dtype=model.embed_tokens.weight.dtype))
        gen = torch.Generator().manual_seed(1)
        self.free_blocks = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
        self.free_pages = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()

    def fork(self, seq: Seq, num_tokens: int) -> Seq:
        """A new sequence sharing seq's first num_tokens (a block boundary with a checkpoint)."""
        assert num_tokens % BLOCK_SIZE == 0
        blocks = seq.blocks[: num_tokens // BLOCK_SIZE]
        return Seq(
            list(seq.tokens[:num_tokens]), list(blocks), src_page=seq.checkpoints[num_tokens]
        )

    def step(
        self, work: list[tuple[Seq, list[int], tuple[int, ...]]], keep: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        """Run (seq, new tokens, extra save points) requests as one flat batch; returns each
        request's logits (n_new, vocab), or with ``keep`` (rows of the flat batch, ascending)
        one tensor of those rows' logits, the model asked for them alone."""
        ids, positions, slots, qsl, seq_lens = [], [], [], [0], []
        src_pages, save_points = [], []
        for seq, new, saves in work:
            start = len(seq.tokens)
            total = start + len(new)
            while len(seq.blocks) * BLOCK_SIZE < total:
                seq.blocks.append(self.free_blocks.pop())
            pos = list(range(start, total))
            ids += new
            positions += pos
            slots += [seq.blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in pos]
            qsl.append(qsl[-1] + len(new))
            seq_lens.append(total)
            src_pages.append(seq.page if seq.page >= 0 else seq.src_page)
            if seq.page < 0:
                seq.page = self.free_pages.pop()
            points = []
            for n in saves:
                page = self.free_pages.pop()
                seq.checkpoints[start + n] = page
                points.append((n, page))
            save_points.append((*points, (len(new), seq.page)))
        max_blocks = max(len(seq.blocks) for seq, _, _ in work)
        block_tables = torch.zeros(len(work), max_blocks, dtype=torch.long)
        for i, (seq, _, _) in enumerate(work):
            block_tables[i, : len(seq.blocks)] = torch.tensor(seq.blocks)
        one = [i for i, (_, new, _) in enumerate(work) if len(new) == 1]
        attn = AttentionMetadata(
            slot_mapping=torch.tensor(slots),
            query_start_loc=qsl,
            seq_lens=seq_lens,
            block_tables=block_tables,
            decode_ids=torch.tensor(one, dtype=torch.long),
            prefill_ids=[i for i in range(len(work)) if i not in one],
        )
        linear = LinearStateMetadata(qsl, src_pages, save_points)
        groups = tuple(1 if i in self.linear_layers else 0 for i in range(len(self.kv_caches)))
        ctx = ForwardContext((attn, None), groups, self.kv_caches, (None, linear))
        with torch.inference_mode(), forward_context(ctx):
            hidden = self.model(torch.tensor(ids), torch.tensor(positions), keep)
            logits = self.model.compute_logits(hidden)
        for seq, new, _ in work:
            seq.tokens += new
        if keep is not None:
            return [logits]
        return list(logits.split([len(new) for _, new, _ in work]))
