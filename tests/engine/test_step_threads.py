"""Threads per step on CPU (EngineConfig.small_step_tokens): a step of at most that many tokens
runs on one thread, a larger one on num_threads, and greedy tokens are the same bits as with
every step on num_threads (the kernels' arithmetic does not depend on the thread count)."""

import pytest
import torch

from agentx import CacheConfig, ConfigError, EngineConfig, SamplingParams, SchedulerConfig

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def test_small_step_tokens_is_validated():
    assert EngineConfig().small_step_tokens == 0  # every step on every core (the kernels' team)
    for bad in (-1, 1.5, None):
        with pytest.raises(ConfigError, match="small_step_tokens"):
            EngineConfig(small_step_tokens=bad)


def test_small_steps_run_on_one_thread_and_keep_every_token(make_engine, greedy_prompts):
    scheduler = SchedulerConfig(max_num_batched_tokens=64, long_prefill_token_threshold=48)
    cache = CacheConfig(kv_cache_bytes=64 << 20)
    per_step = make_engine(num_threads=2, cache=cache, scheduler=scheduler, small_step_tokens=16)
    fixed = make_engine(num_threads=2, cache=cache, scheduler=scheduler)  # the default: 0
    runner = per_step.core.runner
    logits_threads = []
    compute_logits = runner.model.compute_logits

    def recording(hidden):
        logits_threads.append(torch.get_num_threads())
        return compute_logits(hidden)

    runner.model.compute_logits = recording
    tok = per_step.tokenizer
    long = tok.encode("You are a careful assistant. Think step by step. " * 12)  # 48-token chunks
    assert len(long) > 100
    per_step.generate([long], SamplingParams(max_tokens=1))
    assert (runner.num_threads, runner.step_threads) == (2, 2)  # its last step: a 48-token chunk
    per_step.generate([greedy_prompts[0]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert runner.step_threads == 1  # its last step: one decode
    assert logits_threads[-1] == 2  # the LM head runs on both threads even then
    prompts = [*greedy_prompts, long]
    want = [g.token_ids for g in fixed.generate(prompts, GREEDY)]
    assert fixed.core.runner.step_threads == 2  # never switched
    assert [g.token_ids for g in per_step.generate(prompts, GREEDY)] == want
    alone = [per_step.generate([p], GREEDY)[0].token_ids for p in prompts]  # decodes on 1 thread
    assert alone == want
    per_step.check_integrity()
    assert per_step.stats().kv_num_used_blocks == 0
