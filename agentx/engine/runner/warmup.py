"""Warm-up: one small prefill and one decode step at start, so no request pays for first use.

Kernels, libraries and devices set themselves up lazily: a CUDA context and cuBLAS handles,
Triton compiles, oneDNN primitives, OpenMP's thread pool, torch modules imported on a first
call, weight layouts a kernel prepares once. The engine runs :func:`warm_up` on its loop thread
before it takes its first request, through the same ``execute`` path a step takes (sampling
with temperature, top-k and top-p, and a grammar mask, included).

The warm-up request lives only in the runner: every block table entry is the null block (id 0,
which the pool never hands out), so its KV lands there, and afterwards the null block is zeroed
again and the request forgotten. Scheduler, block pool and prefix cache never see it. On CUDA
with the Triton kernels the decode CUDA graphs are captured last, once every kernel compiled.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from agentx.engine.block_hash import NULL_BLOCK_ID
from agentx.engine.outputs import GrammarMasks, ScheduledRequest, SchedulerOutput
from agentx.engine.sampling import SamplingParams

if TYPE_CHECKING:  # the runner calls this module
    from agentx.engine.runner.model_runner import ModelRunner

__all__ = ["WARM_UP_REQUEST_ID", "warm_up"]

WARM_UP_REQUEST_ID = "agentx-warm-up"
_SAMPLING = SamplingParams(temperature=1.0, top_k=8, top_p=0.9, max_tokens=2)


def warm_up(runner: ModelRunner, num_prompt_tokens: int = 32) -> None:
    """Prefill ``num_prompt_tokens`` (fewer if the context is shorter), then decode one token."""
    num_prompt_tokens = max(1, min(num_prompt_tokens, runner.max_model_len - 1))
    vocab_size = runner.spec.vocab_size
    prompt = [i % vocab_size for i in range(num_prompt_tokens)]
    num_blocks = -(-(num_prompt_tokens + 1) // runner.layout.block_size)
    null_blocks = tuple([NULL_BLOCK_ID] * num_blocks for _ in runner.layout.groups)
    prefill = _scheduled(prompt, 0, null_blocks, is_new=True, num_output_tokens=0)
    [token_id] = runner.execute(_step(prefill)).sampled_token_ids.values()
    no_blocks = tuple([] for _ in runner.layout.groups)
    decode = _scheduled([token_id], num_prompt_tokens, no_blocks, is_new=False, num_output_tokens=1)
    runner.execute(_step(decode), _allow_all(vocab_size))
    runner.forget(frozenset({WARM_UP_REQUEST_ID}))
    for slot in runner.kv_slots:  # (num_blocks, page_bytes): a page never used reads as zeros
        slot[NULL_BLOCK_ID].zero_()
    runner.capture_decode_graphs()  # CUDA + Triton only; it writes no KV


def _scheduled(
    token_ids: list[int],
    start_position: int,
    new_block_ids: tuple[list[int], ...],
    is_new: bool,
    num_output_tokens: int,
) -> ScheduledRequest:
    return ScheduledRequest(
        request_id=WARM_UP_REQUEST_ID,
        token_ids=token_ids,
        start_position=start_position,
        new_block_ids=new_block_ids,
        is_new=is_new,
        sample=True,
        sampling=_SAMPLING,
        seed=0,
        num_output_tokens=num_output_tokens,
    )


def _step(item: ScheduledRequest) -> SchedulerOutput:
    return SchedulerOutput([item], len(item.token_ids), frozenset())


def _allow_all(vocab_size: int) -> GrammarMasks:
    """A grammar mask that allows every token: runs the masking path, changes nothing."""
    future: Future = Future()
    future.set_result(torch.full((1, -(-vocab_size // 32)), -1, dtype=torch.int32))
    return GrammarMasks([WARM_UP_REQUEST_ID], future)
