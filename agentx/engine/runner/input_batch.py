"""The runner's persistent view of running requests: one row per request, a block table per
KV group kept across steps and updated from the scheduler's diffs (new requests, appended
blocks).

It builds the flat varlen batch of a step::

    input_ids  [ r0: tokens computed this step | r1: ... | ... ]        (T,)
    positions  [ r0: start..start+n0-1         | r1: ... | ... ]        (T,)
    slots      block_table[g][pos // block_size] * block_size + pos % block_size   per group g

and, for linear-state groups, where each request's state is read and written (see
:class:`LinearStateMetadata`): entry i of such a table is the page of the checkpoint after
(i + 1) * block_size tokens, or null; the entry of the last computed token is the running state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agentx.engine.models.forward_context import AttentionMetadata, LinearStateMetadata
from agentx.engine.outputs import SchedulerOutput


@dataclass(frozen=True, slots=True)
class BatchInputs:
    input_ids: torch.Tensor  # (T,)
    positions: torch.Tensor  # (T,)
    attn: tuple[AttentionMetadata | None, ...]  # per KV group
    linear: tuple[LinearStateMetadata | None, ...]  # per KV group
    # (N,) the last token of each request that samples, and each of its drafts
    logits_indices: torch.Tensor
    sample_rows: list[int]  # index into the step's scheduled list, per logits row
    # after the sampled rows, prompt rows (prompt logprobs): (scheduled index, row count) each
    prompt_rows: tuple[tuple[int, int], ...] = ()


class InputBatch:
    def __init__(
        self,
        max_num_reqs: int,
        max_blocks_per_req: int,
        block_size: int,
        linear_groups: tuple[bool, ...] = (False,),
    ) -> None:
        self.block_size = block_size
        self.linear_groups = linear_groups
        num_groups = len(linear_groups)
        # int64 so the slot arithmetic below never overflows; 0 is the null block
        self.block_table = torch.zeros(
            num_groups, max_num_reqs, max_blocks_per_req, dtype=torch.long
        )
        self.num_blocks = [[0] * max_num_reqs for _ in range(num_groups)]
        self.row_of: dict[str, int] = {}
        self.free_rows = list(range(max_num_reqs - 1, -1, -1))

    def remove(self, request_id: str) -> None:
        row = self.row_of.pop(request_id, None)
        if row is not None:
            for counts in self.num_blocks:
                counts[row] = 0
            self.free_rows.append(row)

    def _update_blocks(
        self,
        request_id: str,
        block_ids: tuple[list[int], ...],
        is_new: bool,
        num_kept_blocks: int | None = None,
    ) -> int:
        if is_new:
            self.remove(request_id)
            if not self.free_rows:
                raise RuntimeError("input batch has no free row: more running requests than rows")
            self.row_of[request_id] = self.free_rows.pop()
        row = self.row_of[request_id]
        if num_kept_blocks is not None:  # blocks of rejected drafts went back to the pool
            for counts in self.num_blocks:
                counts[row] = min(counts[row], num_kept_blocks)
        for g, ids in enumerate(block_ids):
            start = 0 if is_new else self.num_blocks[g][row]
            end = start + len(ids)
            if ids:
                self.block_table[g, row, start:end] = torch.tensor(ids, dtype=torch.long)
            self.num_blocks[g][row] = end
        return row

    def prepare(self, out: SchedulerOutput) -> BatchInputs:
        for rid in out.finished_request_ids:
            self.remove(rid)
        rows, tokens, positions, query_start_loc, seq_lens = [], [], [], [0], []
        logits_indices, sample_rows = [], []
        prompt_indices, prompt_rows = [], []
        for i, item in enumerate(out.scheduled):
            rows.append(
                self._update_blocks(
                    item.request_id, item.new_block_ids, item.is_new, item.num_kept_blocks
                )
            )
            n = len(item.token_ids)
            tokens.extend(item.token_ids)
            positions.extend(range(item.start_position, item.start_position + n))
            query_start_loc.append(query_start_loc[-1] + n)
            seq_lens.append(item.start_position + n)
            if item.sample:
                # the last real token, then each draft: [.. real | d0 .. d(k-1) ]
                end = query_start_loc[-1]
                logits_indices.extend(range(end - 1 - item.num_draft_tokens, end))
                sample_rows.extend([i] * (item.num_draft_tokens + 1))
            if item.prompt_targets:  # row j predicts the token after token_ids[j]
                start = query_start_loc[-2]
                prompt_indices.extend(range(start, start + len(item.prompt_targets)))
                prompt_rows.append((i, len(item.prompt_targets)))
        row_t = torch.tensor(rows, dtype=torch.long)
        pos_t = torch.tensor(positions, dtype=torch.long)
        query_lens = [query_start_loc[i + 1] - query_start_loc[i] for i in range(len(rows))]
        query_lens_t = torch.tensor(query_lens)
        token_rows = torch.repeat_interleave(row_t, query_lens_t)  # (T,)
        token_req = torch.repeat_interleave(torch.arange(len(rows)), query_lens_t)  # (T,)
        token_len = pos_t + 1
        decode_ids = torch.tensor([i for i, n in enumerate(query_lens) if n == 1], dtype=torch.long)
        prefill_ids = [i for i, n in enumerate(query_lens) if n != 1]
        max_blocks = -(-max(seq_lens) // self.block_size)
        attn: list[AttentionMetadata | None] = []
        linear: list[LinearStateMetadata | None] = []
        for g, is_linear in enumerate(self.linear_groups):
            table = self.block_table[g]
            if is_linear:
                attn.append(None)
                linear.append(self._linear_metadata(table, rows, seq_lens, query_start_loc))
                continue
            block_ids = table[token_rows, pos_t // self.block_size]
            attn.append(
                AttentionMetadata(
                    slot_mapping=block_ids * self.block_size + pos_t % self.block_size,
                    query_start_loc=query_start_loc,
                    seq_lens=seq_lens,
                    block_tables=table[row_t, :max_blocks],
                    decode_ids=decode_ids,
                    prefill_ids=prefill_ids,
                    token_req=token_req,
                    token_len=token_len,
                )
            )
            linear.append(None)
        return BatchInputs(
            input_ids=torch.tensor(tokens, dtype=torch.long),
            positions=pos_t,
            attn=tuple(attn),
            linear=tuple(linear),
            logits_indices=torch.tensor(logits_indices + prompt_indices, dtype=torch.long),
            sample_rows=sample_rows,
            prompt_rows=tuple(prompt_rows),
        )

    def _linear_metadata(
        self,
        table: torch.Tensor,
        rows: list[int],
        seq_lens: list[int],
        query_start_loc: list[int],
    ) -> LinearStateMetadata:
        """Read the running page; write every checkpoint page crossed, then the running one.

        tokens   ... n | n+1 ... b1 ... b2 ... n+q        b1, b2: block boundaries
        pages      src           ckpt   ckpt   running    (ckpt only where not null)
        """
        bs = self.block_size
        src_pages, save_points = [], []
        for i, row in enumerate(rows):
            end = seq_lens[i]
            start = end - (query_start_loc[i + 1] - query_start_loc[i])
            entries = table[row, : -(-end // bs)].tolist()
            src_pages.append(entries[-(-start // bs) - 1] if start > 0 else -1)
            points = [
                (b - start, entries[b // bs - 1])
                for b in range((start // bs + 1) * bs, end + 1, bs)
                if entries[b // bs - 1] != 0
            ]
            if not points or points[-1][0] != end - start:
                points.append((end - start, entries[-1]))
            save_points.append(tuple(points))
        return LinearStateMetadata(list(query_start_loc), src_pages, save_points)
