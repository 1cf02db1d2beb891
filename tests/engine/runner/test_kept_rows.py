"""The rows a step's last layer computes (``model_runner._kept_rows``): those the LM head reads,
each once, ascending, and where each read finds its row."""

import torch

from agentx.engine.runner.model_runner import _kept_rows


def test_drafts_and_prompt_rows_read_each_kept_row_once():
    # a request's sampled row and drafts (5, 6, 7), then its prompt-logprob rows (4, 5)
    rows = torch.tensor([5, 6, 7, 4, 5])
    keep, where = _kept_rows(rows, num_rows=12)
    assert keep is not None and keep.tolist() == [4, 5, 6, 7]
    assert where.tolist() == [1, 2, 3, 0, 1]
    assert torch.equal(keep[where], rows)


def test_a_step_that_reads_every_row_keeps_them_all_in_place():
    rows = torch.tensor([0, 1, 2])  # three decode rows
    keep, where = _kept_rows(rows, num_rows=3)
    assert keep is None and where is rows


def test_a_chunk_that_samples_nothing_keeps_no_row():
    keep, where = _kept_rows(torch.tensor([], dtype=torch.long), num_rows=64)
    assert keep is not None and keep.numel() == 0 and where.numel() == 0
