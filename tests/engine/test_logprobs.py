"""Logprobs: the raw log-softmax of the logits the sampler saw, for generated and prompt tokens.

Every generated token's record is checked against a reference log-softmax of the very logits
the runner produced for it (captured from the runner), greedy and sampled, alone and batched;
prompt logprobs of a sequence equal the generation logprobs of the same tokens bit for bit (the
kernels give a row the same bits in a prefill chunk as in a decode step).
"""

import pytest
import torch

from agentx import CacheConfig, SamplingParams, SchedulerConfig, SpeculativeConfig, kernels
from agentx.engine.runner.logprobs import token_logprobs
from agentx.errors import SamplingParamsError
from tests.helpers.parity import assert_same_records

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "List three primary colors:\n1."]
NO_DRAFTS = SpeculativeConfig(enabled=False)


@pytest.fixture(scope="module")
def engine(make_engine_module):
    engine = make_engine_module(speculative=NO_DRAFTS)
    engine.wait_ready()  # its warm-up forwards are not the tests' logits
    return engine


class LogitsTap:
    """Records every logits tensor the runner returns (one row per sampling request alone)."""

    def __init__(self, runner) -> None:
        self.runner, self.rows = runner, []
        self._inner = runner._logits

    def __enter__(self):
        def tapped(hidden):
            logits = self._inner(hidden)
            self.rows.append(logits.detach().clone())
            return logits

        self.runner._logits = tapped
        return self

    def __exit__(self, *exc):
        del self.runner._logits  # the class's method again


def reference(logits_row: torch.Tensor, token_id: int, k: int):
    lp = torch.log_softmax(logits_row.float(), dim=-1)
    value = lp[token_id]
    rank = int((lp > value).sum()) + 1
    top = lp.topk(k)
    return float(value), rank, top.indices.tolist(), top.values.tolist()


def test_token_logprobs_equal_log_softmax_on_awkward_rows():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 301, generator=gen) * 4
    logits[2, 7] = logits[2, 9] = 50.0  # a tie at the top
    lp = torch.log_softmax(logits, dim=-1)
    targets = [0, 300, 9, 17, 150]
    records = token_logprobs(lp, targets, [3, 0, 2, 20, 1])
    for row, record in enumerate(records):
        value, rank, ids, values = reference(logits[row], targets[row], len(record.top) or 1)
        assert record.token_id == targets[row]
        assert record.logprob == value and record.rank == rank
        if record.top:
            assert [t for t, _ in record.top] == ids and [v for _, v in record.top] == values
    assert records[1].top == () and len(records[3].top) == 20
    assert records[2].rank == 1  # tied for the top: no token is strictly more likely


def test_greedy_logprobs_equal_reference_of_the_runner_logits(engine):
    tok = engine.tokenizer
    with LogitsTap(engine.core.runner) as tap:
        gen = engine.generate(PROMPTS[0], SamplingParams(max_tokens=6, logprobs=5))[0]
    assert len(tap.rows) == len(gen.token_ids) == len(gen.logprobs) == 6
    for step, (token_id, record) in enumerate(zip(gen.token_ids, gen.logprobs, strict=True)):
        value, rank, ids, values = reference(tap.rows[step][0], token_id, 5)
        assert (record.token_id, record.logprob, record.rank) == (token_id, value, rank)
        assert rank == 1 and [t for t, _ in record.top] == ids
        assert [v for _, v in record.top] == values
    assert tok.decode(gen.token_ids) == gen.text


def test_sampled_logprobs_are_raw_not_tempered(engine):
    sampling = SamplingParams(max_tokens=8, temperature=1.5, top_k=50, seed=7, logprobs=2)
    with LogitsTap(engine.core.runner) as tap:
        gen = engine.generate(PROMPTS[1], sampling)[0]
    for step, (token_id, record) in enumerate(zip(gen.token_ids, gen.logprobs, strict=True)):
        value, rank, ids, _ = reference(tap.rows[step][0], token_id, 2)
        assert (record.logprob, record.rank) == (value, rank)
        assert [t for t, _ in record.top] == ids
    assert any(r.rank > 1 for r in gen.logprobs)  # temperature 1.5 left the argmax sometimes


def test_batched_logprobs_equal_alone(engine):
    params = [
        SamplingParams(max_tokens=7, logprobs=3),
        SamplingParams(max_tokens=5, temperature=0.9, seed=3, logprobs=0),
        SamplingParams(max_tokens=6, logprobs=20),
    ]
    alone = [engine.generate(p, s)[0] for p, s in zip(PROMPTS, params, strict=True)]
    streams = [engine.add_request(p, s) for p, s in zip(PROMPTS, params, strict=True)]
    batched = [s.result(timeout=60) for s in streams]
    for a, b in zip(alone, batched, strict=True):
        assert a.token_ids == b.token_ids
        assert_same_records(a.logprobs, b.logprobs)  # the same bits alone and in a batch
    assert all(r.top == () for r in batched[1].logprobs)
    assert all(len(r.top) == 20 for r in batched[2].logprobs)


def test_prompt_logprobs_equal_generation_logprobs(engine):
    gen = engine.generate(PROMPTS[0], SamplingParams(max_tokens=6, logprobs=4))[0]
    sequence = gen.prompt_token_ids + gen.token_ids
    # the same sequence again as a prompt: cached by now, but prompt logprobs take no hit
    scored = engine.generate([sequence], SamplingParams(max_tokens=1, prompt_logprobs=4))[0]
    assert scored.usage.cached_tokens == 0
    assert len(scored.prompt_logprobs) == len(sequence) and scored.prompt_logprobs[0] is None
    assert [r.token_id for r in scored.prompt_logprobs[1:]] == sequence[1:]
    assert_same_records(scored.prompt_logprobs[len(gen.prompt_token_ids) :], gen.logprobs)
    assert scored.logprobs is None  # not asked


def test_prompt_logprobs_across_chunks_equal_one_chunk(make_engine):
    one = make_engine(speculative=NO_DRAFTS)
    chunked = make_engine(
        speculative=NO_DRAFTS,
        cache=CacheConfig(kv_cache_bytes=256 << 20),
        scheduler=SchedulerConfig(max_num_batched_tokens=16, long_prefill_token_threshold=7),
    )
    text = "Once upon a time, in a small village by the sea, there lived an old fisherman who"
    sampling = SamplingParams(max_tokens=3, prompt_logprobs=2, logprobs=2)
    a = one.generate(text, sampling)[0]
    b = chunked.generate(text, sampling)[0]
    assert len(a.prompt_token_ids) > 16
    assert_same_records(a.prompt_logprobs, b.prompt_logprobs)
    assert_same_records(a.logprobs, b.logprobs)
    assert a.token_ids == b.token_ids
    chunked.check_integrity()


def test_constrained_logprobs_name_the_appended_tokens(engine):
    from agentx.engine.structured import StructuredOutput

    sampling = SamplingParams(
        max_tokens=8, logprobs=3, structured=StructuredOutput(choice=("red", "green", "blue"))
    )
    gen = engine.generate("My favourite colour is", sampling)[0]
    assert gen.text in ("red", "green", "blue")
    assert [r.token_id for r in gen.logprobs] == gen.token_ids
    assert all(r.logprob <= 0.0 and r.rank >= 1 for r in gen.logprobs)


def test_logprobs_off_cost_nothing_in_the_output(engine):
    gen = engine.generate(PROMPTS[2], SamplingParams(max_tokens=3))[0]
    assert gen.logprobs is None and gen.prompt_logprobs is None


@pytest.mark.parametrize("bad", [-1, 21, True, 2.0, "3"])
def test_bad_logprobs_are_refused(bad):
    with pytest.raises(SamplingParamsError, match="logprobs"):
        SamplingParams(logprobs=bad)
    with pytest.raises(SamplingParamsError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)


async def test_session_reply_carries_logprobs(engine):
    from agentx import Session

    async with Session(engine, sampling=SamplingParams(max_tokens=6, logprobs=2)) as s:
        reply = await s.send("Say hello.")
    assert reply.logprobs is not None and len(reply.logprobs) == reply.usage.output_tokens
    assert "logprobs" not in reply.model_dump()  # never sent back as history
    engine.check_integrity()


async def test_openai_chat_logprobs_shape(engine):
    from agentx.errors import InvalidRequestError
    from agentx.openai import ChatService

    service = ChatService(engine)
    body = {
        "messages": [{"role": "user", "content": "Name a colour."}],
        "max_tokens": 5,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    completion = await service.create(body)
    content = completion.choices[0].logprobs.content
    assert len(content) == completion.usage.completion_tokens
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob == e.logprob for e in content)
    assert all(bytes(e.bytes).decode("utf-8", "replace") == e.token for e in content)
    stream = await service.open_stream({**body, "stream": True})
    streamed = [
        e async for chunk in stream for c in chunk.choices if c.logprobs for e in c.logprobs.content
    ]
    assert [e.token for e in streamed] == [e.token for e in content]
    if kernels.cpu_kernels_enabled():  # the second run hit the first's cache: other chunks
        assert [e.logprob for e in streamed] == [e.logprob for e in content]
    plain = await service.create({k: v for k, v in body.items() if "logprobs" not in k})
    assert plain.choices[0].logprobs is None
    with pytest.raises(InvalidRequestError, match="top_logprobs"):
        await service.create({**body, "logprobs": False})
    with pytest.raises(InvalidRequestError, match="top_logprobs"):
        await service.create({**body, "top_logprobs": 21})
    service.close()
