"""Parity of two different arithmetics, judged by closeness (as vLLM's ``check_logprobs_close``).

Two runs of the same prompts agree when their greedy tokens are equal, or when, at the first
position where they differ, each side's token is in the other side's top ``TOP`` and the gap
between the two tokens' logprobs is at most ``tolerance`` nats on both sides: a near-tie that
another float order may break either way. Nothing after the first difference is compared (the
two continuations have different contexts from there). Same-arithmetic comparisons (batching,
chunking, prefix hits, preemption) stay exact and do not use this.

The prompt set is fixed (code and prose, ten prompts); tests state how many must match exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

from agentx import SamplingParams
from agentx.engine.streams import Generation

TOP = 5
# The largest logprob gap (nats) between two runs' tokens at their first difference that counts
# as a near-tie. With int8 activations (the quantized kernels, every rank's), another float
# order flips an activation's rounding now and then, and the flips add up over 30 layers: at
# one rank the fused layer and the same layer op by op already differ by up to 0.15 nats in a
# first token's logprob, and the first differences of tp / dcp / pcp / tp x dcp against world
# size 1 on the prompts below had gaps up to 0.35 (AMD Zen 3, 2026-12-03). Quantized weights
# against transformers' fp32 on the same GGUF: up to 0.43. Each tolerance is that, with room
# for another ISA's float order; a wrong layer or a wrong position moves logprobs by whole nats.
FLOAT_ORDER_TOLERANCE = 0.5
QUANTIZED_TOLERANCE = 0.75

PARITY_PROMPTS = (
    "def binary_search(items, target):\n",
    "import os\nimport sys\n\n\ndef main():\n",
    "class Stack:\n    def __init__(self):\n",
    "# Read a CSV file and print the sum of the second column\n",
    "for i in range(10):\n    if i % 2 == 0:\n",
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "To make a cup of tea, first",
    "Water boils at a temperature of",
)


def parity_sampling(max_tokens: int = 24) -> SamplingParams:
    """Greedy, a fixed length, and the top-``TOP`` logprobs the comparison needs."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=TOP)


@dataclass(frozen=True, slots=True)
class Divergence:
    """Where two runs of one prompt first differ, and each side's logprob gap there."""

    prompt_index: int
    position: int
    token_a: int
    token_b: int
    gap_a: float | None  # a's logprob of its token minus of b's (None: b's not in a's top)
    gap_b: float | None

    def is_near_tie(self, tolerance: float) -> bool:
        gaps = (self.gap_a, self.gap_b)
        return all(g is not None and g <= tolerance for g in gaps)


def _gap(gen: Generation, position: int, other_token: int) -> float | None:
    record = gen.logprobs[position]
    top = dict(record.top)
    if other_token not in top:
        return None
    return record.logprob - top[other_token]


def find_divergences(a: list[Generation], b: list[Generation]) -> list[Divergence]:
    """Every prompt whose greedy tokens differ, at its first difference."""
    found = []
    for index, (ga, gb) in enumerate(zip(a, b, strict=True)):
        assert ga.logprobs is not None and gb.logprobs is not None, "run with parity_sampling()"
        for pos, (ta, tb) in enumerate(zip(ga.token_ids, gb.token_ids, strict=False)):
            if ta != tb:
                found.append(Divergence(index, pos, ta, tb, _gap(ga, pos, tb), _gap(gb, pos, ta)))
                break
        else:
            assert len(ga.token_ids) == len(gb.token_ids), f"prompt {index}: lengths differ"
    return found


def check_logprobs_close(
    a: list[Generation],
    b: list[Generation],
    *,
    min_exact: int,
    tolerance: float = FLOAT_ORDER_TOLERANCE,
    names: tuple[str, str] = ("a", "b"),
) -> list[Divergence]:
    """Assert the runs agree by the closeness rule, and that at least ``min_exact`` prompts
    match token for token; returns the divergences (near-ties) for the caller to report."""
    divergences = find_divergences(a, b)
    far = [d for d in divergences if not d.is_near_tie(tolerance)]
    assert not far, f"{names[0]} vs {names[1]}: not near-ties (tolerance {tolerance}): {far}"
    num_exact = len(a) - len(divergences)
    assert num_exact >= min_exact, (
        f"{names[0]} vs {names[1]}: {num_exact} of {len(a)} exact, want >= {min_exact}: "
        f"{divergences}"
    )
    return divergences


def check_close_cached_and_preempted(
    one, many, prompts: list[list[int]], *, min_exact: int, names: tuple[str, str]
) -> list[Divergence]:
    """``many`` (another arithmetic, e.g. world size > 1) is close to ``one`` on ``prompts``
    (run together into a pool that cannot hold them at once: preemption); then, the same
    arithmetic, ``many`` again (the shared prefix from its prefix cache) gives its own tokens
    and logprobs exactly."""
    sampling = parity_sampling()
    want = one.generate(prompts, sampling)
    before = many.stats().num_preemptions
    got = many.generate(prompts, sampling)
    assert many.stats().num_preemptions > before, "the pool held every prompt: no preemption"
    divergences = check_logprobs_close(want, got, min_exact=min_exact, names=names)
    again = many.generate(prompts, sampling)
    assert_same_run(again, got)
    assert max(g.usage.cached_tokens for g in again) >= 64
    assert many.stats().kv_num_used_blocks == 0
    many.check_integrity()
    return divergences


@dataclass(frozen=True, slots=True)
class ReferenceRun:
    """A reference implementation's greedy run, shaped like a Generation for the comparison."""

    token_ids: list[int]
    logprobs: list


def transformers_greedy(model, prompts: list[list[int]], max_tokens: int) -> list[ReferenceRun]:
    """Greedy tokens and top-``TOP`` logprobs from a transformers causal LM (fp32, KV cache)."""
    import torch

    from agentx.engine.outputs import TokenLogprob

    runs = []
    with torch.inference_mode():
        for prompt in prompts:
            res = model(torch.tensor([prompt]), use_cache=True)
            tokens, records = [], []
            for _ in range(max_tokens):
                lp = torch.log_softmax(res.logits[0, -1].float(), dim=-1)
                top = lp.topk(TOP)
                token = int(top.indices[0])
                pairs = tuple(zip(top.indices.tolist(), top.values.tolist(), strict=True))
                records.append(TokenLogprob(token, float(top.values[0]), 1, pairs))
                tokens.append(token)
                res = model(torch.tensor([[token]]), past_key_values=res.past_key_values)
            runs.append(ReferenceRun(tokens, records))
    return runs


def assert_same_run(a, b, atol: float = 1e-4) -> None:
    """Two runs of one arithmetic in other batch shapes (batched, chunked, from the prefix
    cache, preempted): the same tokens, and logprobs bit for bit where the kernels promise a
    row the same bits in any batch (the compiled CPU kernels); the PyTorch reference kernels
    (``AGENTX_KERNELS=ref``) run fp32 GEMMs whose rounding may follow the batch shape, so there
    within ``atol``."""

    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    for ga, gb in zip(a, b, strict=True):
        assert_same_records(ga.logprobs, gb.logprobs, atol)


def assert_same_records(a, b, atol: float = 1e-4) -> None:
    """Logprob records (or None entries) of one arithmetic: equal bit for bit with the compiled
    CPU kernels, within ``atol`` with the reference kernels (see ``assert_same_run``)."""
    from agentx import kernels

    if kernels.cpu_kernels_enabled():
        assert a == b
        return
    assert (a is None) == (b is None) and len(a or ()) == len(b or ())
    for ra, rb in zip(a or (), b or (), strict=True):
        assert (ra is None) == (rb is None)
        if ra is not None:
            assert ra.token_id == rb.token_id and abs(ra.logprob - rb.logprob) <= atol
