"""The reference kernels against naive dense formulas, on awkward sizes (1, 15, 63, 300 tokens;
head dim 100; GQA groups of 1 and 3) and shuffled block tables."""

import math

import pytest
import torch

from agentx.kernels import ref


def dense_attention(q, k, v, scale, window=None):
    """q (Tq, H, D) at the last Tq positions of k, v (Tk, Hkv, D); float64, causal (within the
    last ``window`` positions when given)."""
    tq, h, _ = q.shape
    tk, hkv, _ = k.shape
    k = k.repeat_interleave(h // hkv, dim=1).double()
    v = v.repeat_interleave(h // hkv, dim=1).double()
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    qpos = torch.arange(tk - tq, tk)[:, None]
    kpos = torch.arange(tk)[None, :]
    scores = scores.masked_fill(kpos > qpos, float("-inf"))
    if window is not None:
        scores = scores.masked_fill(kpos <= qpos - window, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("head_dim, num_heads, num_kv_heads", [(64, 9, 3), (100, 4, 4)])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("window", [None, 1, 17, 64])
def test_paged_attention_matches_dense(head_dim, num_heads, num_kv_heads, block_size, window):
    gen = torch.Generator().manual_seed(0)
    # (cached context, new tokens) per request: decodes, a cold prefill, chunks over a context
    shapes = [(0, 1), (14, 1), (0, 15), (48, 15), (0, 63), (237, 63), (0, 300), (299, 1)]
    max_blocks = max(-(-(c + n) // block_size) for c, n in shapes)
    num_blocks = 1 + max_blocks * len(shapes)
    kv_cache = torch.zeros(num_blocks, 2, block_size, num_kv_heads, head_dim)
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # block 0 is null
    block_tables = torch.zeros(len(shapes), max_blocks, dtype=torch.long)
    qs, full_k, full_v, slots, qsl, seq_lens = [], [], [], [], [0], []
    for i, (ctx, new) in enumerate(shapes):
        total = ctx + new
        ids = [perm.pop() for _ in range(-(-total // block_size))]
        block_tables[i, : len(ids)] = torch.tensor(ids)
        k = torch.randn(total, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(total, num_kv_heads, head_dim, generator=gen)
        full_k.append(k)
        full_v.append(v)
        pos = torch.arange(total)
        all_slots = torch.tensor(ids)[pos // block_size] * block_size + pos % block_size
        ref.write_kv(k[:ctx], v[:ctx], kv_cache, all_slots[:ctx])  # an earlier step
        slots.append(all_slots[ctx:])
        qs.append(torch.randn(new, num_heads, head_dim, generator=gen))
        qsl.append(qsl[-1] + new)
        seq_lens.append(total)
    q = torch.cat(qs)
    new_k = torch.cat([k[c:] for k, (c, _) in zip(full_k, shapes, strict=True)])
    new_v = torch.cat([v[c:] for v, (c, _) in zip(full_v, shapes, strict=True)])
    ref.write_kv(new_k, new_v, kv_cache, torch.cat(slots))
    decode_ids = [i for i, (_, n) in enumerate(shapes) if n == 1]
    prefill_ids = [i for i, (_, n) in enumerate(shapes) if n != 1]
    scale = 1 / math.sqrt(head_dim)
    out = ref.paged_attention(
        q,
        kv_cache,
        qsl,
        seq_lens,
        block_tables,
        torch.tensor(decode_ids),
        prefill_ids,
        scale,
        sliding_window=window,
    )
    for i in range(len(shapes)):
        expected = dense_attention(qs[i], full_k[i], full_v[i], scale, window)
        torch.testing.assert_close(
            out[qsl[i] : qsl[i + 1]].double(), expected, atol=1e-5, rtol=1e-5
        )


def test_write_kv_places_tokens_in_their_slots():
    cache = torch.zeros(3, 2, 4, 1, 2)  # (num_blocks, K/V, block_size, Hkv, D)
    k = torch.arange(6.0).view(3, 1, 2)
    ref.write_kv(k, -k, cache, torch.tensor([5, 6, 11]))  # block 1 offsets 1, 2; block 2 offset 3
    assert cache[1, 0, 1, 0].tolist() == [0.0, 1.0]
    assert cache[1, 0, 2, 0].tolist() == [2.0, 3.0]
    assert cache[2, 1, 3, 0].tolist() == [-4.0, -5.0]
    assert cache[0].abs().sum() == 0


def test_rms_norm_glu_and_rotary_match_formulas():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(15, 100, generator=gen)
    w = torch.randn(100, generator=gen)
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    torch.testing.assert_close(ref.rms_norm(x, w, 1e-6), expected)
    gate_up = torch.randn(15, 2 * 100, generator=gen)
    g, u = gate_up[:, :100], gate_up[:, 100:]
    torch.testing.assert_close(ref.silu_and_mul(gate_up), g * torch.sigmoid(g) * u)
    c = math.sqrt(2 / math.pi)
    gelu_tanh = 0.5 * g * (1 + torch.tanh(c * (g + 0.044715 * g**3)))
    torch.testing.assert_close(ref.gelu_tanh_and_mul(gate_up), gelu_tanh * u)
    # rotary as a complex rotation of (x_i, x_{i+D/2}) pairs by angle pos * theta^(-2i/D)
    d, positions = 64, torch.tensor([0, 1, 7, 300])
    inv_freq = 1.0 / 10000 ** (torch.arange(0, d, 2).double() / d)
    angles = positions[:, None].double() * inv_freq  # (T, D/2)
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1).float()
    q = torch.randn(4, 3, d, generator=gen)
    z = torch.complex(q[..., : d // 2].double(), q[..., d // 2 :].double())
    rotated = z * torch.polar(torch.ones_like(angles), angles)[:, None, :]
    expected = torch.cat((rotated.real, rotated.imag), dim=-1).float()
    torch.testing.assert_close(ref.apply_rotary(q, cos_sin), expected, atol=1e-5, rtol=1e-5)
