"""Greedy output equals the transformers reference, and stays identical under batching,
prefix-cache hits, chunked prefill and preemption (fp32, the real default model)."""

import pytest
import torch

from agentx import CacheConfig, SamplingParams, SchedulerConfig

pytestmark = pytest.mark.slow

NUM_TOKENS = 64
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def reference_tokens(greedy_prompts):
    """64 greedy tokens per prompt from transformers' own Llama on the same GGUF weights."""
    from transformers import AutoModelForCausalLM

    from agentx.engine.models.loader import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    out = []
    with torch.inference_mode():
        for prompt in greedy_prompts:
            ids = torch.tensor([prompt])
            res = model(ids, use_cache=True)
            tokens = []
            for _ in range(NUM_TOKENS):
                nxt = int(res.logits[0, -1].argmax())
                tokens.append(nxt)
                res = model(torch.tensor([[nxt]]), past_key_values=res.past_key_values)
            out.append(tokens)
    return out


def run_alone(engine, prompts):
    return [engine.generate([p], GREEDY)[0].token_ids for p in prompts]


def test_greedy_matches_transformers(default_engine, greedy_prompts, reference_tokens):
    got = run_alone(default_engine, greedy_prompts)
    for prompt, mine, ref in zip(greedy_prompts, got, reference_tokens, strict=True):
        assert mine == ref, f"prompt {prompt[:8]}..."
    default_engine.check_integrity()


def test_batched_equals_alone(default_engine, greedy_prompts, reference_tokens):
    gens = default_engine.generate(greedy_prompts, GREEDY)
    assert [g.token_ids for g in gens] == reference_tokens
    default_engine.check_integrity()
    assert default_engine.stats().kv_num_used_blocks == 0


def test_prefix_cache_hit_keeps_tokens(make_engine, greedy_prompts, reference_tokens):
    engine = make_engine()
    cold = engine.generate(greedy_prompts, GREEDY)
    assert all(g.usage.cached_tokens == 0 for g in cold)
    warm = engine.generate(greedy_prompts, GREEDY)
    for g, prompt in zip(warm, greedy_prompts, strict=True):
        # every full block of the prompt is reused; the last token is always recomputed
        assert g.usage.cached_tokens == (len(prompt) - 1) // 16 * 16
    assert [g.token_ids for g in warm] == reference_tokens
    # a continuation that re-sends prompt + output hits the output blocks as well
    turn2 = [p + g.token_ids + [198] for p, g in zip(greedy_prompts, warm, strict=True)]
    gens = engine.generate(turn2, SamplingParams(max_tokens=8, ignore_eos=True))
    for g, prompt in zip(gens, turn2, strict=True):
        assert g.usage.cached_tokens == (len(prompt) - 2) // 16 * 16
    stats = engine.stats()
    assert stats.prefix_cache_hit_tokens == sum(g.usage.cached_tokens for g in warm + gens)
    engine.check_integrity()


def test_chunked_prefill_threshold_16(make_engine, greedy_prompts, reference_tokens):
    engine = make_engine(scheduler=SchedulerConfig(long_prefill_token_threshold=16))
    gens = engine.generate(greedy_prompts, GREEDY)
    assert [g.token_ids for g in gens] == reference_tokens
    # the 37-token chat prompt alone needs 3 steps at 16 tokens a step before its first token
    assert engine.stats().num_steps >= NUM_TOKENS + 2
    engine.check_integrity()


def test_preemption_keeps_tokens(make_engine, greedy_prompts, reference_tokens):
    # 24 usable blocks of 16 tokens = 384 tokens; five requests need ~5 * 6 blocks at the end
    engine = make_engine(cache=CacheConfig(num_blocks=25))
    gens = engine.generate(greedy_prompts, GREEDY)
    assert engine.stats().num_preemptions > 0
    assert [g.token_ids for g in gens] == reference_tokens
    engine.check_integrity()
    assert engine.stats().kv_num_used_blocks == 0
