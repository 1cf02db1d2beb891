"""``agentx serve`` on loopback, driven by the official ``openai`` client over real HTTP.

One engine and one server for the module; the replies are compared with the in-process
service's answers to the same requests (greedy, so they are equal).
"""

import asyncio
import json

import httpx2
import openai
import pytest

from agentx.cli import main as agentx_main
from agentx.openai import ChatService
from agentx.openai.server import ServerThread, create_app
from tests.helpers.idle import wait_idle
from tests.helpers.openai_api import (
    ADD_TOOL,
    CHAT_QUESTIONS,
    GREEDY,
    LONG,
    PERSON_FORMAT,
    reply_message,
)

pytestmark = pytest.mark.slow

API_KEY = "test-key"
USER = [{"role": "user", "content": "What is 2+2? Answer in one short sentence."}]


@pytest.fixture(scope="module")
def engine(make_engine_module):
    return make_engine_module()


@pytest.fixture(scope="module")
def server(engine):
    service = ChatService(engine)
    app = create_app(service, api_key=API_KEY, max_request_bytes=64 << 10)
    with ServerThread(app) as running:
        running.app_service = service
        yield running
    assert service.conversations.get_handles() == []  # shutdown released them
    assert wait_idle(engine).kv_num_held == 0
    engine.check_integrity()


@pytest.fixture
async def client(server):
    client = openai.AsyncOpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0)
    yield client
    await client.close()


async def test_plain_reply_equals_the_in_process_one(engine, client):
    reply = await client.chat.completions.create(messages=USER, max_tokens=12, **GREEDY)
    local = ChatService(engine)
    expected = await local.create({"messages": USER, "max_tokens": 12, **GREEDY})
    local.close()
    assert reply.choices[0].message.content == expected.choices[0].message.content
    assert reply.usage.prompt_tokens == expected.usage.prompt_tokens
    assert reply.usage.completion_tokens == expected.usage.completion_tokens


async def test_streamed_over_sse(client):
    whole = await client.chat.completions.create(messages=USER, max_tokens=12, **GREEDY)
    stream = await client.chat.completions.create(
        messages=USER, max_tokens=12, stream=True, stream_options={"include_usage": True}, **GREEDY
    )
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason


async def test_streamed_tool_call(client):
    ask = [{"role": "user", "content": "What is 17 plus 25?"}]
    stream = await client.chat.completions.create(
        messages=ask, tools=[ADD_TOOL], tool_choice="required", max_tokens=40, stream=True, **GREEDY
    )
    chunks = [c async for c in stream]
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    # OpenAI's shape: the first delta names the call, the later ones carry argument pieces
    assert [(d.index, d.function.name) for d in deltas if d.id] == [(0, "add")]
    assert deltas[0].id and deltas[0].function.arguments == ""
    assert len(deltas) > 2 and all(d.id is None and d.function.name is None for d in deltas[1:])
    arguments = "".join(d.function.arguments for d in deltas)
    assert json.loads(arguments) == {"a": 17, "b": 25}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


async def test_structured_output(client):
    reply = await client.chat.completions.create(
        messages=[{"role": "user", "content": "Describe a person."}],
        response_format=PERSON_FORMAT,
        max_tokens=30,
        **GREEDY,
    )
    person = json.loads(reply.choices[0].message.content)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)


async def test_twelve_turn_conversation_over_http(client):
    history, previous = [], None
    for turn, question in enumerate(CHAT_QUESTIONS):
        history.append({"role": "user", "content": question})
        reply = await client.chat.completions.create(messages=history, max_tokens=8, **GREEDY)
        if turn > 0:
            assert reply.usage.prompt_tokens_details.cached_tokens == previous - 1
        previous = reply.usage.prompt_tokens + reply.usage.completion_tokens
        history.append(reply_message(reply))


async def test_concurrent_clients_share_the_engine(client):
    asks = [[{"role": "user", "content": q}] for q in CHAT_QUESTIONS[:3]]
    alone = [await client.chat.completions.create(messages=a, max_tokens=8, **GREEDY) for a in asks]
    together = await asyncio.gather(
        *(client.chat.completions.create(messages=a, max_tokens=8, **GREEDY) for a in asks)
    )
    contents = [r.choices[0].message.content for r in together]
    assert contents == [r.choices[0].message.content for r in alone]


async def test_errors(server, client):
    with pytest.raises(openai.BadRequestError, match="messages must be a non-empty list"):
        await client.chat.completions.create(model="agentx", messages=[])
    wrong = openai.AsyncOpenAI(base_url=server.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        await wrong.chat.completions.create(messages=USER, max_tokens=4, **GREEDY)
    assert info.value.code == "invalid_api_key"
    await wrong.close()
    with pytest.raises(openai.APIStatusError) as info:
        big = [{"role": "user", "content": "x" * (65 << 10)}]
        await client.chat.completions.create(messages=big, max_tokens=4, **GREEDY)
    assert info.value.status_code == 413 and info.value.code == "request_too_large"
    async with httpx2.AsyncClient() as http:
        headers = {"authorization": f"Bearer {API_KEY}", "content-type": "application/json"}
        bad_json = await http.post(
            server.base_url + "/chat/completions", content=b"{", headers=headers
        )
        assert bad_json.status_code == 400 and "not JSON" in bad_json.json()["error"]["message"]
        health = await http.get(server.base_url.removesuffix("/v1") + "/health")
        assert health.json() == {"status": "ok"}
    models = await client.models.list()
    assert [m.id for m in models.data] == ["agentx"]


async def test_a_client_that_disconnects_aborts_its_request(engine, server):
    body = {"messages": LONG, "max_tokens": 300, "stream": True, **GREEDY}
    held = len(server.app_service.conversations)
    headers = {"authorization": f"Bearer {API_KEY}"}
    async with httpx2.AsyncClient() as http:
        url = server.base_url + "/chat/completions"
        async with http.stream("POST", url, json=body, headers=headers) as response:
            async for _ in response.aiter_bytes():
                break  # leaving the block closes the connection
    assert wait_idle(engine).num_running == 0
    assert len(server.app_service.conversations) == held  # aborted, not finished


def test_serve_command_help(capsys):
    with pytest.raises(SystemExit) as info:
        agentx_main(["serve", "--help"])
    assert info.value.code == 0 and "--api-key" in capsys.readouterr().out
    assert agentx_main(["nope"]) == 2
