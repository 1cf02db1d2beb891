"""Gemma 3 270M (sliding-window + global layers) from its GGUF package: the spec, weights and
tokenizer equal transformers', and the engine's greedy tokens are close to transformers' by the
parity rule (tests/helpers/parity.py), alone, batched and with chunked prefill, on prompts both
shorter
and longer than the window."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers  # a dev dependency: the reference

from agentx import CacheConfig, Engine, EngineConfig, SamplingParams, SchedulerConfig
from agentx.engine.models.gemma3 import Gemma3Config
from agentx.engine.models.loader import gemma3_270m_path
from agentx.engine.models.loader.gguf import load_gguf
from agentx.engine.outputs import TokenLogprob
from tests.helpers.models import TOKENIZER_CORPUS
from tests.helpers.parity import TOP, ReferenceRun, check_logprobs_close

pytestmark = pytest.mark.slow

NUM_TOKENS = 64
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=TOP)
WINDOW = 512


def _facts(n: int) -> str:
    lines = ["Here is a numbered list of facts about numbers.\n"]
    lines += [
        f"Fact {i}: the square of {i} is {i * i}, and {i} plus seven is {i + 7}.\n"
        for i in range(1, n + 1)
    ]
    return "".join(lines) + "Now repeat Fact 12 exactly.\nFact 12:"


def _code(n: int) -> str:
    parts = ["# A small library of helper functions.\n\n"]
    parts += [
        f"def scale_{i}(values: list[float]) -> list[float]:\n"
        f'    """Multiply every value by {i}."""\n'
        f"    return [v * {i} for v in values]\n\n"
        for i in range(n)
    ]
    return "".join(parts) + "def main():\n    data = [1.0, 2.0, 3.0]\n"


# Code and prose, two of them 3x the window long.
PROMPTS = [
    "def fibonacci(n):\n",
    "import numpy as np\n\n",
    "The quick brown fox",
    _facts(55),
    _code(40),
]
CORPUS = [
    *TOKENIZER_CORPUS,
    "                                        forty spaces",
    "",
    "<start_of_turn>user\nhi<end_of_turn>\n<table><tr>x</tr></table> <bos>",
    "a\u2581b \u2581\u2581x \x00\x01 zero\u200bwidth",
    "x = {'a': [1, 2, 3], \"b\": None}  # comment\r\nwindows line\r\n",
    _code(3),
]


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    # session scope: joined once into the real cache, before a module's private AGENTX_CACHE_DIR
    return gemma3_270m_path()


@pytest.fixture(scope="module")
def hf_tokenizer(gemma3_path: Path):
    return transformers.AutoTokenizer.from_pretrained(
        gemma3_path.parent, gguf_file=gemma3_path.name
    )


@pytest.fixture(scope="module")
def hf_model(gemma3_path: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        gemma3_path.parent, gguf_file=gemma3_path.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def reference(hf_model, hf_tokenizer) -> list[tuple[list[int], list[int]]]:
    """(prompt ids with BOS, 64 greedy tokens) per prompt, from transformers with its KV cache."""
    out = []
    with torch.inference_mode():
        for text in PROMPTS:
            prompt = hf_tokenizer(text)["input_ids"]
            res = hf_model(torch.tensor([prompt]), use_cache=True, logits_to_keep=1)
            tokens, records = [], []
            for _ in range(NUM_TOKENS):
                lp = torch.log_softmax(res.logits[0, -1].float(), dim=-1)
                top = lp.topk(TOP)
                tokens.append(int(top.indices[0]))
                pairs = tuple(zip(top.indices.tolist(), top.values.tolist(), strict=True))
                records.append(TokenLogprob(tokens[-1], float(top.values[0]), 1, pairs))
                res = hf_model(torch.tensor([tokens[-1:]]), cache=res.cache, use_cache=True)
            out.append((prompt, ReferenceRun(tokens, records)))
    return out


@pytest.fixture(scope="module")
def engine(gemma3_path: Path, cache_dir: Path):
    # fp32 math throughout (quantization "none"): the transformers reference is fp32
    config = EngineConfig(
        model=gemma3_path,
        dtype="float32",
        quantization="none",
        cache=CacheConfig(kv_cache_bytes=256 << 20),
    )
    with Engine(config) as engine:
        yield engine


def _check(gens, reference) -> None:
    """Close to transformers by the parity rule (tests/helpers/parity.py): fp32 both, another float
    order; measured 5 of 5 exact (AMD Zen 3), 4 required."""
    assert [g.prompt_token_ids for g in gens] == [prompt for prompt, _ in reference]
    runs = [run for _, run in reference]
    check_logprobs_close(gens, runs, min_exact=4, names=("agentx fp32", "transformers fp32"))


def test_packaged_path_is_assembled_once(gemma3_path: Path) -> None:
    assert gemma3_path.read_bytes()[:4] == b"GGUF"
    mtime = gemma3_path.stat().st_mtime_ns
    assert gemma3_270m_path() == gemma3_path
    assert gemma3_path.stat().st_mtime_ns == mtime


def test_checkpoint_equals_transformers(gemma3_path: Path, hf_model, cache_dir: Path) -> None:
    checkpoint = load_gguf(gemma3_path)
    spec, config = checkpoint.spec, hf_model.config
    assert spec.architecture == "gemma3"
    assert spec.layer_types == tuple(config.layer_types)
    assert [i for i, t in enumerate(spec.layer_types) if t == "full_attention"] == [5, 11, 17]
    assert spec.sliding_window == config.sliding_window == WINDOW
    assert spec.rope_theta == config.rope_parameters["full_attention"]["rope_theta"] == 1e6
    assert spec.arch_config == Gemma3Config(
        query_pre_attn_scalar=config.query_pre_attn_scalar,
        local_rope_theta=config.rope_parameters["sliding_attention"]["rope_theta"],
    )
    assert (spec.num_layers, spec.head_dim, spec.tie_word_embeddings) == (18, 256, True)
    assert spec.add_bos_token
    assert (spec.bos_token_id, spec.eos_token_ids) == (2, (1,))

    expected = hf_model.state_dict()
    assert set(checkpoint.weights) == set(expected) - {"lm_head.weight"}  # tied
    for name, tensor in checkpoint.weights.items():
        assert torch.equal(tensor, expected[name]), name


@pytest.mark.parametrize("text", CORPUS)
def test_tokenizer_equals_transformers(engine: Engine, hf_tokenizer, text: str) -> None:
    ours = engine.tokenizer
    ids = ours.encode(text)
    assert ids == hf_tokenizer.encode(text, add_special_tokens=False)
    assert ours.encode(text, add_special_tokens=True) == hf_tokenizer.encode(text)
    assert ours.decode(ids) == hf_tokenizer.decode(ids)


def test_prompt_gets_bos(engine: Engine) -> None:
    (gen,) = engine.generate("Hello", SamplingParams(max_tokens=1))
    assert gen.prompt_token_ids[0] == engine.tokenizer.bos_token_id == 2


def test_greedy_matches_transformers(engine: Engine, reference) -> None:
    assert max(len(prompt) for prompt, _ in reference) > 3 * WINDOW
    _check([engine.generate(text, GREEDY)[0] for text in PROMPTS], reference)
    engine.check_integrity()


def test_batched_chunked_prefill_matches_transformers(make_engine, cache_dir, reference) -> None:
    # A 100-token budget: the long prompts are prefilled in chunks that straddle blocks and the
    # window's edge, in the same steps as the other prompts' decodes.
    engine = make_engine(
        model=gemma3_270m_path(),
        quantization="none",
        scheduler=SchedulerConfig(max_num_batched_tokens=100),
    )
    _check(engine.generate(PROMPTS, GREEDY), reference)
    engine.check_integrity()
    assert engine.stats().kv_num_used_blocks == 0


def test_layout_is_hybrid(engine: Engine) -> None:
    """3 global + 15 sliding layers -> 6 groups of 3 layers sharing 3 memory slots."""
    layout = engine.core.runner.layout
    kinds = [type(g.spec).__name__ for g in layout.groups]
    assert kinds.count("FullAttentionSpec") == 1 and kinds.count("SlidingWindowSpec") == 5
    full = next(g for g in layout.groups if type(g.spec).__name__ == "FullAttentionSpec")
    assert full.layer_ids == (5, 11, 17)
    assert layout.num_slots == 3
    assert all(g.spec.sliding_window == WINDOW for g in layout.groups if g is not full)


@pytest.mark.parametrize("quantization", ["none", "auto"])
def test_ten_turns_and_forks_hit_the_cache_and_match_cold(make_engine, quantization) -> None:
    # "auto" keeps the GGUF's Q8_0 matrices quantized (int8 activations): a token's logits
    # must still not depend on whether its prefix came from the cache
    engine = make_engine(model=gemma3_270m_path(), quantization=quantization)
    cold = make_engine(
        model=gemma3_270m_path(),
        quantization=quantization,
        cache=CacheConfig(enable_prefix_caching=False),
    )
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    tok = engine.tokenizer
    prompt = tok.encode(_code(40))[:600]  # longer than the window: hits need only its tail
    assert len(prompt) == 600
    for turn in range(10):
        (gen,) = engine.generate([prompt], params)
        (ref,) = cold.generate([prompt], params)
        assert gen.token_ids == ref.token_ids, f"turn {turn}"
        if turn:
            assert gen.usage.cached_tokens >= len(prompt) - 40, f"turn {turn}: {gen.usage}"
        prompt = prompt + gen.token_ids + tok.encode(f" step {turn} of the loop")[1:]
    stream = engine.add_request(prompt, params, hold_kv=True)
    parent = stream.result(timeout=300)
    handles = engine.fork_held(stream.request_id, 2)
    base = prompt + parent.token_ids
    children = [base + tok.encode(s)[1:] for s in (" and then", " but also")]
    for child, handle in zip(children, handles, strict=True):
        gen = engine.add_request(child, params, held_kv=handle).result(timeout=300)
        assert gen.usage.cached_tokens == len(base) - 1
        assert gen.token_ids == cold.generate([child], params)[0].token_ids
    engine.release_held(stream.request_id)
    engine.check_integrity()
