"""ChatContext: every turn's prompt ids extend the previous prompt + its output ids exactly, on
the real SmolLM2 tokenizer and on templates that re-render the history differently."""

from __future__ import annotations

import pytest

from agentx.engine.models.loader import default_model_path
from agentx.engine.models.tokenizer import Tokenizer
from agentx.errors import InvalidRequestError
from agentx.session.context import ChatContext

TOOL_CALL = '<tool_call>[{"name": "f", "arguments": {"x": 1}}]</tool_call>'

# A message count in the system header: every rendering changes its first line.
COUNTING_TEMPLATE = (
    "<|im_start|>system\n{{ messages | length }} messages so far<|im_end|>\n"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Only the last three messages: old turns fall off the front.
WINDOW_TEMPLATE = (
    "{% for message in messages[-3:] %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Every system message first: a new system message lands far from the end.
HOISTING_TEMPLATE = (
    "{% for message in messages if message['role'] == 'system' %}"
    "<|im_start|>system\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% for message in messages if message['role'] != 'system' %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Content as JSON: chunks appended raw would not be what the template writes.
JSON_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] | tojson }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf(default_model_path())


def with_template(tok: Tokenizer, template: str) -> Tokenizer:
    return Tokenizer(tok.backend, eos_token_id=tok.eos_token_id, chat_template=template)


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def tool(text: str) -> dict[str, str]:
    return {"role": "tool", "content": text}


def eos_output(tok: Tokenizer, text: str) -> list[int]:
    return [*tok.encode(text), tok.eos_token_id]


def run_turns(ctx: ChatContext, tok: Tokenizer, num_turns: int) -> list[list[int]]:
    """Drive ``num_turns`` turns of every kind; assert the extension property at each one.

    Turn kinds, cycling: a plain answer ending on EOS, a tool call ending on EOS (answered by
    tool results), a length stop without EOS, a stop string with tokens generated past it.
    """
    prompts: list[list[int]] = []
    seen: list[int] = []
    new = [user("Hello, who are you?")]
    for turn in range(num_turns):
        prompt = ctx.prompt_for(new)
        assert prompt[: len(seen)] == seen, f"turn {turn} does not extend the last one"
        assert ctx.last_prompt_len == len(prompt) == ctx.num_tokens
        prompts.append(prompt)
        kind = turn % 4
        if kind == 0:
            text, output, reason = f"Answer {turn}.", eos_output(tok, f"Answer {turn}."), "stop"
            new = [user(f"Question {turn + 1}?")]
        elif kind == 1:
            text, output, reason = TOOL_CALL, eos_output(tok, TOOL_CALL), "stop"
            new = [tool(f'{{"result": {turn}}}'), tool("second result")]
        elif kind == 2:
            text, output, reason = "I will keep go", tok.encode("I will keep go"), "length"
            new = [user("Go on."), {"role": "system", "content": "Be brief."}]
        else:
            text, output, reason = "Done", tok.encode("Done. STOP and more"), "stop"
            new = [user(f"Next {turn}")]
        ctx.commit_output(output, text, reason)
        ctx.check_integrity()
        seen = prompt + output
        assert ctx.token_ids[: len(seen)] == seen
    return prompts


def test_twenty_turns_extend_exactly(tok):
    ctx = ChatContext(tok, system="You are terse.", tools_prompt="Tools: f(x).")
    run_turns(ctx, tok, 20)
    assert ctx.messages[0] == {"role": "system", "content": "You are terse.\n\nTools: f(x)."}
    assert [m["role"] for m in ctx.messages].count("assistant") == 20
    # The messages list renders to exactly the text the context tracked.
    assert ctx.rendered == tok.apply_chat_template(ctx.messages, add_generation_prompt=False)


def test_clean_history_equals_a_fresh_render(tok):
    """Every turn ends on EOS and its text tokenizes canonically: the cache-friendly history
    is also what encoding a fresh render gives."""
    ctx = ChatContext(tok)
    new = [user("Hi there, 2 + 2?")]
    for turn in range(6):
        ctx.prompt_for(new)
        text = TOOL_CALL if turn % 2 else f"It is {turn}. Anything else?"
        ctx.commit_output(eos_output(tok, text), text, "stop")
        new = [tool(f"result {turn}")] if turn % 2 else [user(f"And {turn} + 1?")]
    prompt = ctx.prompt_for(new)
    assert prompt == tok.encode(tok.apply_chat_template(ctx.messages, add_generation_prompt=True))
    assert ctx.messages[1] == {"role": "assistant", "content": "It is 0. Anything else?"}
    assert ctx.messages[0]["role"] == "user"  # the template adds its default system itself


def test_closing_tokens_eos_vs_length(tok):
    newline, end, start = tok.encode("\n"), tok.encode("<|im_end|>"), tok.encode("<|im_start|>")
    assert end == [tok.eos_token_id]

    ctx = ChatContext(tok)
    prompt = ctx.prompt_for([user("One")])
    output = eos_output(tok, "Yes.")
    assert ctx.commit_output(output, "Yes.", "stop") == newline
    assert ctx.token_ids == prompt + output + newline

    history = ctx.token_ids
    prompt = ctx.prompt_for([user("Two")])
    assert prompt[len(history) :] == tok.encode("<|im_start|>user\nTwo<|im_end|>\n") + tok.encode(
        "<|im_start|>assistant\n"
    )
    assert prompt[len(history)] == start[0]
    output = tok.encode("This is cut")
    assert ctx.commit_output(output, "This is cut", "length") == end + newline
    assert ctx.token_ids == prompt + output + end + newline

    # A stop string: the ids generated past it stay, the closing comes after all of them.
    prompt = ctx.prompt_for([user("Three")])
    output = tok.encode("Cut here STOP extra")
    assert ctx.commit_output(output, "Cut here", "stop") == end + newline
    assert ctx.messages[-1]["content"] == "Cut here"
    suffix = ctx.prompt_for([user("Four")])[len(prompt) + len(output) + 2 :]
    assert suffix == tok.encode("<|im_start|>user\nFour<|im_end|>\n<|im_start|>assistant\n")
    assert suffix[0] == start[0]


def test_tool_calls_text_is_kept_raw(tok):
    ctx = ChatContext(tok)
    ctx.prompt_for([user("Call f")])
    output = eos_output(tok, "Calling. " + TOOL_CALL)
    ctx.commit_output(output, "Calling. ", "stop", tool_calls_text=TOOL_CALL)
    assert ctx.messages[-1] == {"role": "assistant", "content": "Calling. " + TOOL_CALL}


@pytest.mark.parametrize("template", [COUNTING_TEMPLATE, WINDOW_TEMPLATE])
def test_unstable_template_keeps_the_prefix(tok, template):
    unstable = with_template(tok, template)
    ctx = ChatContext(unstable, system="sys")
    prompts = run_turns(ctx, unstable, 12)
    assert prompts[-1][: len(prompts[0])] == prompts[0]
    # A fresh render no longer matches the history: the template rewrote its start.
    fresh = unstable.encode(unstable.apply_chat_template(ctx.messages, add_generation_prompt=False))
    assert fresh != ctx.token_ids


@pytest.mark.parametrize("template", [COUNTING_TEMPLATE, WINDOW_TEMPLATE])
def test_unstable_template_adds_only_the_new_text(tok, template):
    unstable = with_template(tok, template)
    ctx = ChatContext(unstable, system="sys")
    for turn in range(5):
        before = ctx.num_tokens
        prompt = ctx.prompt_for([user(f"question {turn}")])
        added = f"<|im_start|>user\nquestion {turn}<|im_end|>\n<|im_start|>assistant\n"
        if turn == 0:
            assert prompt == unstable.encode(
                unstable.apply_chat_template(ctx.messages, add_generation_prompt=True)
            )
        else:
            assert prompt[before:] == unstable.encode(added)
        closing = ctx.commit_output(eos_output(unstable, f"answer {turn}"), "x", "stop")
        assert closing == unstable.encode("\n")


def test_template_writing_new_messages_elsewhere_raises(tok):
    hoisting = with_template(tok, HOISTING_TEMPLATE)
    ctx = ChatContext(hoisting, system="first")
    ctx.prompt_for([user("hi")])
    ctx.commit_output(eos_output(hoisting, "hello"), "hello", "stop")
    ids, messages = ctx.token_ids, ctx.messages
    with pytest.raises(InvalidRequestError, match="at the end"):
        ctx.prompt_for([{"role": "system", "content": "a second system prompt"}])
    assert (ctx.token_ids, ctx.messages) == (ids, messages)
    ctx.prompt_for([user("still works")])  # unchanged and usable


def test_streamed_tool_result(tok):
    ctx = ChatContext(tok)
    ctx.prompt_for([user("Read the file")])
    ctx.commit_output(eos_output(tok, TOOL_CALL), TOOL_CALL, "stop")
    start = ctx.num_tokens

    header = ctx.open_message("tool")
    assert header == tok.encode("<|im_start|>tool\n")
    with pytest.raises(InvalidRequestError):
        ctx.prompt_for([])
    chunks = ["Hello wor", "ld, 12", "345 done\n", "", "  tail"]
    chunk_ids = [ctx.append_to_open(chunk) for chunk in chunks]
    assert chunk_ids == [tok.encode(chunk) for chunk in chunks]
    footer = ctx.close_message()
    assert footer == tok.encode("<|im_end|>\n")
    ctx.check_integrity()

    history = ctx.token_ids
    assert history[start:] == header + [i for ids in chunk_ids for i in ids] + footer
    assert ctx.messages[-1] == {"role": "tool", "content": "".join(chunks)}
    prompt = ctx.prompt_for([])
    assert prompt == history + tok.encode("<|im_start|>assistant\n")
    # Chunks tokenized apart are the truth even where the joined text tokenizes otherwise.
    assert tok.encode("".join(chunks)) != [i for ids in chunk_ids for i in ids]


def test_streamed_message_first_carries_the_default_system(tok):
    ctx = ChatContext(tok)
    header = ctx.open_message("user")
    assert tok.decode(header).startswith("<|im_start|>system\nYou are a helpful AI assistant")
    ctx.append_to_open("hi")
    ctx.close_message()
    prompt = ctx.prompt_for([])
    assert prompt == tok.encode(tok.apply_chat_template(ctx.messages, add_generation_prompt=True))


def test_streaming_refused_when_the_template_transforms_content(tok):
    ctx = ChatContext(with_template(tok, JSON_TEMPLATE))
    with pytest.raises(InvalidRequestError, match="verbatim"):
        ctx.open_message("tool")
    ctx.check_integrity()
    assert ctx.num_tokens == 0 and ctx.messages == []


def test_misuse_raises(tok):
    ctx = ChatContext(tok)
    with pytest.raises(InvalidRequestError):
        ctx.commit_output([], "", "stop")
    with pytest.raises(InvalidRequestError):
        ctx.append_to_open("x")
    ctx.prompt_for([user("hi")])
    with pytest.raises(InvalidRequestError, match="commit_output"):
        ctx.prompt_for([user("again")])
    with pytest.raises(InvalidRequestError):
        ctx.open_message("tool")
    # An aborted turn with no output still closes cleanly.
    assert ctx.commit_output([], "", "abort") == tok.encode("<|im_end|>\n")


def test_fork_is_independent(tok):
    parent = ChatContext(tok, system="root")
    parent.prompt_for([user("plan")])
    parent.commit_output(eos_output(tok, "ok"), "ok", "stop")
    shared = parent.token_ids

    child = parent.fork()
    child_prompt = child.prompt_for([user("subtask")])
    child.commit_output(eos_output(tok, "sub done"), "sub done", "stop")
    assert parent.token_ids == shared
    assert len(parent.messages) == 3 and len(child.messages) == 5

    parent_prompt = parent.prompt_for([user("continue")])
    assert parent_prompt[: len(shared)] == child_prompt[: len(shared)] == shared
    assert parent_prompt[len(shared) :] != child_prompt[len(shared) :]
    assert child.messages[3] == {"role": "user", "content": "subtask"}
    parent.check_integrity()
    child.check_integrity()


def test_returned_ids_never_change(tok):
    ctx = ChatContext(tok)
    prompt = ctx.prompt_for([user("a")])
    kept = list(prompt)
    prompt.append(-1)  # the caller's list is its own
    ctx.commit_output(eos_output(tok, "b"), "b", "stop")
    assert ctx.token_ids[: len(kept)] == kept
    ctx.messages[0]["content"] = "mutated"
    assert ctx.messages[0]["content"] == "a"
