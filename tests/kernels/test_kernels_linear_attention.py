"""The linear-attention and MoE reference kernels against naive float64 loops, on awkward sizes
(1, 15, 63, 300 tokens; odd head dims; grouped value heads), and chunked against recurrent."""

import pytest
import torch
import torch.nn.functional as F

from agentx.kernels import ref

SIZES = [1, 15, 63, 300]
# (num_k_heads, num_v_heads, head_k_dim, head_v_dim)
HEADS = [(1, 1, 16, 16), (2, 6, 12, 20), (3, 3, 100, 7)]


def naive_gated_delta_rule(q, k, v, g, beta, state, scale):
    """The per-token, per-head definition in float64: (B, T, H*, D) -> (B, T, H, Dv), state."""
    b, t, hv, dv = v.shape
    group = hv // k.shape[2]
    state = state.double().clone()
    out = torch.zeros(b, t, hv, dv, dtype=torch.float64)
    for n in range(b):
        for h in range(hv):
            s = state[n, h]
            for i in range(t):
                qi, ki = q[n, i, h // group].double(), k[n, i, h // group].double()
                s = s * torch.exp(g[n, i, h].double())
                s = s + torch.outer(ki, beta[n, i, h].double() * (v[n, i, h].double() - ki @ s))
                out[n, i, h] = scale * (qi @ s)
            state[n, h] = s
    return out, state


def inputs(num_tokens, heads, batch=1, seed=0):
    hk, hv, dk, dv = heads
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(batch, num_tokens, hk, dk, generator=gen), dim=-1)
    k = F.normalize(torch.randn(batch, num_tokens, hk, dk, generator=gen), dim=-1)
    v = torch.randn(batch, num_tokens, hv, dv, generator=gen)
    g = -torch.rand(batch, num_tokens, hv, generator=gen) * 0.5  # log decay in (-0.5, 0]
    beta = torch.rand(batch, num_tokens, hv, generator=gen)
    state = torch.randn(batch, hv, dk, dv, generator=gen) * 0.3
    return q, k, v, g, beta, state


@pytest.mark.parametrize("num_tokens", SIZES)
@pytest.mark.parametrize("heads", HEADS)
def test_gated_delta_rule_forms_match_naive(num_tokens, heads):
    q, k, v, g, beta, state = inputs(num_tokens, heads)
    scale = heads[2] ** -0.5
    if num_tokens > 63 and heads[2] == 100:
        pytest.skip("the float64 loop is too slow at this size; chunked vs recurrent below")
    expected, expected_state = naive_gated_delta_rule(q, k, v, g, beta, state, scale)
    for form in (ref.gated_delta_rule_recurrent, ref.gated_delta_rule_chunked):
        out, final = form(q, k, v, g, beta, state, scale)
        assert out.shape == v.shape and out.dtype == v.dtype
        torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(final.double(), expected_state, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("num_tokens", SIZES)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("chunk_size", [1, 16, 64])
def test_chunked_matches_recurrent_batched(num_tokens, heads, chunk_size):
    q, k, v, g, beta, state = inputs(num_tokens, heads, batch=2, seed=1)
    scale = heads[2] ** -0.5
    out_r, state_r = ref.gated_delta_rule_recurrent(q, k, v, g, beta, state, scale)
    out_c, state_c = ref.gated_delta_rule_chunked(q, k, v, g, beta, state, scale, chunk_size)
    torch.testing.assert_close(out_c, out_r, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(state_c, state_r, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("cut", [1, 15, 64, 299])
def test_gated_delta_rule_continues_from_a_cut(cut):
    """Running [0, cut) then [cut, T) from the carried state equals one run; no state is zeros."""
    q, k, v, g, beta, _ = inputs(300, (2, 4, 12, 20))
    args = (q, k, v, g, beta)
    whole, whole_state = ref.gated_delta_rule_chunked(*args, None, 0.3)
    first, mid = ref.gated_delta_rule_chunked(*(x[:, :cut] for x in args), None, 0.3)
    second, final = ref.gated_delta_rule_chunked(*(x[:, cut:] for x in args), mid, 0.3)
    torch.testing.assert_close(torch.cat((first, second), dim=1), whole, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(final, whole_state, atol=2e-5, rtol=2e-5)


def naive_conv(x, weight, state):
    """float64 loop: out[t, c] = silu(sum_j w[c, j] * window[c, t + j])."""
    b, t, c = x.shape
    kernel = weight.shape[1]
    window = torch.cat((state.double(), x.double().transpose(1, 2)), dim=-1)  # (B, C, K-1+T)
    out = torch.zeros(b, t, c, dtype=torch.float64)
    for i in range(t):
        out[:, i] = (window[:, :, i : i + kernel] * weight.double()).sum(-1)
    return F.silu(out), window[:, :, -(kernel - 1) :]


@pytest.mark.parametrize("num_tokens", SIZES)
@pytest.mark.parametrize("channels, kernel", [(1, 2), (37, 4), (160, 3)])
def test_causal_conv1d_matches_naive_and_continues(num_tokens, channels, kernel):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, num_tokens, channels, generator=gen)
    weight = torch.randn(channels, kernel, generator=gen)
    state = torch.randn(2, channels, kernel - 1, generator=gen)
    out, final = ref.causal_conv1d(x, weight, state)
    expected, expected_state = naive_conv(x, weight, state)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final.double(), expected_state)
    fresh, _ = ref.causal_conv1d(x, weight, None)
    torch.testing.assert_close(fresh, ref.causal_conv1d(x, weight, torch.zeros_like(state))[0])
    # token by token from the carried state (what decode steps do)
    steps, carried = [], state
    for i in range(num_tokens):
        y, carried = ref.causal_conv1d(x[:, i : i + 1], weight, carried)
        steps.append(y)
    torch.testing.assert_close(torch.cat(steps, dim=1), out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(carried, final)


@pytest.mark.parametrize("num_tokens", SIZES)
@pytest.mark.parametrize("top_k, renormalize", [(1, False), (2, True), (3, False)])
def test_moe_experts_match_dense_loop(num_tokens, top_k, renormalize):
    gen = torch.Generator().manual_seed(3)
    num_experts, dim, inter = 5, 24, 13
    x = torch.randn(num_tokens, dim, generator=gen)
    w13 = torch.randn(num_experts, 2 * inter, dim, generator=gen) * 0.2
    w2 = torch.randn(num_experts, dim, inter, generator=gen) * 0.2
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    weights, ids = ref.topk_softmax(logits, top_k, renormalize)
    probs = logits.double().softmax(-1)
    expected = torch.zeros(num_tokens, dim, dtype=torch.float64)
    for t in range(num_tokens):
        chosen = probs[t].argsort(descending=True)[:top_k]
        total = probs[t, chosen].sum() if renormalize else 1.0
        for e in chosen.tolist():
            gate, up = (w13[e].double() @ x[t].double()).chunk(2)
            expected[t] += probs[t, e] / total * (w2[e].double() @ (F.silu(gate) * up))
    out = ref.moe_experts(x, w13, w2, weights, ids)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_rms_norm_gated():
    gen = torch.Generator().manual_seed(4)
    x, gate = torch.randn(15, 20, generator=gen), torch.randn(15, 20, generator=gen)
    weight = torch.randn(20, generator=gen)
    xd = x.double()
    expected = (
        xd / (xd.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * weight * F.silu(gate.double())
    )
    torch.testing.assert_close(ref.rms_norm_gated(x, gate, weight, 1e-6).double(), expected)
