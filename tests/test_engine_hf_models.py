"""Hugging Face folders through the whole engine: tiny random Llama (untied head, Llama 3 RoPE
scaling) and Qwen2 (qkv bias, tied head) checkpoints give the transformers greedy tokens."""

import pytest
import torch
import transformers

from agentx import CacheConfig, Engine, EngineConfig, SamplingParams, SchedulerConfig

pytestmark = pytest.mark.slow

PROMPTS = [[1, 504, 3575, 282, 4649, 314], [17, 29, 30, 31] * 9, list(range(200, 261))]
NUM_TOKENS = 24


def tiny(config_class, **overrides):
    return config_class(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=0.5,  # wide logits: no near-ties for fp32 rounding to flip
        **overrides,
    )


def reference_greedy(model, prompt):
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        for _ in range(NUM_TOKENS):
            ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], dim=1)
    return ids[0, len(prompt) :].tolist()


def save(folder, model, tokenizer):
    model.save_pretrained(folder)
    hf_tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer.backend, bos_token="<|im_start|>", eos_token="<|im_end|>"
    )
    hf_tok.save_pretrained(folder)


@pytest.mark.parametrize(
    "config_class, model_class, overrides",
    [
        (
            transformers.LlamaConfig,
            transformers.LlamaForCausalLM,
            {
                "tie_word_embeddings": False,
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 256,
                },
            },
        ),
        (
            transformers.Qwen2Config,
            transformers.Qwen2ForCausalLM,
            {"tie_word_embeddings": True, "rope_theta": 1e6},
        ),
    ],
    ids=["llama3-untied", "qwen2-bias-tied"],
)
def test_hf_folder_greedy_matches_transformers(
    tmp_path, default_engine, config_class, model_class, overrides
):
    torch.manual_seed(0)
    model = model_class(tiny(config_class, **overrides)).eval()
    save(tmp_path, model, default_engine.tokenizer)
    expected = [reference_greedy(model, p) for p in PROMPTS]
    config = EngineConfig(
        model=tmp_path,
        cache=CacheConfig(block_size=16, num_blocks=64),
        scheduler=SchedulerConfig(long_prefill_token_threshold=8),
    )
    with Engine(config) as engine:
        gens = engine.generate(PROMPTS, SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True))
        assert [g.token_ids for g in gens] == expected
        engine.check_integrity()
