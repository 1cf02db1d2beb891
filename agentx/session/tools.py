"""Tools an agent can call: typed Python functions (sync or async) or explicit JSON schemas.

This file owns ``Tool`` (name, description, an object JSON schema, an optional function), how a
function's signature and Google-style docstring become that schema (through a pydantic model),
how a call's arguments are validated and bound, and how a result becomes text. It does not know
how tools are shown to a model or how calls are parsed out of its output (``tool_calls.py``).
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Annotated, Any, get_args, get_origin, overload

import anyio.to_thread
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model
from pydantic.fields import FieldInfo
from pydantic.json_schema import GenerateJsonSchema
from pydantic_core import to_json

from agentx.errors import InvalidRequestError

__all__ = ["Tool", "ToolArgumentsError", "make_tools", "tool"]

Fn = Callable[..., Any]
Schema = dict[str, Any]

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_ARGS_HEADERS = {"args:", "arguments:", "parameters:", "params:"}
_ARG_LINE = re.compile(r"^\*{0,2}(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")


class ToolArgumentsError(InvalidRequestError):
    """A call's arguments do not match the tool's schema; the message is meant for the model.
    (An InvalidRequestError, so also a ValueError.)"""

    def __init__(self, tool_name: str, detail: str) -> None:
        super().__init__(f"invalid arguments for tool {tool_name!r}: {detail}")
        self.tool_name = tool_name
        self.detail = detail


class Tool:
    """A callable tool: ``fn`` is None for a schema-only tool, whose calls the caller executes."""

    __slots__ = ("name", "description", "parameters", "fn", "_binder", "_is_async")

    def __init__(self, name: str, description: str, parameters: Schema, fn: Fn | None = None):
        self.name = _check_name(name)
        self.description = description
        self.parameters = _check_object_schema(name, parameters)
        self.fn = fn
        self._binder: _FunctionArguments | _SchemaArguments = _SchemaArguments.of(parameters)
        self._is_async = _is_async(fn)

    @classmethod
    def from_function(cls, fn: Fn, name: str | None = None, description: str | None = None) -> Tool:
        """Schema from the signature's type hints; description and argument docs from the
        docstring's first paragraph and its ``Args:`` section (``Annotated[..., Field(...)]``
        descriptions win over the docstring)."""
        summary, arg_docs = _parse_docstring(inspect.getdoc(fn) or "")
        binder = _FunctionArguments.of(fn, arg_docs)
        name = name or getattr(fn, "__name__", "")
        new = cls(name, summary if description is None else description, binder.schema(), fn)
        new._binder = binder
        return new

    @classmethod
    def from_schema(
        cls, name: str, description: str, parameters: Schema, fn: Fn | None = None
    ) -> Tool:
        """A tool from an explicit object schema; only its top level is checked on invoke."""
        return cls(name, description, parameters, fn)

    @classmethod
    def from_dict(cls, spec: Schema, fn: Fn | None = None) -> Tool:
        """From an OpenAI ``{"type": "function", "function": {...}}`` dict, or a flat
        ``{"name", "description", "parameters"}`` one (Anthropic's ``input_schema`` too)."""
        function = spec.get("function") if spec.get("type") == "function" else spec
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidRequestError(f"a tool dict needs a 'name' string: {spec!r}")
        parameters = function.get("parameters", function.get("input_schema"))
        parameters = {"type": "object", "properties": {}} if parameters is None else parameters
        return cls(function["name"], function.get("description") or "", parameters, fn)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "parameters": self.parameters}

    def to_openai(self) -> dict[str, Any]:
        return {"type": "function", "function": self.to_dict()}

    async def invoke(self, arguments: dict[str, Any]) -> str:
        """Validate ``arguments``, run the function and return its result as text.

        Sync functions run in a worker thread so the event loop never blocks; cancelling the
        caller abandons that thread (it runs on, its result is dropped), so a hung sync tool
        never hangs the agent loop. Raises
        ``ToolArgumentsError`` for bad arguments, ``TypeError`` for a schema-only tool, and
        whatever the function itself raises.
        """
        if self.fn is None:
            raise TypeError(f"tool {self.name!r} has no function; the caller executes its calls")
        args, kwargs = self._binder.bind(self.name, arguments)
        if self._is_async:
            result = await self.fn(*args, **kwargs)
        else:
            result = await anyio.to_thread.run_sync(
                functools.partial(self.fn, *args, **kwargs), abandon_on_cancel=True
            )
        return _to_text(result)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.fn is None:
            raise TypeError(f"tool {self.name!r} has no function")
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"Tool(name={self.name!r}, description={self.description!r})"


@overload
def tool(fn: Fn, /) -> Tool: ...
@overload
def tool(*, name: str | None = None, description: str | None = None) -> Callable[[Fn], Tool]: ...
def tool(
    fn: Fn | None = None, /, *, name: str | None = None, description: str | None = None
) -> Tool | Callable[[Fn], Tool]:
    """``@tool`` or ``@tool(name=..., description=...)``: turn a function into a ``Tool``."""
    if fn is not None:
        return Tool.from_function(fn, name, description)
    return lambda f: Tool.from_function(f, name, description)


def make_tools(items: Iterable[Tool | Fn | Schema] | None) -> dict[str, Tool]:
    """Tools by name from functions, ``Tool``s and tool dicts; a repeated name is an error."""
    tools: dict[str, Tool] = {}
    for item in items or ():
        new = _as_tool(item)
        if new.name in tools:
            raise InvalidRequestError(f"two tools are named {new.name!r}")
        tools[new.name] = new
    return tools


def _as_tool(item: Any) -> Tool:
    if isinstance(item, Tool):
        return item
    if isinstance(item, dict):
        return Tool.from_dict(item)
    if callable(item):
        return Tool.from_function(item)
    raise InvalidRequestError(f"a tool must be a function, a Tool or a dict, not {item!r}")


@dataclass(frozen=True, slots=True)
class _FunctionArguments:
    """Validates arguments with a pydantic model built from a signature, then binds them.

    Fields are ``p0, p1, ...`` aliased to the parameter names: ``_x`` or ``json`` work too."""

    model: type[BaseModel]
    names: tuple[str, ...]
    num_positional_only: int

    @classmethod
    def of(cls, fn: Fn, arg_docs: dict[str, str]) -> _FunctionArguments:
        fields: dict[str, Any] = {}
        params = list(inspect.signature(fn, eval_str=True).parameters.values())
        for i, param in enumerate(params):
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                raise TypeError(f"tool functions cannot take *args or **kwargs ({param.name})")
            annotation = Any if param.annotation is param.empty else param.annotation
            # Passing description=None would erase one given in Annotated[..., Field(...)].
            doc = None if _has_description(annotation) else arg_docs.get(param.name)
            extra = {"description": doc} if doc else {}
            default = ... if param.default is param.empty else param.default
            fields[f"p{i}"] = (annotation, Field(default, alias=param.name, **extra))
        config = ConfigDict(extra="forbid")
        model = create_model(getattr(fn, "__name__", "tool"), __config__=config, **fields)
        num_positional_only = sum(p.kind == p.POSITIONAL_ONLY for p in params)
        return cls(model, tuple(p.name for p in params), num_positional_only)

    def schema(self) -> Schema:
        schema = self.model.model_json_schema(schema_generator=_NoFieldTitles)
        schema.pop("title", None)  # the generated model's name, not the tool's
        return schema

    def bind(self, tool_name: str, arguments: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        try:
            validated = self.model.model_validate(arguments)
        except ValidationError as exc:
            raise ToolArgumentsError(tool_name, _summarize(exc)) from exc
        values = [getattr(validated, f"p{i}") for i in range(len(self.names))]
        k = self.num_positional_only
        return tuple(values[:k]), dict(zip(self.names[k:], values[k:], strict=True))


@dataclass(frozen=True, slots=True)
class _SchemaArguments:
    """Checks only what an explicit schema states at its top level: required and extra keys."""

    required: tuple[str, ...]
    allowed: frozenset[str] | None  # None: additional properties are allowed

    @classmethod
    def of(cls, parameters: Schema) -> _SchemaArguments:
        closed = parameters.get("additionalProperties") is False
        allowed = frozenset(parameters.get("properties", {})) if closed else None
        return cls(tuple(parameters.get("required", ())), allowed)

    def bind(self, tool_name: str, arguments: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if not isinstance(arguments, dict):
            raise ToolArgumentsError(tool_name, "arguments must be a JSON object")
        problems = [f"{n}: Field required" for n in self.required if n not in arguments]
        if self.allowed is not None:
            extra = [n for n in arguments if n not in self.allowed]
            problems += [f"{n}: Extra inputs are not permitted" for n in extra]
        if problems:
            raise ToolArgumentsError(tool_name, "; ".join(problems))
        return (), dict(arguments)


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """The first paragraph, and argument descriptions from a Google-style ``Args:`` section."""
    summary: list[str] = []
    for line in doc.splitlines():
        if not line.strip() or line.strip().lower() in _ARGS_HEADERS:
            break
        summary.append(line.strip())
    return " ".join(summary), _parse_args_section(doc.splitlines())


def _parse_args_section(lines: list[str]) -> dict[str, str]:
    docs: dict[str, str] = {}
    header_indent: int | None = None
    entry_indent: int | None = None
    current = None
    for line in lines:
        stripped, indent = line.strip(), len(line) - len(line.lstrip())
        if header_indent is None:
            header_indent = indent if stripped.lower() in _ARGS_HEADERS else None
        elif stripped and indent <= header_indent:
            break  # the next section
        elif stripped:
            match = _ARG_LINE.match(stripped)
            if match and entry_indent in (None, indent):
                entry_indent, current = indent, match[1]
                docs[current] = match[2]
            elif current is not None:
                docs[current] = f"{docs[current]} {stripped}".strip()
    return docs


def _has_description(annotation: Any) -> bool:
    if get_origin(annotation) is not Annotated:
        return False
    return any(isinstance(m, FieldInfo) and m.description for m in get_args(annotation)[1:])


class _NoFieldTitles(GenerateJsonSchema):
    """Pydantic titles every field ("Title": "A"): noise in a prompt. Model titles stay."""

    def field_title_should_be_set(self, schema: Any) -> bool:
        return False


def _summarize(exc: ValidationError) -> str:
    parts = []
    for error in exc.errors(include_url=False):
        loc = ".".join(str(p) for p in error["loc"])
        parts.append(f"{loc}: {error['msg']}" if loc else error["msg"])
    return "; ".join(parts)


def _check_name(name: str) -> str:
    if isinstance(name, str) and _NAME.match(name):
        return name
    raise InvalidRequestError(f"tool name {name!r} must be 1-64 of [A-Za-z0-9_-] (pass name=...)")


def _check_object_schema(name: str, parameters: Any) -> Schema:
    if (
        isinstance(parameters, dict)
        and parameters.get("type") == "object"
        and isinstance(parameters.get("properties", {}), dict)
        and isinstance(parameters.get("required", []), list)
    ):
        return parameters
    raise InvalidRequestError(f"tool {name!r}: parameters must be an object schema: {parameters!r}")


def _is_async(fn: Fn | None) -> bool:
    # An object whose __call__ is ``async def`` is async too.
    call = inspect.getattr_static(fn, "__call__", None)
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(call)


def _to_text(value: Any) -> str:
    """A result for the model: a str as is, anything else (models, dicts, numbers) as JSON."""
    if isinstance(value, str):
        return value
    return to_json(value, fallback=str).decode()
