"""Tools: schemas from signatures and docstrings, explicit schemas, argument checks, invoke."""

import threading
from typing import Annotated, Literal

import anyio
import pytest
from pydantic import BaseModel, Field

from agentx.errors import InvalidRequestError
from agentx.session.tools import Tool, ToolArgumentsError, make_tools, tool


class Point(BaseModel):
    x: int
    y: int = 0


def everything(
    count: int,
    ratio: float,
    label: str,
    flag: bool,
    tags: list[str],
    mode: Literal["fast", "slow"],
    limit: int | None = None,
    point: Point | None = None,
    scale: float = 1.5,
) -> dict:
    """Exercise every kind of parameter.

    The second paragraph is not part of the description.

    Args:
        count: How many.
        ratio (float): A ratio
            that spans two lines.
        label: The label.

    Returns:
        Everything it was given.
    """
    return {"count": count, "point": point, "mode": mode, "tags": tags}


def test_schema_from_signature_types_defaults_and_docstring():
    t = Tool.from_function(everything)
    assert t.name == "everything"
    assert t.description == "Exercise every kind of parameter."
    assert t.parameters == {
        "$defs": {
            "Point": {
                "properties": {"x": {"type": "integer"}, "y": {"default": 0, "type": "integer"}},
                "required": ["x"],
                "title": "Point",
                "type": "object",
            }
        },
        "additionalProperties": False,
        "properties": {
            "count": {"description": "How many.", "type": "integer"},
            "ratio": {"description": "A ratio that spans two lines.", "type": "number"},
            "label": {"description": "The label.", "type": "string"},
            "flag": {"type": "boolean"},
            "tags": {"items": {"type": "string"}, "type": "array"},
            "mode": {"enum": ["fast", "slow"], "type": "string"},
            "limit": {"anyOf": [{"type": "integer"}, {"type": "null"}], "default": None},
            "point": {"anyOf": [{"$ref": "#/$defs/Point"}, {"type": "null"}], "default": None},
            "scale": {"default": 1.5, "type": "number"},
        },
        "required": ["count", "ratio", "label", "flag", "tags", "mode"],
        "type": "object",
    }


def test_annotated_field_description_wins_over_docstring():
    def search(
        query: Annotated[str, Field(description="What to look for.")],
        title: str = "",
    ) -> str:
        """Search.

        Args:
            query: Ignored, Annotated wins.
            title: A parameter named like a JSON schema keyword.
        """
        return query

    t = Tool.from_function(search)
    assert t.parameters["properties"] == {
        "query": {"description": "What to look for.", "type": "string"},
        "title": {
            "default": "",
            "description": "A parameter named like a JSON schema keyword.",
            "type": "string",
        },
    }


def test_no_docstring_and_overrides():
    def add(a: int, b: int) -> int:
        return a + b

    assert Tool.from_function(add).description == ""
    t = Tool.from_function(add, name="plus", description="Adds.")
    assert (t.name, t.description) == ("plus", "Adds.")
    assert t.to_dict() == {"name": "plus", "description": "Adds.", "parameters": t.parameters}
    assert t.to_openai() == {"type": "function", "function": t.to_dict()}


def test_decorator_forms():
    @tool
    def ping() -> str:
        """Ping."""
        return "pong"

    @tool(name="renamed", description="Custom.")
    def other(a: int) -> int:
        return a

    assert isinstance(ping, Tool) and ping.name == "ping" and ping.description == "Ping."
    assert ping.parameters == {"additionalProperties": False, "properties": {}, "type": "object"}
    assert (other.name, other.description) == ("renamed", "Custom.")
    assert ping() == "pong" and other(3) == 3  # a Tool still calls its function


async def test_invoke_sync_runs_in_a_worker_thread():
    loop_thread = threading.get_ident()

    def where(n: int) -> dict:
        return {"n": n, "same_thread": threading.get_ident() == loop_thread}

    assert await Tool.from_function(where).invoke({"n": "7"}) == '{"n":7,"same_thread":false}'


async def test_invoke_async_function_and_async_callable_object():
    async def double(n: int) -> int:
        await anyio.sleep(0)
        return 2 * n

    class Echo:
        async def __call__(self, text: str) -> str:
            return text

    assert await Tool.from_function(double).invoke({"n": 4}) == "8"
    assert await Tool.from_function(Echo(), name="echo").invoke({"text": "héllo"}) == "héllo"


def test_invoke_under_trio():
    async def shout(text: str) -> str:
        return text.upper()

    def whisper(text: str) -> str:
        return text.lower()

    async def main() -> list[str]:
        return [
            await Tool.from_function(shout).invoke({"text": "a"}),
            await Tool.from_function(whisper).invoke({"text": "B"}),
        ]

    assert anyio.run(main, backend="trio") == ["A", "b"]


@pytest.mark.parametrize(
    ("value", "text"),
    [
        ("plain", "plain"),
        ({"a": [1, 2.5, None]}, '{"a":[1,2.5,null]}'),
        ([1, "x"], '[1,"x"]'),
        (3, "3"),
        (True, "true"),
        (None, "null"),
        (Point(x=1), '{"x":1,"y":0}'),
        ({"p": Point(x=2, y=3)}, '{"p":{"x":2,"y":3}}'),
    ],
)
async def test_invoke_converts_results_to_text(value, text):
    def give() -> object:
        return value

    assert await Tool.from_function(give).invoke({}) == text


async def test_pydantic_model_argument_is_validated_into_the_model():
    t = Tool.from_function(everything)
    arguments = {
        "count": 1,
        "ratio": 0.5,
        "label": "l",
        "flag": True,
        "tags": ["a"],
        "mode": "fast",
        "point": {"x": 3},
    }
    assert (
        await t.invoke(arguments) == '{"count":1,"point":{"x":3,"y":0},"mode":"fast","tags":["a"]}'
    )


@pytest.mark.parametrize(
    ("arguments", "detail"),
    [
        (
            {"a": "x", "b": 1},
            "a: Input should be a valid integer, unable to parse string as an integer",
        ),
        ({"a": 1}, "b: Field required"),
        ({"a": 1, "b": 2, "c": 3}, "c: Extra inputs are not permitted"),
        (["a"], "Input should be a valid dictionary or instance of add"),
    ],
)
async def test_invoke_rejects_bad_arguments(arguments, detail):
    def add(a: int, b: int) -> int:
        return a + b

    with pytest.raises(ToolArgumentsError) as info:
        await Tool.from_function(add).invoke(arguments)
    assert str(info.value) == f"invalid arguments for tool 'add': {detail}"
    assert (info.value.tool_name, info.value.detail) == ("add", detail)


async def test_awkward_parameter_names_and_positional_only():
    def odd(_hidden: int, /, json: str, model_name: str = "m") -> str:
        return f"{_hidden} {json} {model_name}"

    t = Tool.from_function(odd)
    assert list(t.parameters["properties"]) == ["_hidden", "json", "model_name"]
    assert await t.invoke({"_hidden": 1, "json": "j"}) == "1 j m"


def test_from_function_rejects_var_args_and_bad_names():
    def spread(*items: int) -> int:
        return 0

    with pytest.raises(TypeError, match=r"\*args or \*\*kwargs \(items\)"):
        Tool.from_function(spread)
    with pytest.raises(InvalidRequestError, match="pass name="):
        Tool.from_function(lambda: 1)


async def test_from_schema_checks_top_level_and_runs_the_function():
    def lookup(city: str) -> str:
        return city

    parameters = {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    }
    t = Tool.from_schema("lookup", "Find a city.", parameters, fn=lookup)
    assert t.parameters is parameters
    assert await t.invoke({"city": "Paris"}) == "Paris"
    with pytest.raises(ToolArgumentsError, match="city: Field required; x: Extra inputs"):
        await t.invoke({"x": 1})
    with pytest.raises(TypeError, match="has no function"):
        await Tool.from_schema("remote", "", parameters).invoke({"city": "Paris"})


@pytest.mark.parametrize(
    "parameters",
    [{"type": "string"}, {"properties": {}}, {"type": "object", "required": "city"}, "object"],
)
def test_from_schema_rejects_non_object_schemas(parameters):
    with pytest.raises(InvalidRequestError, match="parameters must be an object schema"):
        Tool.from_schema("bad", "", parameters)


def test_make_tools_from_functions_tools_and_dicts():
    def add(a: int, b: int) -> int:
        return a + b

    openai_style = {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "Weather.",
            "parameters": {"type": "object"},
        },
    }
    flat = {"name": "noargs", "description": "No arguments."}
    tools = make_tools([add, Tool.from_function(everything), openai_style, flat])
    assert list(tools) == ["add", "everything", "weather", "noargs"]
    assert tools["weather"].to_dict() == {
        "name": "weather",
        "description": "Weather.",
        "parameters": {"type": "object"},
    }
    assert tools["noargs"].parameters == {"type": "object", "properties": {}}
    assert tools["weather"].fn is None
    assert make_tools(None) == {}


def test_make_tools_rejects_duplicates_and_junk():
    def add(a: int) -> int:
        return a

    with pytest.raises(ValueError, match="two tools are named 'add'"):
        make_tools([add, Tool.from_function(add)])
    with pytest.raises(InvalidRequestError, match="a tool must be a function, a Tool or a dict"):
        make_tools([3])
    with pytest.raises(InvalidRequestError, match="a tool dict needs a 'name' string"):
        make_tools([{"type": "function", "function": {"description": "nameless"}}])
