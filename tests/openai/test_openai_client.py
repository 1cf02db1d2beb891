"""The official ``openai`` client answered in process (agentx.openai.AsyncOpenAI / OpenAI).

Greedy decoding (temperature 0) and grammars make the tiny default model's replies exact, so the
tests compare against the engine run directly on the same token ids.
"""

import json

import openai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import BaseModel

from agentx import SamplingParams
from agentx.openai import AsyncOpenAI, ChatService, OpenAI
from agentx.session.context import ChatContext
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

USER = [{"role": "user", "content": "What is 2+2? Answer in one short sentence."}]


@pytest.fixture(scope="module")
def engine(make_engine_module):
    return make_engine_module()


@pytest.fixture
async def client(engine):
    client = AsyncOpenAI(engine)
    yield client
    await client.close()
    stats = wait_idle(engine)
    assert stats.kv_num_held == 0 and stats.kv_num_used_blocks == 0  # nothing leaked
    engine.check_integrity()


def direct(engine, messages, max_tokens):
    """The same request run on the engine itself: (prompt ids, generation)."""
    prompt = ChatContext.with_tools(engine.tokenizer, None, None).prompt_for(messages)
    [gen] = engine.generate([prompt], SamplingParams(max_tokens=max_tokens))
    return prompt, gen


async def test_create_returns_the_engines_greedy_reply(engine, client):
    reply = await client.chat.completions.create(messages=USER, max_tokens=12, **GREEDY)
    prompt, gen = direct(engine, USER, 12)
    assert isinstance(reply, ChatCompletion) and reply.object == "chat.completion"
    assert reply.model == "agentx" and reply.id.startswith("chatcmpl-")
    [choice] = reply.choices
    assert choice.message.role == "assistant" and choice.message.content == gen.text
    assert choice.finish_reason == gen.finish_reason and choice.message.tool_calls is None
    usage = reply.usage
    assert usage.prompt_tokens == len(prompt) and usage.completion_tokens == len(gen.token_ids)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens % 16 == 0  # whole blocks of the cache


async def test_stream_yields_the_same_reply_in_chunks(engine, client):
    whole = await client.chat.completions.create(messages=USER, max_tokens=12, **GREEDY)
    stream = await client.chat.completions.create(
        messages=USER, max_tokens=12, stream=True, stream_options={"include_usage": True}, **GREEDY
    )
    chunks = [chunk async for chunk in stream]
    assert all(isinstance(c, ChatCompletionChunk) for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    *body, last_choice, usage_chunk = chunks
    assert last_choice.choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in body)
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 12
    assert usage_chunk.usage.prompt_tokens == whole.usage.prompt_tokens


async def test_required_tool_call(client):
    ask = [{"role": "user", "content": "What is 17 plus 25?"}]
    reply = await client.chat.completions.create(
        messages=ask, tools=[ADD_TOOL], tool_choice="required", max_tokens=40, **GREEDY
    )
    [choice] = reply.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "add" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"a": 17, "b": 25}

    named = {"type": "function", "function": {"name": "add"}}
    stream = await client.chat.completions.create(
        messages=ask, tools=[ADD_TOOL], tool_choice=named, max_tokens=40, stream=True, **GREEDY
    )
    deltas = [c.choices[0].delta async for c in stream if c.choices and c.choices[0].delta]
    calls = [tc for d in deltas if d.tool_calls for tc in d.tool_calls]
    # the first delta names the call, the later ones carry pieces of its arguments
    assert [(c.index, c.function.name) for c in calls if c.id] == [(0, "add")]
    arguments = "".join(c.function.arguments for c in calls)
    assert json.loads(arguments) == json.loads(call.function.arguments)


async def test_tool_result_continues_the_held_conversation(client):
    history = [{"role": "user", "content": "What is 17 plus 25?"}]
    first = await client.chat.completions.create(
        messages=history, tools=[ADD_TOOL], tool_choice="required", max_tokens=40, **GREEDY
    )
    [call] = first.choices[0].message.tool_calls
    history += [
        reply_message(first),
        {"role": "tool", "tool_call_id": call.id, "content": "42"},
    ]
    second = await client.chat.completions.create(
        messages=history, tools=[ADD_TOOL], max_tokens=16, **GREEDY
    )
    previous = first.usage.prompt_tokens + first.usage.completion_tokens
    # everything the first call computed is reused; its last sampled token never ran
    assert second.usage.prompt_tokens_details.cached_tokens == previous - 1


async def test_json_schema_response_format(client):
    ask = [{"role": "user", "content": "Describe a person."}]
    reply = await client.chat.completions.create(
        messages=ask, response_format=PERSON_FORMAT, max_tokens=30, **GREEDY
    )
    person = json.loads(reply.choices[0].message.content)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)

    class Person(BaseModel):
        name: str
        age: int

    parsed = await client.chat.completions.parse(
        messages=ask, response_format=Person, max_tokens=30, **GREEDY
    )
    assert isinstance(parsed.choices[0].message.parsed, Person)


async def test_twelve_turn_resent_conversation_computes_only_new_tokens(engine, client):
    history, previous = [], None
    for turn, question in enumerate(CHAT_QUESTIONS):
        history.append({"role": "user", "content": question})
        reply = await client.chat.completions.create(messages=history, max_tokens=8, **GREEDY)
        usage = reply.usage
        if turn > 0:
            # the previous prompt and output, all but its last sampled token (it never ran)
            assert usage.prompt_tokens_details.cached_tokens == previous - 1
        previous = usage.prompt_tokens + usage.completion_tokens
        history.append(reply_message(reply))
    assert len(history) == 24
    assert len(client.service.conversations) == 1  # each turn took the last one's place
    assert engine.stats().kv_num_held == 1


async def test_n_choices_fork_the_held_conversation(engine, client):
    # sent nowhere else: no other request computed this conversation's tokens, so the held KV
    # is the longest hit (test_session.py sends "Name a color." to the same engine)
    history = [{"role": "user", "content": "Name a color for a boat."}]
    first = await client.chat.completions.create(messages=history, max_tokens=6, **GREEDY)
    history += [reply_message(first), {"role": "user", "content": "Two more."}]
    reply = await client.chat.completions.create(
        model="agentx", messages=history, max_tokens=6, n=3, temperature=1.0, seed=11
    )
    assert [c.index for c in reply.choices] == [0, 1, 2]
    previous = first.usage.prompt_tokens + first.usage.completion_tokens
    assert reply.usage.prompt_tokens_details.cached_tokens == previous - 1
    assert 3 <= reply.usage.completion_tokens <= 3 * 6
    again = await client.chat.completions.create(
        model="agentx", messages=history, max_tokens=6, n=3, temperature=1.0, seed=11
    )
    # a seed makes the choices reproducible, and each choice has its own (seed + index)
    assert [c.message.content for c in again.choices] == [c.message.content for c in reply.choices]
    assert len(client.service.conversations) == 3 + 3  # every choice can be continued
    engine.check_integrity()


async def test_errors_are_openais_exceptions(client):
    with pytest.raises(openai.BadRequestError, match="messages must be a non-empty list"):
        await client.chat.completions.create(model="agentx", messages=[])
    with pytest.raises(openai.BadRequestError, match="not a declared tool") as info:
        await client.chat.completions.create(
            messages=USER, tools=[ADD_TOOL], tool_choice={"name": "mul"}, **GREEDY
        )
    assert info.value.status_code == 400 and info.value.type == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(
            messages=[{"role": "user", "content": "hello " * 9000}], max_tokens=4, **GREEDY
        )
    assert info.value.code == "context_length_exceeded"


async def test_closing_a_stream_early_aborts_the_request(engine, client):
    for chunks_to_read in (2, 0):  # after some chunks, and before the first one
        stream = await client.chat.completions.create(
            messages=LONG, max_tokens=300, stream=True, **GREEDY
        )
        if chunks_to_read:
            async for _ in stream:
                chunks_to_read -= 1
                if chunks_to_read == 0:
                    break
        await stream.close()
        stats = wait_idle(engine)
        assert stats.num_running == 0 and engine.get_num_live_requests() == 0
    assert len(client.service.conversations) == 0  # both aborted, neither finished


async def test_lru_eviction_releases_held_kv(engine):
    service = ChatService(engine, max_held_conversations=2)
    client = AsyncOpenAI(service=service)
    for question in CHAT_QUESTIONS[:4]:
        ask = [{"role": "user", "content": question}]
        await client.chat.completions.create(messages=ask, max_tokens=4, **GREEDY)
    assert wait_idle(engine).kv_num_held == 2 and len(service.conversations) == 2
    service.conversations.check_integrity()
    await client.close()  # a shared service outlives its client
    assert len(service.conversations) == 2
    service.close()
    assert wait_idle(engine).kv_num_held == 0


def test_sync_client(engine):
    with OpenAI(engine) as client:
        reply = client.chat.completions.create(messages=USER, max_tokens=12, **GREEDY)
        stream = client.chat.completions.create(messages=USER, max_tokens=12, stream=True, **GREEDY)
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text == reply.choices[0].message.content == direct(engine, USER, 12)[1].text
        assert [m.id for m in client.models.list()] == ["agentx"]
    assert wait_idle(engine).kv_num_held == 0


async def test_tools_with_a_response_format_reply_calls_or_the_answer(client):
    ask = [{"role": "user", "content": "What is 17 plus 25?"}]
    both = {"tools": [ADD_TOOL], "response_format": PERSON_FORMAT, "max_tokens": 40, **GREEDY}
    reply = await client.chat.completions.create(messages=ask, **both)
    # calls that parse or an answer that does, never free text; greedy picks the call here
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls" and message.content is None
    assert json.loads(message.tool_calls[0].function.arguments) == {"a": 17, "b": 25}
    answer = await client.chat.completions.create(messages=ask, tool_choice="none", **both)
    assert set(json.loads(answer.choices[0].message.content)) == {"name", "age"}
    forced = await client.chat.completions.create(messages=ask, tool_choice="required", **both)
    assert forced.choices[0].message.tool_calls[0].function.name == "add"


def test_closing_the_sync_client_with_a_stream_open_releases_its_kv(engine):
    client = OpenAI(engine)
    stream = client.chat.completions.create(messages=USER, max_tokens=4, stream=True, **GREEDY)
    next(iter(stream))  # the request runs (and finishes, its KV held for the conversation)
    client.close()  # was: the held KV of the open stream leaked
    stats = wait_idle(engine)
    assert stats.kv_num_held == 0 and stats.kv_num_used_blocks == 0


async def test_a_run_time_failure_is_a_500_not_a_stop(engine, client, monkeypatch):
    from agentx.engine.structured import GrammarMatcher

    commit = GrammarMatcher.commit

    def failing(self, token_id):  # the matcher fails past its first token, as at a limit
        token_id = commit(self, token_id)
        self.failed = True
        return token_id

    monkeypatch.setattr(GrammarMatcher, "commit", failing)
    with pytest.raises(openai.InternalServerError) as info:
        await client.chat.completions.create(
            messages=USER, response_format=PERSON_FORMAT, max_tokens=16, **GREEDY
        )
    assert info.value.status_code == 500 and info.value.code == "request_failed"
    assert len(client.service.conversations) == 0


async def test_a_run_time_failure_is_an_error_streamed_and_in_responses(
    engine, client, monkeypatch
):
    """A stream that started before the failure ends with an error event, which the client
    raises (never a chunk with finish_reason "stop"); the Responses API fails alike."""
    from agentx.engine.structured import GrammarMatcher

    commit = GrammarMatcher.commit

    def failing(self, token_id):
        token_id = commit(self, token_id)
        self.failed = True
        return token_id

    monkeypatch.setattr(GrammarMatcher, "commit", failing)
    stream = await client.chat.completions.create(
        messages=USER, response_format=PERSON_FORMAT, max_tokens=16, stream=True, **GREEDY
    )
    reasons = []
    with pytest.raises(openai.APIError, match="failed while it ran"):
        async for chunk in stream:
            reasons += [c.finish_reason for c in chunk.choices if c.finish_reason]
    assert reasons == []
    schema = PERSON_FORMAT["json_schema"]["schema"]
    text = {"format": {"type": "json_schema", "name": "person", "schema": schema}}
    ask = {"model": "agentx", "input": "Name a person.", "text": text, "max_output_tokens": 16}
    with pytest.raises(openai.InternalServerError) as info:
        await client.responses.create(**ask)
    assert info.value.code == "request_failed"
    with pytest.raises(openai.APIError, match="failed while it ran"):
        async for _ in await client.responses.create(**ask, stream=True):
            pass
    assert len(client.service.conversations) == 0


async def test_completion_choices_of_the_largest_seed(client):
    """n choices offset the seed; from 2**63 - 1 it wraps (was: a 400 for a valid seed)."""
    reply = await client.completions.create(
        model="agentx", prompt="Once upon a time", n=2, seed=2**63 - 1, max_tokens=3
    )
    assert [c.index for c in reply.choices] == [0, 1]
    assert {c.finish_reason for c in reply.choices} <= {"stop", "length"}
