"""The Triton kernels against the PyTorch references: CPU under ``TRITON_INTERPRET=1``, or CUDA.

Not collected on its own (no ``test_`` prefix): ``tests/kernels/test_kernels_triton.py`` runs it in
a
child pytest with ``TRITON_INTERPRET=1`` set, since the interpreter is chosen when Triton and
each kernel are first imported and must not leak into other tests; ``benchmarks/gpu/check.sh``
runs it on a GPU in bfloat16 with ``TRITON_TEST_DEVICE=cuda``.

The interpreter runs each program in NumPy, so sizes stay small; they are still awkward:
partial blocks, one long request beside many short ones, GQA ratios 1/3/8, sliding windows,
head dims 64/80/128, split-KV. fp32 and fp16 on CPU (bfloat16 is broken in the interpreter).
"""

from __future__ import annotations

import os

import pytest
import torch

from agentx.errors import ConfigError
from agentx.kernels import ref

DEVICE = "cuda" if os.environ.get("TRITON_TEST_DEVICE") == "cuda" else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("run with TRITON_INTERPRET=1 (tests/kernels/test_kernels_triton.py does)")
DTYPES = [torch.bfloat16] if DEVICE == "cuda" else [torch.float32, torch.float16]
TOL = {torch.float32: 2e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}


def _patch_interpreter() -> None:
    """triton 3.6's interpreter turns a scalar into int() of a 1-element array, which NumPy
    >= 2.4 refuses; take the element instead (later triton versions do the same)."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch_lang_tensor


if DEVICE == "cpu":
    _patch_interpreter()

from agentx.kernels import triton as tk  # noqa: E402


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOL[dtype]
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=tol, rtol=tol)


def randn(*shape, dtype=torch.float32, gen=None) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(DEVICE, dtype)


def paged_case(shapes, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0):
    """Requests of (cached context, new tokens) with shuffled blocks; the new K/V written."""
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-(c + n) // block_size) for c, n in shapes)
    num_blocks = 1 + max_blocks * len(shapes)
    kv_cache = torch.zeros(num_blocks, 2, block_size, num_kv_heads, head_dim, dtype=dtype)
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # block 0 is null
    block_tables = torch.zeros(len(shapes), max_blocks, dtype=torch.long)
    slots, qsl, seq_lens = [], [0], []
    for i, (ctx, new) in enumerate(shapes):
        total = ctx + new
        ids = [perm.pop() for _ in range(-(-total // block_size))]
        block_tables[i, : len(ids)] = torch.tensor(ids)
        pos = torch.arange(total)
        slots.append(torch.tensor(ids)[pos // block_size] * block_size + pos % block_size)
        qsl.append(qsl[-1] + new)
        seq_lens.append(total)
    all_slots = torch.cat(slots)
    k = torch.randn(len(all_slots), num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(len(all_slots), num_kv_heads, head_dim, generator=gen).to(dtype)
    ref.write_kv(k, v, kv_cache, all_slots)
    q = torch.randn(qsl[-1], num_heads, head_dim, generator=gen).to(dtype)
    decode_ids = torch.tensor([i for i, (_, n) in enumerate(shapes) if n == 1], dtype=torch.long)
    prefill_ids = [i for i, (_, n) in enumerate(shapes) if n != 1]
    args = (qsl, seq_lens, block_tables, decode_ids, prefill_ids)
    return q, kv_cache, args


# one long request beside many short ones; decodes, a cold prefill, chunks over a context
MIXED = [(0, 1), (5, 1), (0, 7), (21, 9), (90, 1), (2, 1), (0, 3), (150, 20)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "num_heads, num_kv_heads, head_dim, block_size, window",
    [(2, 2, 64, 16, None), (6, 2, 80, 16, 17), (8, 1, 128, 32, None), (3, 1, 64, 16, 40)],
)
def test_paged_attention_matches_ref(num_heads, num_kv_heads, head_dim, block_size, window, dtype):
    q, kv_cache, args = paged_case(MIXED, num_heads, num_kv_heads, head_dim, block_size, dtype)
    scale = head_dim**-0.5
    expected, expected_lse = ref.paged_attention_with_lse(
        q, kv_cache, *args, scale, sliding_window=window
    )
    dev = [a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args]
    out, lse = tk.paged_attention_with_lse(
        q.to(DEVICE), kv_cache.to(DEVICE), *dev, scale, sliding_window=window
    )
    close(out, expected, dtype)
    close(lse, expected_lse, torch.float32 if dtype == torch.float32 else dtype)
    # the reference the engine runs agrees too (its own test checks it against dense math)
    close(out, ref.paged_attention(q, kv_cache, *args, scale, sliding_window=window), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits, window", [(3, None), (4, 33)])
def test_split_kv_merges_to_the_same_rows(num_splits, window, dtype):
    """Split-KV over a long decode and a chunk, from device-side layout tensors (what a CUDA
    graph replays): the same output and LSE as one pass."""
    shapes = [(200, 1), (3, 1), (120, 6)]
    q, kv_cache, args = paged_case(shapes, 6, 2, 64, 16, dtype, seed=1)
    expected, expected_lse = ref.paged_attention_with_lse(
        q, kv_cache, *args, 0.125, sliding_window=window
    )
    qsl, seq_lens, block_tables = args[:3]
    out, lse = tk.paged_attention_with_lse(
        q.to(DEVICE),
        kv_cache.to(DEVICE),
        torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables.to(DEVICE),
        scale=0.125,
        sliding_window=window,
        max_query_len=6,
        num_splits=num_splits,
        block_n=16,
    )
    close(out, expected, dtype)
    close(lse, expected_lse, torch.float32 if dtype == torch.float32 else dtype)


def test_device_layout_needs_max_query_len():
    q, kv_cache, args = paged_case([(3, 1)], 2, 2, 64, 16, torch.float32)
    cu_q = torch.tensor(args[0], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor(args[1], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ConfigError, match="max_query_len"):
        tk.paged_attention_with_lse(q.to(DEVICE), kv_cache.to(DEVICE), cu_q, lens, args[2])


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_matches_ref_and_skips_negative_slots(dtype):
    gen = torch.Generator().manual_seed(2)
    cache = torch.randn(5, 2, 16, 3, 80, generator=gen).to(dtype)
    k = torch.randn(7, 3, 80, generator=gen).to(dtype)
    v = torch.randn(7, 3, 80, generator=gen).to(dtype)
    slots = torch.tensor([17, 18, 79, 0, 33, -1, 40])
    expected = cache.clone()
    ref.write_kv(k[slots >= 0], v[slots >= 0], expected, slots[slots >= 0])
    actual = cache.to(DEVICE)
    tk.write_kv(k.to(DEVICE), v.to(DEVICE), actual, slots.to(DEVICE))
    assert torch.equal(actual.cpu(), expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (5, 3, 80), (3, 128)])
def test_norms_match_ref(shape, dtype):
    gen = torch.Generator().manual_seed(3)
    x, residual, gate = (randn(*shape, dtype=dtype, gen=gen) for _ in range(3))
    weight = randn(shape[-1], dtype=dtype, gen=gen)
    rx, rr, rg, rw = (t.cpu() for t in (x, residual, gate, weight))
    close(tk.rms_norm(x, weight, 1e-6), ref.rms_norm(rx, rw, 1e-6), dtype)
    # a float32 weight over low-precision rows (Gemma's 1 + w): promoted like the reference
    w32 = weight.float()
    assert tk.rms_norm(x, w32, 1e-6).dtype == ref.rms_norm(rx, w32.cpu(), 1e-6).dtype
    close(tk.rms_norm(x, w32, 1e-6), ref.rms_norm(rx, w32.cpu(), 1e-6), dtype)
    normed, summed = tk.fused_add_rms_norm(x, residual, weight, 1e-6)
    ref_normed, ref_summed = ref.fused_add_rms_norm(rx, rr, rw, 1e-6)
    close(summed, ref_summed, dtype)
    close(normed, ref_normed, dtype)
    close(tk.rms_norm_gated(x, gate, weight, 1e-6), ref.rms_norm_gated(rx, rg, rw, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_activations_and_rotary_match_ref(dtype):
    gen = torch.Generator().manual_seed(4)
    x = randn(2, 3, 2 * 1500, dtype=dtype, gen=gen)  # more than one column block
    close(tk.silu_and_mul(x), ref.silu_and_mul(x.cpu()), dtype)
    close(tk.gelu_tanh_and_mul(x), ref.gelu_tanh_and_mul(x.cpu()), dtype)
    for heads, dim in [(3, 64), (5, 80), (1, 128)]:
        q = randn(6, heads, dim, dtype=dtype, gen=gen)
        cos_sin = randn(6, dim, gen=gen)
        close(tk.apply_rotary(q, cos_sin), ref.apply_rotary(q.cpu(), cos_sin.cpu()), dtype)
    # a strided view (q of a fused qkv row), as the attention layer passes it
    qkv = randn(6, 4, 3 * 64, dtype=dtype, gen=gen)
    cos_sin = randn(6, 64, gen=gen)
    view = qkv[..., 64:128]
    close(tk.apply_rotary(view, cos_sin), ref.apply_rotary(view.cpu(), cos_sin.cpu()), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens, with_state", [(1, True), (2, False), (21, True)])
def test_causal_conv1d_matches_ref(num_tokens, with_state, dtype):
    gen = torch.Generator().manual_seed(5)
    x = randn(2, num_tokens, 70, dtype=dtype, gen=gen)
    weight, bias = randn(70, 4, dtype=dtype, gen=gen), randn(70, dtype=dtype, gen=gen)
    state = randn(2, 70, 3, dtype=dtype, gen=gen) if with_state else None
    out, new_state = tk.causal_conv1d(x, weight, state, bias)
    cpu_state = state.cpu() if state is not None else None
    ref_out, ref_state = ref.causal_conv1d(x.cpu(), weight.cpu(), cpu_state, bias.cpu())
    close(out, ref_out, dtype)
    assert torch.equal(new_state.cpu(), ref_state)
    out, _ = tk.causal_conv1d(x, weight, state, None, silu=False)
    close(out, ref.causal_conv1d(x.cpu(), weight.cpu(), cpu_state, None, silu=False)[0], dtype)


def delta_inputs(batch, num_tokens, num_k_heads, num_heads, dk, dv, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    q = randn(batch, num_tokens, num_k_heads, dk, dtype=dtype, gen=gen)
    k = torch.nn.functional.normalize(randn(batch, num_tokens, num_k_heads, dk, gen=gen), dim=-1)
    v = randn(batch, num_tokens, num_heads, dv, dtype=dtype, gen=gen)
    g = -torch.rand(batch, num_tokens, num_heads, generator=gen).to(DEVICE) * 0.5
    beta = torch.rand(batch, num_tokens, num_heads, generator=gen).to(DEVICE, dtype)
    state = randn(batch, num_heads, dk, dv, gen=gen)
    return q, k.to(dtype), v, g.to(dtype), beta, state


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "num_tokens, num_k_heads, num_heads, dk, dv, chunk_size, with_state",
    [(21, 1, 3, 32, 40, 16, True), (5, 2, 2, 64, 32, 16, False), (3, 1, 1, 16, 16, 32, True)],
)
def test_gated_delta_rule_matches_ref(
    num_tokens, num_k_heads, num_heads, dk, dv, chunk_size, with_state, dtype
):
    inputs = delta_inputs(1, num_tokens, num_k_heads, num_heads, dk, dv, dtype, seed=6)
    q, k, v, g, beta, state = inputs
    state = state if with_state else None
    cpu = [t.cpu() if t is not None else None for t in (q, k, v, g, beta, state)]
    ref_out, ref_state = ref.gated_delta_rule_recurrent(*cpu, 0.3)
    out, final = tk.gated_delta_rule_recurrent(q, k, v, g, beta, state, 0.3)
    assert out.dtype == v.dtype and final.dtype == torch.float32
    close(out, ref_out, dtype)
    close(final, ref_state, dtype)
    out, final = tk.gated_delta_rule_chunked(q, k, v, g, beta, state, 0.3, chunk_size)
    ref_out, ref_state = ref.gated_delta_rule_chunked(*cpu, 0.3, chunk_size)
    close(out, ref_out, dtype)
    close(final, ref_state, dtype)


def test_delta_rule_continues_across_calls():
    """Chunked prefill of a prefix, then recurrent decode steps: the same as one pass."""
    q, k, v, g, beta, state = delta_inputs(2, 18, 1, 1, 16, 32, torch.float32, seed=7)
    whole, whole_state = tk.gated_delta_rule_chunked(q, k, v, g, beta, state, 0.5, 16)
    head, mid = tk.gated_delta_rule_chunked(
        q[:, :17], k[:, :17], v[:, :17], g[:, :17], beta[:, :17], state, 0.5, 16
    )
    tail, end = tk.gated_delta_rule_recurrent(
        q[:, 17:], k[:, 17:], v[:, 17:], g[:, 17:], beta[:, 17:], mid, 0.5
    )
    close(torch.cat((head, tail), dim=1), whole, torch.float32)
    close(end, whole_state, torch.float32)


def test_chunk_size_must_be_a_power_of_two():
    q, k, v, g, beta, state = delta_inputs(1, 3, 1, 1, 16, 16, torch.float32, seed=8)
    with pytest.raises(ConfigError, match="chunk_size"):
        tk.gated_delta_rule_chunked(q, k, v, g, beta, state, 1.0, 24)


def test_dispatch_sends_every_triton_op_to_triton():
    """The child pytest runs with ``AGENTX_KERNELS=triton``: the dispatch's ops are Triton's,
    and the compiled CPU kernels stay off."""
    from agentx import kernels

    assert kernels.BACKEND == "triton" and kernels.triton_enabled()
    assert not kernels.cpu_kernels_enabled()
    for name in tk.__all__:
        if name != "paged_attention":  # a function of the dispatch (it also routes cpu caches)
            assert getattr(kernels, name) is getattr(tk, name), name


def small_llama():
    import dataclasses

    from agentx.engine.models.llama import LlamaForCausalLM
    from agentx.engine.parallel import SINGLE
    from tests.helpers.models import TINY_LLAMA_SPEC

    spec = dataclasses.replace(
        TINY_LLAMA_SPEC, vocab_size=384, hidden_size=96, intermediate_size=64, num_layers=2,
        num_heads=3, num_kv_heads=1, head_dim=32, max_position=256,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(spec, SINGLE)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else torch.randn_like(p) * 0.2)
    return model.eval()


def test_llama_through_the_dispatch_matches_the_reference(monkeypatch):
    """A small GQA Llama, prefill then decodes, batched: Triton's logits are the reference's,
    and greedy picks the same tokens."""
    if DEVICE == "cuda":
        pytest.skip("the paged harness keeps its caches on CPU; engine_gpu.py runs the engine")
    from agentx import kernels
    from tests.helpers.models import random_tokens
    from tests.helpers.paged_harness import Harness, Seq

    model = small_llama()
    prompts = [random_tokens(19, seed=1), random_tokens(4, seed=2)]

    def run() -> list[torch.Tensor]:
        harness, seqs = Harness(model), [Seq(), Seq()]
        rows = harness.step([(s, p, ()) for s, p in zip(seqs, prompts, strict=True)])
        for _ in range(2):  # decodes, one token each, batched
            last = zip(seqs, rows[-2:], strict=True)
            rows += harness.step([(s, [int(r[-1].argmax())], ()) for s, r in last])
        return [r.float() for r in rows]

    got = run()
    assert not kernels.cpu_kernels_enabled()
    for name in tk.__all__:
        monkeypatch.setattr(kernels, name, getattr(ref, name))
    expected = run()
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_decode_graph_buffers_give_the_eager_logits():
    """What a decode CUDA graph runs (runner/cuda_graph.py), run eagerly on the interpreter:
    the persistent buffers, device-side layout and padded rows give the step's own logits."""
    if DEVICE == "cuda":
        pytest.skip("the paged harness keeps its caches on CPU; engine_gpu.py captures graphs")
    from agentx.engine.models.forward_context import AttentionMetadata
    from agentx.engine.runner.cuda_graph import DecodeGraphs
    from agentx.engine.runner.input_batch import BatchInputs
    from tests.helpers.models import random_tokens
    from tests.helpers.paged_harness import BLOCK_SIZE, Harness, Seq

    model = small_llama()
    harness = Harness(model)
    seqs = [Seq(), Seq(), Seq()]
    prompts = [random_tokens(15, seed=3), random_tokens(4, seed=4), random_tokens(16, seed=5)]
    rows = harness.step([(s, p, ()) for s, p in zip(seqs, prompts, strict=True)])
    tokens = [int(r[-1].argmax()) for r in rows]
    # the eager step allocates blocks (two cross a block boundary) and writes the new KV; the
    # graph's buffers then write the same values to the same slots and read the same context
    step = [(s, [t], ()) for s, t in zip(seqs, tokens, strict=True)]
    eager = torch.stack([r[0] for r in harness.step(step)])
    positions = [len(s.tokens) - 1 for s in seqs]
    slots = [
        s.blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
        for s, p in zip(seqs, positions, strict=True)
    ]
    tables = torch.zeros(3, max(len(s.blocks) for s in seqs), dtype=torch.long)
    for i, s in enumerate(seqs):
        tables[i, : len(s.blocks)] = torch.tensor(s.blocks)
    seq_lens = [p + 1 for p in positions]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=[0, 1, 2, 3], seq_lens=seq_lens,
        block_tables=tables, decode_ids=torch.arange(3), prefill_ids=[],
    )  # fmt: skip
    batch = BatchInputs(
        input_ids=torch.tensor(tokens), positions=torch.tensor(positions), attn=(meta,),
        linear=(None,), logits_indices=torch.arange(3), sample_rows=[0, 1, 2],
    )  # fmt: skip
    graphs = DecodeGraphs(
        model,
        harness.kv_caches,
        (0,) * model.spec.num_layers,
        1,
        8,
        256,
        (2, 4),
        torch.device("cpu"),
    )
    with torch.inference_mode():
        size = graphs.stage(batch, seq_lens)
        assert size == 4  # three requests ride in the 4-row graph: one padding row
        assert graphs.slot_mapping[0, 3] == -1 and graphs.seq_lens[3] == 1
        logits = graphs.forward(size)[:3]
    torch.testing.assert_close(logits, eager.float(), atol=1e-4, rtol=1e-4)
    assert torch.equal(logits.argmax(-1), eager.argmax(-1))
