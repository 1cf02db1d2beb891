"""Qwen3-Next against transformers: a tiny random checkpoint (Gated DeltaNet and gated attention
layers, MoE with a shared expert, one dense MLP layer) saved as a Hugging Face folder, loaded
through agentx's safetensors loader, and run with paged KV and paged linear state built by
tests/helpers/paged_harness.py (the runner builds them for real): prefill, chunked prefill with save
points, forks from a checkpoint, decode steps, mixed flat batches, greedy generation."""

import copy

import pytest
import torch

from agentx.engine.models.loader.safetensors import load_hf_folder, read_hf_spec
from agentx.engine.models.qwen3_next import Qwen3NextConfig
from agentx.engine.models.registry import get_model_class
from agentx.engine.parallel import ParallelState
from agentx.errors import ModelLoadError
from tests.helpers.models import random_tokens, save_qwen3_next_folder, tiny_qwen3_next
from tests.helpers.paged_harness import Harness, Seq

ATOL = 2e-4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(transformers model, agentx model) on the same weights."""
    hf = tiny_qwen3_next()
    folder = tmp_path_factory.mktemp("qwen3-next")
    save_qwen3_next_folder(folder, hf)
    checkpoint = load_hf_folder(folder)
    model = get_model_class(checkpoint.spec.architecture)(checkpoint.spec, ParallelState())
    model.load_weights(checkpoint.weights)
    return hf, model.eval()


def hf_logits(hf, token_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([token_ids])).logits[0]  # (T, vocab)


def test_spec_from_config(models):
    _, model = models
    spec = model.spec
    assert spec.architecture == "qwen3_next"
    assert spec.layer_types == (
        "linear_attention",
        "full_attention",
        "linear_attention",
        "linear_attention",
        "full_attention",
    )
    assert spec.arch_config == Qwen3NextConfig(
        linear_num_key_heads=2,
        linear_num_value_heads=6,
        linear_key_head_dim=16,
        linear_value_head_dim=24,
        linear_conv_kernel_dim=4,
        partial_rotary_factor=0.25,
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        norm_topk_prob=True,
        mlp_only_layers=(2,),
    )
    # conv over [q | k | v]: 2 * 2 * 16 + 6 * 24 channels, 3 carried inputs
    assert model.get_linear_state_shapes() == ((208, 3), (6, 16, 24))
    assert model.linear_state_dtype == torch.float32


@pytest.mark.parametrize("num_tokens", [1, 15, 63, 150])
def test_prefill_logits(models, num_tokens):
    hf, model = models
    ids = random_tokens(num_tokens, seed=num_tokens)
    (logits,) = Harness(model).step([(Seq(), ids, ())])
    torch.testing.assert_close(logits, hf_logits(hf, ids), atol=ATOL, rtol=ATOL)


def test_chunked_prefill_with_save_points_and_fork(models):
    hf, model = models
    ids = random_tokens(100, seed=7)
    harness = Harness(model)
    seq = Seq()
    chunks = [(13, ()), (1, ()), (35, (2, 18)), (1, ()), (50, (14, 30))]  # saves at 16, 32, 64, 80
    out, at = [], 0
    for size, saves in chunks:
        (logits,) = harness.step([(seq, ids[at : at + size], saves)])
        out.append(logits)
        at += size
    expected = hf_logits(hf, ids)
    torch.testing.assert_close(torch.cat(out), expected, atol=ATOL, rtol=ATOL)
    (one_shot,) = Harness(model).step([(Seq(), ids, ())])
    torch.testing.assert_close(torch.cat(out), one_shot, atol=ATOL, rtol=ATOL)
    assert sorted(seq.checkpoints) == [16, 32, 64, 80]
    # every checkpoint resumes: a fork continues with other tokens from there
    for at in sorted(seq.checkpoints):
        fork = harness.fork(seq, at)
        tail = random_tokens(9, seed=at)
        (logits,) = harness.step([(fork, tail, ())])
        torch.testing.assert_close(
            logits, hf_logits(hf, ids[:at] + tail)[at:], atol=ATOL, rtol=ATOL
        )


def test_decode_steps_after_prefill(models):
    hf, model = models
    harness = Harness(model)
    seq = Seq()
    ids = random_tokens(37, seed=3)
    (logits,) = harness.step([(seq, ids, ())])
    for _ in range(6):
        ids = ids + [int(logits[-1].argmax())]
        (logits,) = harness.step([(seq, ids[-1:], ())])
        torch.testing.assert_close(logits[0], hf_logits(hf, ids)[-1], atol=ATOL, rtol=ATOL)


def test_mixed_batch(models):
    """Decodes, a fresh prefill, a continued chunk with save points and a fork, in one batch."""
    hf, model = models
    harness = Harness(model)
    a, b, c = Seq(), Seq(), Seq()
    pa, pb, pc, pd = (
        random_tokens(n, seed) for n, seed in ((31, 11), (33, 12), (70, 13), (15, 14))
    )
    harness.step([(a, pa, ()), (b, pb, (16, 32)), (c, pc[:40], ())])
    d = harness.fork(b, 32)
    work = [
        (a, [5], (1,)),  # a decode that also checkpoints its block boundary (32)
        (b, [6], ()),
        (c, pc[40:], (8, 24)),  # saves at 48 and 64
        (Seq(), pd, ()),
        (d, [7, 8, 9], ()),
    ]
    la, lb, lc, ld, lfork = harness.step(work)
    torch.testing.assert_close(la, hf_logits(hf, pa + [5])[-1:], atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(lb, hf_logits(hf, pb + [6])[-1:], atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(lc, hf_logits(hf, pc)[40:], atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(ld, hf_logits(hf, pd), atol=ATOL, rtol=ATOL)
    expected = hf_logits(hf, pb[:32] + [7, 8, 9])[32:]
    torch.testing.assert_close(lfork, expected, atol=ATOL, rtol=ATOL)
    # c's checkpoint at 64 resumes
    (resumed,) = harness.step([(harness.fork(c, 64), [10, 11], ())])
    torch.testing.assert_close(
        resumed, hf_logits(hf, pc[:64] + [10, 11])[64:], atol=ATOL, rtol=ATOL
    )


def test_greedy_generation_matches_transformers(models):
    hf, model = models
    prompts = [random_tokens(5, 21), random_tokens(47, 22), random_tokens(16, 23)]
    num_new = 32
    expected = []
    with torch.inference_mode():
        for p in prompts:
            out = hf.generate(
                torch.tensor([p]), max_new_tokens=num_new, do_sample=False, min_new_tokens=num_new
            )
            expected.append(out[0, len(p) :].tolist())
    harness = Harness(model)
    seqs = [Seq() for _ in prompts]
    last = harness.step([(s, p, ()) for s, p in zip(seqs, prompts, strict=True)])
    generated = [[] for _ in prompts]
    for _ in range(num_new):
        next_ids = [int(logits[-1].argmax()) for logits in last]
        for tokens, token in zip(generated, next_ids, strict=True):
            tokens.append(token)
        last = harness.step([(s, [t], ()) for s, t in zip(seqs, next_ids, strict=True)])
    assert generated == expected


def test_load_stacked_experts_and_skip_mtp(models):
    """transformers' in-memory stacked expert tensors load too; mtp.* tensors are ignored."""
    hf, model = models
    weights = {name: t.detach().clone() for name, t in hf.state_dict().items()}
    weights["mtp.fc.weight"] = torch.zeros(3, 3)
    twin = get_model_class("qwen3_next")(model.spec, ParallelState())
    twin.load_weights(weights)
    for (name, ours), (_, theirs) in zip(
        model.named_parameters(), twin.named_parameters(), strict=True
    ):
        assert torch.equal(ours, theirs), name


def test_load_rejects_missing_and_unknown_tensors(models):
    hf, model = models
    weights = dict(hf.state_dict())
    twin = get_model_class("qwen3_next")(model.spec, ParallelState())
    with pytest.raises(ModelLoadError, match="lacks"):
        twin.load_weights({k: v for k, v in weights.items() if not k.endswith("A_log")})
    with pytest.raises(ModelLoadError, match="bogus"):
        twin.load_weights({**weights, "model.layers.0.linear_attn.bogus.weight": torch.zeros(1)})


def test_spec_from_an_older_config_json():
    """Qwen3-Next-80B's config.json: no layer_types (full_attention_interval), partial rotary
    factor and rope_theta at the top level."""
    config = {
        "architectures": ["Qwen3NextForCausalLM"],
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 5120,
        "num_hidden_layers": 8,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000000,
        "rope_scaling": None,
        "partial_rotary_factor": 0.25,
        "full_attention_interval": 4,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "num_experts": 512,
        "num_experts_per_tok": 10,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "tie_word_embeddings": False,
    }
    spec = read_hf_spec(config)
    assert spec.architecture == "qwen3_next"
    assert spec.layer_types == ("linear_attention",) * 3 + ("full_attention",) + (
        "linear_attention",
    ) * 3 + ("full_attention",)
    assert spec.rope_theta == 1e7 and spec.head_dim == 256 and spec.rope_scaling is None
    assert spec.arch_config.partial_rotary_factor == 0.25
    assert spec.arch_config.linear_num_value_heads == 32
    assert spec.arch_config.num_experts_per_tok == 10


def test_bf16_runs_with_fp32_states(models):
    """bf16 weights and activations, fp32 state pages: prefill with save points and a decode
    stray from the fp32 logits no more than transformers in bf16 does (routing flips included)."""
    hf, model = models
    low = get_model_class("qwen3_next")(model.spec, ParallelState(), torch.bfloat16)
    low.load_weights({k: v.to(torch.bfloat16) for k, v in hf.state_dict().items()})
    harness = Harness(low)
    seq = Seq()
    ids = random_tokens(40, 31)
    (logits,) = harness.step([(seq, ids, (16, 32))])
    (step,) = harness.step([(seq, [9], ())])
    ours = torch.cat((logits, step))
    assert ours.dtype == torch.float32 and ours.isfinite().all()
    reference = hf_logits(hf, ids + [9])
    hf_bf16 = hf_logits(copy.deepcopy(hf).to(torch.bfloat16), ids + [9]).float()
    drift, hf_drift = ((x - reference).abs().mean() for x in (ours, hf_bf16))
    assert drift < 1.5 * hf_drift
