"""Prefill context parallel: which of a step's tokens each rank computes, and how the ranks'
rows are put back together (below the models, like ``state.py``; the runner builds a split,
the attention layer and the runner gather through it).

The ranks are the decode-context-parallel group (``pcp == dcp``): the KV layout stays DCP's,
rank r keeps the positions p with p % N == r. A request with at least 2N new tokens in the step
is cut into 2N pieces (as equal as they go, the first ones one token longer) and rank r takes
pieces r and 2N-1-r (zig-zag: an early piece, cheap under causal attention, with a late one)::

    N = 2, 18 new tokens:   pieces 5 | 5 | 4 | 4     rank 0: pieces 0, 3 (9 tokens)
                                                     rank 1: pieces 1, 2 (9 tokens)

Shorter requests (decodes, a short chunk's tail) run on every rank, as under DCP: splitting one
token saves nothing and costs a gather. A rank runs embedding, projections, MLP and norms over
its own rows only; the attention layer gathers the step's q / k / v from every rank
(:meth:`PrefillSplit.gather`), writes the positions its DCP share owns and attends every query
over its keys (the DCP merge), then keeps its own rows; the runner gathers the final hidden
states before the LM head. Every rank assembles the same full tensors, in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


def zigzag_rows(query_lens: list[int], num_ranks: int, rank: int) -> list[int]:
    """The step's row indices ``rank`` computes (ascending): its two zig-zag pieces of each
    request with at least ``2 * num_ranks`` new tokens, and every row of the others."""
    rows: list[int] = []
    start, num_pieces = 0, 2 * num_ranks
    for n in query_lens:
        if n < num_pieces:
            rows.extend(range(start, start + n))
        else:
            base, extra = divmod(n, num_pieces)
            bounds = [start]
            for j in range(num_pieces):
                bounds.append(bounds[-1] + base + (j < extra))
            for j in (rank, num_pieces - 1 - rank):
                rows.extend(range(bounds[j], bounds[j + 1]))
        start += n
    return rows


@dataclass(frozen=True, slots=True)
class PrefillSplit:
    """One step's rows per rank of the prefill-context-parallel group (``group``: the DCP
    group). ``rows[r]`` are rank r's row indices into the step's ``num_tokens`` rows."""

    rows: tuple[torch.Tensor, ...]  # per rank, (T_r,) int64, ascending
    rank: int
    num_tokens: int
    group: Any = None

    @classmethod
    def build(
        cls, query_lens: list[int], num_ranks: int, rank: int, group: Any = None
    ) -> PrefillSplit | None:
        """The split of a step, or None when no request is long enough to split (a decode
        step runs as plain DCP)."""
        if all(n < 2 * num_ranks for n in query_lens):
            return None
        rows = tuple(
            torch.tensor(zigzag_rows(query_lens, num_ranks, r), dtype=torch.long)
            for r in range(num_ranks)
        )
        return cls(rows, rank, sum(query_lens), group)

    @property
    def own(self) -> torch.Tensor:
        return self.rows[self.rank]

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's rows (T_rank, *shape) -> the step's (T, *shape) on every rank. Rows
        every rank computed (unsplit requests) are taken from the last rank: the same tensor
        on all of them."""
        counts = [len(r) for r in self.rows]
        padded = x.new_zeros(max(counts), *x.shape[1:])  # all_gather wants equal shapes
        padded[: len(x)] = x
        parts = [torch.empty_like(padded) for _ in self.rows]
        torch.distributed.all_gather(parts, padded, group=self.group)
        full = x.new_empty(self.num_tokens, *x.shape[1:])
        for rows, part, count in zip(self.rows, parts, counts, strict=True):
            full[rows.to(x.device)] = part[:count]
        return full
