"""Hugging Face folders through the whole engine: tiny random Llama (untied head, Llama 3 RoPE
scaling) and Qwen2 (qkv bias, tied head) checkpoints give the transformers greedy tokens."""

import pytest
import torch
import transformers

from agentx import CacheConfig, Engine, EngineConfig, SamplingParams, SchedulerConfig
from tests.helpers.models import save_hf_folder, tiny_hf_config
from tests.helpers.parity import check_logprobs_close, parity_sampling, transformers_greedy

pytestmark = pytest.mark.slow

PROMPTS = [[1, 504, 3575, 282, 4649, 314], [17, 29, 30, 31] * 9, list(range(200, 261))]
NUM_TOKENS = 24


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
    # wide logits (initializer_range 0.5): no near-ties for fp32 rounding to flip
    hf_config = tiny_hf_config(config_class, initializer_range=0.5, **overrides)
    model = model_class(hf_config).eval()
    save_hf_folder(tmp_path, model, default_engine.tokenizer)
    expected = transformers_greedy(model, PROMPTS, NUM_TOKENS)
    config = EngineConfig(
        model=tmp_path,
        cache=CacheConfig(block_size=16, num_blocks=64),
        scheduler=SchedulerConfig(long_prefill_token_threshold=8),
    )
    with Engine(config) as engine:
        gens = engine.generate(PROMPTS, parity_sampling(NUM_TOKENS))
        # fp32 both, another float order: the parity rule (measured 3 of 3 exact)
        check_logprobs_close(gens, expected, min_exact=2, names=("agentx", "transformers"))
        engine.check_integrity()


@pytest.mark.parametrize("mode,bits", [("int8", 8), ("int4", 4)])
def test_float_checkpoint_quantized_on_request(tmp_path, default_engine, mode, bits):
    """A float checkpoint with ``quantization="int8" | "int4"``: every linear layer is packed,
    and greedy output with chunked prefill and batching equals each prompt run alone."""
    from agentx.engine.models.layers import QuantizableLinear

    torch.manual_seed(0)
    hf_config = tiny_hf_config(transformers.LlamaConfig, initializer_range=0.5)
    model = transformers.LlamaForCausalLM(hf_config).eval()
    save_hf_folder(tmp_path, model, default_engine.tokenizer)
    config = EngineConfig(
        model=tmp_path,
        quantization=mode,
        cache=CacheConfig(block_size=16, num_blocks=64),
        scheduler=SchedulerConfig(long_prefill_token_threshold=8),
    )
    greedy = SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True)
    with Engine(config) as engine:
        linears = [
            m for m in engine.core.runner.model.modules() if isinstance(m, QuantizableLinear)
        ]
        assert len(linears) == 2 * 4 + 1  # qkv, o, gate_up, down per layer; the head
        assert all(m.bits == bits and not hasattr(m, "weight") for m in linears)
        alone = [engine.generate([p], greedy)[0].token_ids for p in PROMPTS]
        batched = engine.generate(PROMPTS, greedy)
        assert [g.token_ids for g in batched] == alone
        engine.check_integrity()
