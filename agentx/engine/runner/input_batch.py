"""The runner's persistent view of running requests: one row per request, block tables kept
across steps and updated from the scheduler's diffs (new requests, appended blocks).

It builds the flat varlen batch of a step::

    input_ids  [ r0: tokens computed this step | r1: ... | ... ]        (T,)
    positions  [ r0: start..start+n0-1         | r1: ... | ... ]        (T,)
    slots      block_table[pos // block_size] * block_size + pos % block_size
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agentx.engine.models.forward_context import AttentionMetadata
from agentx.engine.outputs import SchedulerOutput


@dataclass(frozen=True, slots=True)
class BatchInputs:
    input_ids: torch.Tensor  # (T,)
    positions: torch.Tensor  # (T,)
    attn: AttentionMetadata
    logits_indices: torch.Tensor  # (N,) last token of each request that samples
    sample_rows: list[int]  # index into the step's scheduled list, per logits row


class InputBatch:
    def __init__(self, max_num_reqs: int, max_blocks_per_req: int, block_size: int) -> None:
        self.block_size = block_size
        # int64 so the slot arithmetic below never overflows; 0 is the null block
        self.block_table = torch.zeros(max_num_reqs, max_blocks_per_req, dtype=torch.long)
        self.num_blocks = [0] * max_num_reqs
        self.row_of: dict[str, int] = {}
        self.free_rows = list(range(max_num_reqs - 1, -1, -1))

    def remove(self, request_id: str) -> None:
        row = self.row_of.pop(request_id, None)
        if row is not None:
            self.num_blocks[row] = 0
            self.free_rows.append(row)

    def _update_blocks(self, request_id: str, block_ids: list[int], is_new: bool) -> int:
        if is_new:
            self.remove(request_id)
            if not self.free_rows:
                raise RuntimeError("input batch has no free row: more running requests than rows")
            self.row_of[request_id] = self.free_rows.pop()
        row = self.row_of[request_id]
        start = 0 if is_new else self.num_blocks[row]
        end = start + len(block_ids)
        if block_ids:
            self.block_table[row, start:end] = torch.tensor(block_ids, dtype=torch.long)
        self.num_blocks[row] = end
        return row

    def prepare(self, out: SchedulerOutput) -> BatchInputs:
        for rid in out.finished_request_ids:
            self.remove(rid)
        rows, tokens, positions, query_start_loc, seq_lens = [], [], [], [0], []
        logits_indices, sample_rows = [], []
        for i, item in enumerate(out.scheduled):
            rows.append(self._update_blocks(item.request_id, item.new_block_ids[0], item.is_new))
            n = len(item.token_ids)
            tokens.extend(item.token_ids)
            positions.extend(range(item.start_position, item.start_position + n))
            query_start_loc.append(query_start_loc[-1] + n)
            seq_lens.append(item.start_position + n)
            if item.sample:
                logits_indices.append(query_start_loc[-1] - 1)
                sample_rows.append(i)
        row_t = torch.tensor(rows, dtype=torch.long)
        pos_t = torch.tensor(positions, dtype=torch.long)
        lens_t = torch.tensor(
            [query_start_loc[i + 1] - query_start_loc[i] for i in range(len(rows))]
        )
        token_rows = torch.repeat_interleave(row_t, lens_t)  # (T,)
        block_ids = self.block_table[token_rows, pos_t // self.block_size]
        slot_mapping = block_ids * self.block_size + pos_t % self.block_size
        max_blocks = -(-max(seq_lens) // self.block_size)
        decode_ids = [i for i, n in enumerate(lens_t.tolist()) if n == 1]
        attn = AttentionMetadata(
            slot_mapping=slot_mapping,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=self.block_table[row_t, :max_blocks],
            decode_ids=torch.tensor(decode_ids, dtype=torch.long),
            prefill_ids=[i for i, n in enumerate(lens_t.tolist()) if n != 1],
        )
        return BatchInputs(
            input_ids=torch.tensor(tokens, dtype=torch.long),
            positions=pos_t,
            attn=attn,
            logits_indices=torch.tensor(logits_indices, dtype=torch.long),
            sample_rows=sample_rows,
        )
