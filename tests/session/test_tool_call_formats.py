"""Tool-call formats per model family: rendering and parsing (whole and streamed) round trip,
malformed calls, detection from chat templates, Qwen's tools prompt and tool results, and the
``tool_choice`` grammars in each format (random walks always parse). Tokenizers only; one
``slow`` test runs the real Qwen2.5-Coder model when its GGUF is present."""

from __future__ import annotations

import itertools
import os
import random
from pathlib import Path

import pytest

from agentx.config import TOOL_CALL_FORMATS as CONFIG_FORMAT_NAMES
from agentx.config import ConfigError, EngineConfig
from agentx.engine.models.loader import default_model_path
from agentx.engine.models.tokenizer import Tokenizer
from agentx.engine.structured import GrammarBackend
from agentx.errors import InvalidRequestError
from agentx.model_store import resolve
from agentx.session.constraints import tool_call_grammar
from agentx.session.context import ChatContext
from agentx.session.messages import ToolCall
from agentx.session.tool_calls import ToolCallParser, ToolCallStreamFilter, render_tool_calls
from agentx.session.tool_formats import (
    TOOL_CALL_FORMATS,
    ToolCallFormat,
    detect_tool_call_format,
    format_for_tokenizer,
    get_tool_call_format,
)
from agentx.session.tools import make_tools
from tests.helpers.grammar import Walk, short_token_ids

# `make test` pulls it (agentx models pull qwen2.5-coder-1.5b) into the cache
QWEN_GGUF = Path(os.environ.get("AGENTX_QWEN_GGUF") or resolve("qwen2.5-coder-1.5b") or "absent")
needs_qwen = pytest.mark.skipif(
    not QWEN_GGUF.is_file(),
    reason="qwen2.5-coder-1.5b is not pulled: agentx models pull qwen2.5-coder-1.5b",
)
FORMATS = list(TOOL_CALL_FORMATS.values())
LLAMA31_TEMPLATE_PART = (
    '{%- if builtin_tools is defined or tool_call is defined %}{{- "<|python_tag|>" }}{%- endif %}'
    '{{- \'{"name": "\' + tool_call.name + \'", "parameters": \' }}<|eot_id|>'
)


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def echo(text: str) -> str:
    """Repeat a text."""
    return text


TOOLS = list(make_tools([add, echo]).values())


def counting_parser(fmt: ToolCallFormat) -> ToolCallParser:
    counter = itertools.count()
    return ToolCallParser(id_factory=lambda: f"call_{next(counter)}", tool_format=fmt)


def calls(*entries: tuple[str, dict]) -> list[ToolCall]:
    return [ToolCall(id=f"call_{i}", name=n, arguments=a) for i, (n, a) in enumerate(entries)]


ADD = ("add", {"a": 17, "b": 25})
HEAD, END = "<tool_call>\n", "</tool_call>"
ECHO_SPEC = {
    "name": "echo",
    "parameters": {
        "type": "object",
        "properties": {"text": {"type": "string"}},
        "additionalProperties": False,
        "$defs": {},
    },
}
ECHO = ("echo", {"text": 'a "quoted" </tool_call> {"name": x} \\ done'})


# ---- the registry ----------------------------------------------------------------------------


def test_registry_order_and_config_names():
    assert list(TOOL_CALL_FORMATS) == ["smollm2", "hermes", "llama3_json"]
    assert tuple(TOOL_CALL_FORMATS) == CONFIG_FORMAT_NAMES
    assert get_tool_call_format("hermes") is TOOL_CALL_FORMATS["hermes"]
    with pytest.raises(InvalidRequestError, match="unknown tool_call_format"):
        get_tool_call_format("xml")
    with pytest.raises(ConfigError, match="tool_call_format"):
        EngineConfig(tool_call_format="xml")
    assert EngineConfig(tool_call_format="hermes").tool_call_format == "hermes"


# ---- round trips, parallel calls, malformed calls ----------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("entries", [[ADD], [ADD, ECHO], [ECHO, ADD, ADD]])
def test_rendered_calls_parse_back(fmt, entries):
    expected = calls(*entries)
    text = "Let me compute.\n" + render_tool_calls(expected, fmt)
    shown, parsed = counting_parser(fmt).parse(text)
    assert shown.strip() == "Let me compute."
    assert parsed == expected


def test_each_family_writes_its_own_markup():
    two = calls(ADD, ADD)
    assert render_tool_calls(two, TOOL_CALL_FORMATS["smollm2"]) == (
        '<tool_call>[{"name": "add", "arguments": {"a": 17, "b": 25}}, '
        '{"name": "add", "arguments": {"a": 17, "b": 25}}]</tool_call>'
    )
    one = '<tool_call>\n{"name": "add", "arguments": {"a": 17, "b": 25}}\n</tool_call>'
    assert render_tool_calls(two, TOOL_CALL_FORMATS["hermes"]) == f"{one}\n{one}"
    assert render_tool_calls(calls(ADD), TOOL_CALL_FORMATS["llama3_json"]) == (
        '{"name": "add", "parameters": {"a": 17, "b": 25}}'
    )


def test_llama_python_tag_and_parameters_key():
    fmt = TOOL_CALL_FORMATS["llama3_json"]
    text = '<|python_tag|>{"name": "add", "parameters": {"a": 17, "b": 25}}'
    assert counting_parser(fmt).parse(text) == ("", calls(ADD))


@pytest.mark.parametrize(
    "name, text, error",
    [
        (
            "smollm2",
            '<tool_call>[{"name": "add", "arguments": {"a": 1]</tool_call>',
            "invalid JSON",
        ),
        ("smollm2", '<tool_call>[{"name": "add"', "unterminated <tool_call> block"),
        (
            "hermes",
            '<tool_call>\n{"name": "add", "arguments": {"a": }\n</tool_call>',
            "invalid JSON",
        ),
        (
            "hermes",
            '<tool_call>\n{"name": "add", "arguments": [1]}\n</tool_call>',
            "must be an object",
        ),
        ("hermes", "<tool_call>\n\n</tool_call>", "empty <tool_call> block"),
        ("hermes", '<tool_call>\n{"name": "add", "arguments": {', "unterminated"),
        ("llama3_json", '{"name": "add", "parameters": {"a": 1}', "unterminated"),
        ("llama3_json", '<|python_tag|>{"name": "add", "parameters": 3}', "must be an object"),
        ("llama3_json", '{"name": 5, "parameters": {}}', 'no "name" string'),
    ],
)
def test_malformed_call_becomes_an_error_call(name, text, error):
    shown, parsed = counting_parser(TOOL_CALL_FORMATS[name]).parse("Hi. " + text)
    assert shown == "Hi. "
    assert len(parsed) == 1 and not parsed[0].ok and error in parsed[0].error
    assert parsed[0].raw == text and parsed[0].id == "call_0"


def test_hermes_parallel_blocks_with_one_malformed_between():
    fmt = TOOL_CALL_FORMATS["hermes"]
    good = render_tool_calls(calls(ADD), fmt)
    text = f'{good}\n<tool_call>\n{{"name": "echo", "arguments": oops}}\n</tool_call>\n{good}'
    shown, parsed = counting_parser(fmt).parse(text)
    assert shown == "\n\n"
    assert [c.ok for c in parsed] == [True, False, True]
    assert parsed[1].name == "echo"
    assert render_tool_calls(parsed, fmt) == text  # the malformed one replays as written


FENCED = '```json\n{\n  "name": "add",\n  "arguments": {"a": 17, "b": 25}\n}\n```'


def test_hermes_fenced_json_call_counts_and_other_fences_stay_text():
    """Qwen2.5-Coder under tool_choice="auto" writes its call as a markdown JSON block."""
    fmt = TOOL_CALL_FORMATS["hermes"]
    assert counting_parser(fmt).parse("Sure.\n" + FENCED) == ("Sure.\n", calls(ADD))
    data = '```json\n{"x": "```"}\n``` and ```json\n[1, 2'
    assert counting_parser(fmt).parse(data) == (data, [])
    shown, parsed = counting_parser(TOOL_CALL_FORMATS["smollm2"]).parse(FENCED)
    assert (shown, parsed) == (FENCED, [])  # only Hermes reads fences
    text = "a " + FENCED + " b " + data
    expected = counting_parser(fmt).parse(text)
    for cut in range(len(text) + 1):
        assert _stream(fmt, [text[:cut], text[cut:]]) == expected, cut


# ---- streaming ---------------------------------------------------------------------------------


def _stream(fmt: ToolCallFormat, chunks: list[str]) -> tuple[str, list[ToolCall]]:
    stream = ToolCallStreamFilter(counting_parser(fmt))
    shown = "".join(stream.push(chunk) for chunk in chunks)
    tail, parsed = stream.finish()
    return shown + tail, parsed


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_stream_filter_matches_parse_at_any_split(fmt):
    text = "Sure <b>x</b> " + render_tool_calls(calls(ADD, ECHO), fmt) + " then done <tool"
    expected = counting_parser(fmt).parse(text)
    for cut in range(len(text) + 1):
        assert _stream(fmt, [text[:cut], text[cut:]]) == expected, cut
    rng = random.Random(0)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(text)), 8))
        chunks = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert _stream(fmt, chunks) == expected


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_stream_filter_never_shows_markup(fmt):
    text = render_tool_calls(calls(ADD), fmt)
    stream = ToolCallStreamFilter(counting_parser(fmt))
    shown = [stream.push(ch) for ch in text]
    assert "".join(shown) == ""
    assert stream.take_calls() == calls(ADD)  # available as soon as the call ends


# ---- detection and the chat template ---------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(default_model_path())


@pytest.fixture(scope="module")
def qwen_tokenizer() -> Tokenizer:
    if not QWEN_GGUF.is_file():
        pytest.skip("qwen2.5-coder-1.5b is not pulled: agentx models pull qwen2.5-coder-1.5b")
    return Tokenizer.from_gguf(QWEN_GGUF)


def test_detection_from_templates(smollm2_tokenizer):
    assert detect_tool_call_format(smollm2_tokenizer.chat_template).name == "smollm2"
    assert detect_tool_call_format(None).name == "smollm2"
    assert detect_tool_call_format(LLAMA31_TEMPLATE_PART).name == "llama3_json"


def test_qwen_template_is_hermes(qwen_tokenizer):
    assert detect_tool_call_format(qwen_tokenizer.chat_template).name == "hermes"


def test_template_tools_are_brief_function_dicts():
    # what a template lists: the OpenAI function shape, without the grammar's validation keys
    fmt = get_tool_call_format("hermes")
    listed = fmt.template_tools([TOOLS[0].to_dict(), {"type": "function", "function": ECHO_SPEC}])
    assert listed == [
        {
            "type": "function",
            "function": {
                "name": "add",
                "description": "Add two integers.",
                "parameters": {
                    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                    "required": ["a", "b"],
                    "type": "object",
                },
            },
        },
        {
            "type": "function",
            "function": {
                "name": "echo",
                "parameters": {"type": "object", "properties": {"text": {"type": "string"}}},
            },
        },
    ]
    assert "additionalProperties" in TOOLS[0].to_dict()["parameters"]  # the tool keeps it


def test_qwen_renders_tools_and_tool_results(qwen_tokenizer):
    fmt = detect_tool_call_format(qwen_tokenizer.chat_template)
    specs = [tool.to_dict() for tool in TOOLS]
    context = ChatContext.with_tools(qwen_tokenizer, "You add numbers.", specs, fmt)
    context.prompt_for([{"role": "user", "content": "What is 17 plus 25?"}])
    head = context.rendered
    assert head.startswith("<|im_start|>system\nYou add numbers.\n\n# Tools\n")
    assert (
        '\n{"type": "function", "function": {"name": "add", "description": "Add two integers.", '
        '"parameters": {"properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, '
        '"required": ["a", "b"], "type": "object"}}}\n'
    ) in head
    assert "<tool_call>" not in head.split("</tools>")[0]  # the listing is the template's
    reply = render_tool_calls(calls(ADD), fmt)
    context.commit_output(qwen_tokenizer.encode(reply + "<|im_end|>"), reply, "stop", None)
    context.prompt_for([{"role": "tool", "content": "42"}])
    assert context.rendered.endswith(
        "<|im_start|>assistant\n" + reply + "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    context.check_integrity()


def test_smollm2_keeps_its_own_tools_prompt(smollm2_tokenizer):
    specs = [tool.to_dict() for tool in TOOLS]
    context = ChatContext.with_tools(smollm2_tokenizer, None, specs)
    context.prompt_for([{"role": "user", "content": "hi"}])
    assert "<tools>[" in context.rendered and "You are an expert in composing" in context.rendered


# ---- tool_choice grammars: random walks always parse ------------------------------------------


@pytest.fixture(scope="module")
def grammar_backend(smollm2_tokenizer) -> GrammarBackend:
    tok = smollm2_tokenizer
    return GrammarBackend(tok.backend.to_str(), tok.vocab_size, frozenset(tok.eos_token_ids))


CHOICES = ["auto", "required", {"name": "add"}, "none"]


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("choice", CHOICES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_tool_choice_walks_always_parse(smollm2_tokenizer, grammar_backend, fmt, choice, parallel):
    spec = tool_call_grammar(TOOLS, choice, parallel_calls=parallel, tool_format=fmt)
    minimum = grammar_backend.min_tokens(spec)
    assert minimum is not None
    short = short_token_ids(smollm2_tokenizer)
    for seed in range(12):
        matcher = grammar_backend.new_matcher(spec, minimum + (seed * 7) % 60)
        walk = Walk(grammar_backend, matcher, short, seed)
        text = smollm2_tokenizer.decode(walk.token_ids)
        assert matcher.is_accepting and not matcher.error, (seed, text)
        shown, parsed = counting_parser(fmt).parse(text)
        assert all(call.ok for call in parsed), (seed, text, parsed)
        if choice == "none":
            assert not parsed
        elif choice != "auto":
            assert parsed, (seed, text)
        if choice == {"name": "add"}:
            assert {call.name for call in parsed} == {"add"}
        if not parallel:
            assert len(parsed) <= 1, (seed, text)
        for call in parsed:
            tool = next(t for t in TOOLS if t.name == call.name)
            assert set(call.arguments) == set(tool.parameters["required"]), (seed, text)


def test_qwen_grammar_lets_the_model_write_its_tag_tokens(qwen_tokenizer):
    """Qwen2.5's <tool_call> and </tool_call> are single added tokens, which llguidance never
    matches as text: the format, bound to the vocabulary, names them by id."""
    fmt = format_for_tokenizer(qwen_tokenizer)
    assert fmt.name == "hermes"
    open_id, close_id = (
        qwen_tokenizer.backend.token_to_id(t) for t in ("<tool_call>", "</tool_call>")
    )
    assert fmt.markup_token_ids == {"<tool_call>": open_id, "</tool_call>": close_id}
    tok = qwen_tokenizer
    backend = GrammarBackend(tok.backend.to_str(), tok.vocab_size, frozenset(tok.eos_token_ids))
    short = short_token_ids(tok)
    for choice in ("auto", "required"):
        spec = tool_call_grammar(TOOLS, choice, tool_format=fmt)
        minimum = backend.min_tokens(spec)
        reply = [
            open_id,
            *tok.encode('\n{"name": "add", "arguments": {"a": 17, "b": 25}}\n'),
            close_id,
        ]
        matcher = backend.new_matcher(spec)
        assert all(matcher.accept(t) for t in reply) and matcher.is_accepting
        for seed in range(8):
            matcher = backend.new_matcher(spec, minimum + seed * 5)
            walk = Walk(backend, matcher, short, seed)
            text = tok.decode(walk.token_ids)
            assert matcher.is_accepting, (seed, text)
            _, parsed = counting_parser(fmt).parse(text)
            assert all(call.ok for call in parsed) and (parsed or choice == "auto"), (seed, text)


# ---- the real model ----------------------------------------------------------------------------


@pytest.mark.slow
@needs_qwen
async def test_qwen_calls_add_with_tool_choice_auto():
    from agentx import Engine, SamplingParams, Session

    engine = Engine(EngineConfig(model=QWEN_GGUF, max_model_len=2048))
    try:
        greedy = SamplingParams(max_tokens=40, temperature=0.0)
        async with Session(engine, tools=[add], sampling=greedy) as session:
            assert session.tool_format.name == "hermes"
            reply = await session.send("What is 17 plus 25? Use the add tool.", tool_choice="auto")
        got = [(c.name, c.arguments) for c in reply.tool_calls]
        assert got == [("add", {"a": 17, "b": 25})], reply.content
    finally:
        engine.close()
