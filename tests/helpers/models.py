"""Builders shared by the model tests: a tiny Llama spec, tiny random transformers checkpoints
saved as Hugging Face folders, and the text corpus the tokenizer tests encode."""

from pathlib import Path

import tokenizers
import torch
import transformers

from agentx.engine.models.spec import ModelSpec

# Text every tokenizer must round-trip: punctuation, code, numbers, accents, emoji, CJK,
# runs of spaces and newlines, a leading space. Each tokenizer test adds its own special cases.
TOKENIZER_CORPUS = [
    "Hello, world! This is a test of the tokenizer.",
    "I'm sure they'll say it's fine, don't you think? We've SEEN it.",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "\tif (x) {\n\t\treturn y;\n\t}\n\t\t\n",
    "Numbers: 12345, 3.14159, -42, 1,000,000 and 2024-01-31 at 09:30.",
    "café naïve résumé Ångström ß Ω ∑ ∞ ≠ →",
    "emoji 😀👍🏽🇺🇸 ❤️ and CJK 你好，世界！日本語のテキスト 한국어",
    "multiple   spaces\n\n\nand newlines   \n  trailing  ",
    " leading space",
]


# --- tiny Llama-family models ------------------------------------------------------------------

# One layer, 2 query heads sharing 1 KV head of 8 dims, a 32-token vocabulary, tied head.
TINY_LLAMA_SPEC = ModelSpec(
    architecture="llama",
    vocab_size=32,
    hidden_size=16,
    intermediate_size=24,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=8,
    rms_norm_eps=1e-6,
    rope_theta=10_000.0,
    max_position=64,
    tie_word_embeddings=True,
)


def tiny_hf_config(config_class: type, **overrides: object) -> object:
    """A 2-layer, 64-wide config (4 heads, 2 KV heads) with SmolLM2's vocabulary and ids."""
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
        **overrides,
    )


def save_hf_folder(folder: Path, model: torch.nn.Module, tokenizer, **save_kwargs: object) -> None:
    """Save ``model`` with an agentx ``tokenizer`` (its backend, BOS/EOS and chat template)."""
    model.save_pretrained(folder, **save_kwargs)
    hf_tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer.backend,
        bos_token=tokenizer.bos_token,
        eos_token=tokenizer.eos_token,
    )
    hf_tokenizer.chat_template = tokenizer.chat_template
    hf_tokenizer.save_pretrained(folder)


# --- a tiny Qwen3-Next (linear-attention hybrid, MoE) ---------------------------------------------

QWEN3_NEXT_VOCAB = 384


def tiny_qwen3_next(num_experts_per_tok: int = 2) -> transformers.Qwen3NextForCausalLM:
    """5 layers (linear, full, linear, linear, full), MoE (6 experts) with a shared expert,
    layer 2 dense."""
    config = transformers.Qwen3NextConfig(
        vocab_size=QWEN3_NEXT_VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=24,
        linear_num_key_heads=2,
        linear_num_value_heads=6,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_experts=6,
        num_experts_per_tok=num_experts_per_tok,
        mlp_only_layers=[2],
        max_position_embeddings=512,
        layer_types=[
            "linear_attention",
            "full_attention",
            "linear_attention",
            "linear_attention",
            "full_attention",
        ],
        rms_norm_eps=1e-6,
        initializer_range=0.15,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3NextForCausalLM(config).eval()
    with torch.no_grad():  # norms start at 0 (or 1): give every weight a value to get wrong
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", "dt_bias")):
                param.add_(torch.randn_like(param) * 0.3)
    return model


def save_qwen3_next_folder(folder: Path, model: transformers.Qwen3NextForCausalLM) -> None:
    """Save ``model`` with a word-level tokenizer over its vocabulary ("t0" .. "t383")."""
    model.save_pretrained(folder)
    vocab = {f"t{i}": i for i in range(QWEN3_NEXT_VOCAB)}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    hf_tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="t1", eos_token="t2"
    )
    hf_tokenizer.save_pretrained(folder)


def random_tokens(n: int, seed: int) -> list[int]:
    """n token ids in [3, QWEN3_NEXT_VOCAB), past the special ids, reproducible by seed."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, QWEN3_NEXT_VOCAB, (n,), generator=generator).tolist()
