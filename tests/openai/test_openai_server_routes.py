"""``agentx serve``'s other routes on the real default model, over loopback HTTP with the
official ``openai`` client and raw httpx2: completions, responses, metrics, tenants, a
client that disconnects, a huge request that must not freeze the server (issue 36.3)."""

import asyncio
import json
import time

import httpx2
import openai
import pytest

from agentx import SamplingParams, kernels
from agentx.openai import ChatService
from agentx.openai.serve_command import log_engine
from agentx.openai.server import ServerThread, create_app
from tests.helpers.idle import wait_idle
from tests.helpers.openai_api import ADD_TOOL, GREEDY, LONG

pytestmark = pytest.mark.slow

KEYS = ["key-a", "key-b"]
SYSTEM = "You are a terse assistant for the ACME support desk. " * 8  # several KV blocks
RESPONSES_TOOL = {
    "type": "function",
    "name": "add",
    "description": "Add two integers.",
    "parameters": ADD_TOOL["function"]["parameters"],
}


@pytest.fixture(scope="module")
def engine(make_engine_module):
    return make_engine_module()


@pytest.fixture(scope="module")
def server(engine):
    service = ChatService(engine)
    app = create_app(service, api_key=KEYS, max_request_bytes=16 << 20)
    with ServerThread(app) as running:
        running.service = service
        yield running
    assert wait_idle(engine).kv_num_held == 0
    engine.check_integrity()


def make_client(server, key=KEYS[0]):
    return openai.AsyncOpenAI(base_url=server.base_url, api_key=key, max_retries=0)


@pytest.fixture
async def client(server):
    client = make_client(server)
    yield client
    await client.close()


def headers(key=KEYS[0]):
    return {"authorization": f"Bearer {key}"}


# ---- /v1/completions -------------------------------------------------------------------------


async def test_completion_of_text_and_token_ids(engine, client):
    prompt = "The capital of France is"
    text = await client.completions.create(model="agentx", prompt=prompt, max_tokens=6, **_t0())
    ids = engine.tokenizer.encode(prompt, add_special_tokens=True)
    by_ids = await client.completions.create(model="agentx", prompt=ids, max_tokens=6, **_t0())
    assert text.object == "text_completion" and text.usage.completion_tokens == 6
    assert text.choices[0].text == by_ids.choices[0].text and text.choices[0].text
    assert text.choices[0].finish_reason == "length"
    batch = await client.completions.create(
        model="agentx", prompt=[prompt, "def fibonacci(n):"], max_tokens=4, **_t0()
    )
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == text.choices[0].text[: len(batch.choices[0].text)]


async def test_completion_echo_stop_and_stream(client):
    prompt = "List three primary colors:\n1."
    whole = await client.completions.create(
        model="agentx", prompt=prompt, max_tokens=12, echo=True, **_t0()
    )
    assert whole.choices[0].text.startswith(prompt)
    generated = whole.choices[0].text[len(prompt) :]
    stop = generated.strip()[:3]
    stopped = await client.completions.create(
        model="agentx", prompt=prompt, max_tokens=12, stop=[stop], **_t0()
    )
    assert stopped.choices[0].finish_reason == "stop" and stop not in stopped.choices[0].text
    stream = await client.completions.create(
        model="agentx",
        prompt=prompt,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
        **_t0(),
    )
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == generated
    assert chunks[-1].usage.completion_tokens == 12


async def test_completion_logprobs_with_and_without_echo(engine, client):
    prompt = "The capital of France is"
    ids = engine.tokenizer.encode(prompt, add_special_tokens=True)
    plain = await client.completions.create(
        model="agentx", prompt=prompt, max_tokens=5, logprobs=3, **_t0()
    )
    lp = plain.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == plain.usage.completion_tokens == 5
    assert "".join(lp.tokens) == plain.choices[0].text
    assert all(
        len(top) <= 3 and max(top.values()) == v
        for top, v in zip(lp.top_logprobs, lp.token_logprobs, strict=True)
    )  # noqa: E501
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    # the engine's own records, the same request
    mine = engine.generate([ids], SamplingParams(max_tokens=5, logprobs=3))[0]
    assert lp.tokens == [engine.tokenizer.decode([t]) for t in mine.token_ids]
    if kernels.cpu_kernels_enabled():  # the same bits (its prompt hit the first's cache)
        assert lp.token_logprobs == [r.logprob for r in mine.logprobs]
    else:  # the reference attention over a cached prefix runs other chunks: other roundings
        assert lp.token_logprobs == pytest.approx([r.logprob for r in mine.logprobs], abs=1e-4)
    echoed = await client.completions.create(
        model="agentx", prompt=prompt, max_tokens=5, logprobs=2, echo=True, **_t0()
    )
    elp = echoed.choices[0].logprobs
    assert len(elp.tokens) == len(ids) + 5 and elp.token_logprobs[0] is None
    assert elp.top_logprobs[0] is None and all(v <= 0 for v in elp.token_logprobs[1:])
    assert echoed.choices[0].text.startswith(prompt)
    stream = await client.completions.create(
        model="agentx", prompt=prompt, max_tokens=5, logprobs=1, echo=True, stream=True, **_t0()
    )
    streamed = [
        t
        for c in [c async for c in stream]
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.tokens
    ]  # noqa: E501
    assert len(streamed) == len(ids) + 5
    with pytest.raises(openai.BadRequestError, match="logprobs must be"):
        await client.completions.create(model="agentx", prompt=prompt, logprobs=6)


async def test_completion_refusals(client):
    with pytest.raises(openai.BadRequestError, match="fill-in-the-middle"):
        await client.completions.create(model="agentx", prompt="def f(", suffix="return 1")
    with pytest.raises(openai.BadRequestError, match="prompt must be"):
        await client.completions.create(model="agentx", prompt=[{"x": 1}])


# ---- /v1/responses ---------------------------------------------------------------------------


async def test_response_from_text_and_from_messages(client):
    reply = await client.responses.create(
        model="agentx",
        instructions="Answer in one short sentence.",
        input="What is 2+2?",
        max_output_tokens=10,
        temperature=0,
    )
    assert reply.object == "response" and reply.output[0].type == "message"
    assert reply.output_text and reply.usage.output_tokens <= 10
    messages = await client.responses.create(
        model="agentx",
        instructions="Answer in one short sentence.",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "What is 2+2?"}]}],
        max_output_tokens=10,
        temperature=0,
    )
    assert messages.output_text == reply.output_text


async def test_previous_response_id_continues_the_held_kv(client):
    first = await client.responses.create(
        model="agentx", input="Name a color.", max_output_tokens=8, temperature=0
    )
    second = await client.responses.create(
        model="agentx",
        input="Another one.",
        previous_response_id=first.id,
        max_output_tokens=8,
        temperature=0,
    )
    total = first.usage.input_tokens + first.usage.output_tokens
    # only the new message was computed: the held KV covers the first turn
    assert second.usage.input_tokens_details.cached_tokens == total - 1
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        await client.responses.create(model="agentx", input="x", previous_response_id="resp_nope")


async def test_response_tool_call_and_its_output(client):
    ask = "What is 17 plus 25?"
    call = await client.responses.create(
        model="agentx",
        input=ask,
        tools=[RESPONSES_TOOL],
        tool_choice="required",
        max_output_tokens=40,
        temperature=0,
    )
    [item] = [o for o in call.output if o.type == "function_call"]
    assert item.name == "add" and json.loads(item.arguments) == {"a": 17, "b": 25}
    answer = await client.responses.create(
        model="agentx",
        previous_response_id=call.id,
        input=[{"type": "function_call_output", "call_id": item.call_id, "output": "42"}],
        tools=[RESPONSES_TOOL],
        max_output_tokens=12,
        temperature=0,
    )
    assert answer.usage.input_tokens_details.cached_tokens > 0


async def test_streamed_response_events(client):
    stream = await client.responses.create(
        model="agentx", input="Name a fruit.", max_output_tokens=8, temperature=0, stream=True
    )
    events = [e async for e in stream]
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-1].response.output_text == text and text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    whole = await client.responses.create(
        model="agentx", input="Name a fruit.", max_output_tokens=8, temperature=0
    )
    assert whole.output_text == text


async def test_streamed_response_tool_call_arguments(client):
    stream = await client.responses.create(
        model="agentx",
        input="What is 17 plus 25?",
        tools=[RESPONSES_TOOL],
        tool_choice="required",
        max_output_tokens=40,
        temperature=0,
        stream=True,
    )
    events = [e async for e in stream]
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(deltas) > 1 and "".join(deltas) == done.arguments
    assert json.loads(done.arguments) == {"a": 17, "b": 25}


# ---- chat: parallel_tool_calls, tenants ------------------------------------------------------


async def test_parallel_tool_calls_false_gives_at_most_one_call(client):
    ask = [{"role": "user", "content": "Add 1 and 2. Then add 3 and 4. Then add 5 and 6."}]
    reply = await client.chat.completions.create(
        messages=ask,
        tools=[ADD_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=80,
        **GREEDY,
    )
    assert len(reply.choices[0].message.tool_calls) == 1


async def test_tenants_never_share_cached_prefixes(server):  # issue 36.5
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi."}]
    a, b = make_client(server, KEYS[0]), make_client(server, KEYS[1])
    try:
        first = await a.chat.completions.create(messages=messages, max_tokens=4, **GREEDY)
        other = await b.chat.completions.create(messages=messages, max_tokens=4, **GREEDY)
        again = await a.chat.completions.create(messages=messages, max_tokens=4, **GREEDY)
        assert other.usage.prompt_tokens_details.cached_tokens == 0
        assert again.usage.prompt_tokens_details.cached_tokens > 0
        # one key, two prompt_cache_keys: two tenants too
        keyed = {"prompt_cache_key": "user-1"}
        await a.chat.completions.create(messages=messages, max_tokens=4, extra_body=keyed, **GREEDY)
        keyed2 = {"prompt_cache_key": "user-2"}
        two = await a.chat.completions.create(
            messages=messages, max_tokens=4, extra_body=keyed2, **GREEDY
        )
        assert two.usage.prompt_tokens_details.cached_tokens == 0
        assert first.choices[0].message.content == other.choices[0].message.content
    finally:
        await a.close()
        await b.close()


async def test_a_tenant_cannot_continue_another_tenants_conversation(server):  # issue 36.5
    """Tenant b re-sends tenant a's whole conversation (a's reply included): a's held KV is
    not b's to continue, nor is any block of it. b is a fresh tenant (its key and a cache key
    sent nowhere else): any cached token it got would be a's."""
    system = "You are a careful assistant for the ZETA billing team. " * 8  # sent here only
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Hi."}]
    a, b = make_client(server, KEYS[0]), make_client(server, KEYS[1])
    try:
        first = await a.chat.completions.create(messages=messages, max_tokens=4, **GREEDY)
        reply = {"role": "assistant", "content": first.choices[0].message.content}
        history = [*messages, reply, {"role": "user", "content": "Thanks."}]
        theirs = await b.chat.completions.create(
            messages=history,
            max_tokens=4,
            extra_body={"prompt_cache_key": "issue-36.5"},
            **GREEDY,
        )
        ours = await a.chat.completions.create(messages=history, max_tokens=4, **GREEDY)
        assert theirs.usage.prompt_tokens_details.cached_tokens == 0
        assert ours.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
        assert theirs.choices[0].message.content == ours.choices[0].message.content
    finally:
        await a.close()
        await b.close()


# ---- the server itself -----------------------------------------------------------------------


async def test_metrics(server, client):
    await client.chat.completions.create(
        messages=[{"role": "user", "content": "Hi."}], max_tokens=4, **GREEDY
    )
    async with httpx2.AsyncClient() as http:
        text = (await http.get(server.base_url.removesuffix("/v1") + "/metrics")).text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    assert values["agentx_num_generated_tokens_total"] >= 4
    assert values["agentx_kv_num_blocks"] > 0
    cached = values["agentx_num_cached_tokens_total"]  # the old names still scrape the same
    assert values["agentx_prefix_cache_hit_tokens_total"] == cached
    assert values["agentx_num_reused_tokens_total"] == cached
    assert values['agentx_time_to_first_token_seconds_count{route="chat"}'] >= 1
    assert values['agentx_e2e_request_latency_seconds_count{route="chat"}'] >= 1
    assert values['agentx_inter_token_latency_seconds_count{route="chat"}'] >= 3


async def test_a_non_streamed_request_is_aborted_when_its_client_leaves(engine, server):
    wait_idle(engine)
    before = engine.stats().num_generated_tokens
    body = {"messages": LONG, "max_tokens": 400, **GREEDY}
    async with httpx2.AsyncClient(timeout=1.0) as http:
        with pytest.raises(httpx2.TimeoutException):
            await http.post(server.base_url + "/chat/completions", json=body, headers=headers())
    wait_idle(engine)
    generated = engine.stats().num_generated_tokens - before
    assert generated < 400  # it stopped when the client left, not at max_tokens


async def test_a_huge_request_does_not_freeze_the_server(server):  # issue 36.3
    big = [{"role": "user", "content": "lorem ipsum dolor sit amet " * 270_000}]  # 7 MB
    health = server.base_url.removesuffix("/v1") + "/health"
    gaps = []

    async def ticker(http, done):
        while not done.is_set():
            start = time.perf_counter()
            assert (await http.get(health)).status_code == 200
            gaps.append(time.perf_counter() - start)
            await asyncio.sleep(0.02)

    async with httpx2.AsyncClient(timeout=60) as http:
        done = asyncio.Event()
        tick = asyncio.create_task(ticker(http, done))
        await asyncio.sleep(0.1)
        url = server.base_url + "/chat/completions"
        reply = await http.post(url, json={"messages": big, **GREEDY}, headers=headers())
        many = [{"role": "user", "content": f"note {i}"} for i in range(150_000)]
        body = {"messages": many, **GREEDY}  # 150K small messages
        replies = [reply, await http.post(url, json=body, headers=headers())]
        done.set()
        await tick
    for reply in replies:
        assert reply.status_code == 400
        assert reply.json()["error"]["code"] == "context_length_exceeded"
    assert len(gaps) >= 3 and max(gaps) < 0.5


async def test_long_text_is_tokenized_off_the_event_loop(engine):  # issue 36.3
    service = ChatService(engine)
    text = "lorem ipsum dolor sit amet " * 20_000  # passes the length precheck: tokenized
    gaps, done = [], asyncio.Event()

    async def ticker():
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.01)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    tick = asyncio.create_task(ticker())
    started = time.perf_counter()
    with pytest.raises(Exception, match="context|tokens"):
        await service.create({"messages": [{"role": "user", "content": text}], **GREEDY})
    took = time.perf_counter() - started
    done.set()
    await tick
    service.close()
    assert max(gaps) < max(0.2, took / 3)


def test_chat_template_override(engine):
    template = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    service = ChatService(engine, chat_template=template)

    async def run():
        return await service.create(
            {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 1, **GREEDY}
        )

    reply = asyncio.run(run())
    service.close()
    assert reply.usage.prompt_tokens == len(engine.tokenizer.encode("<<hello>>"))


def test_startup_log_line(engine, caplog):
    caplog.set_level("INFO", logger="agentx.serve")
    log_engine(engine, None)
    [line] = [r.getMessage() for r in caplog.records]
    assert "quantization" in line and "ISA" in line
    assert f"context {engine.max_model_len} tokens" in line and "KV capacity" in line


def _t0():
    return {"temperature": 0}


async def test_a_base_model_without_chat_template_completes(make_engine):
    from agentx.engine.models.loader import gemma3_270m_path
    from agentx.openai import AsyncOpenAI

    engine = make_engine(model=str(gemma3_270m_path()))
    assert engine.tokenizer.chat_template is None
    client = AsyncOpenAI(engine)
    try:
        reply = await client.completions.create(
            model="agentx", prompt="The capital of France is", max_tokens=4, temperature=0
        )
        assert reply.choices[0].text and reply.usage.completion_tokens == 4
        with pytest.raises(openai.BadRequestError, match="no chat template"):
            await client.chat.completions.create(
                model="agentx", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
            )
    finally:
        await client.close()
