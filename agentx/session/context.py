"""One conversation's token history, kept so that every turn's prompt extends the last one.

Owns :class:`ChatContext`: a session's chat messages, the exact token ids the engine has seen
for them, and the template text those ids stand for. Agent traffic re-sends a growing
conversation every turn and the prefix cache reuses KV for any token prefix it has seen, so a
turn's prompt is the previous prompt + the ids the model generated + ids for the new text only:
generated text is never re-tokenized and earlier turns are never re-rendered. It knows the
tokenizer and its chat template; nothing about the engine, requests or async.

New text is found in template space, never by decoding tokens::

    token_ids  [ ...prompt... <|im_start|>assistant\\n ][ output ids ][ \\n ][ new suffix ids ]
    rendered   [ ...prompt... <|im_start|>assistant\\n ][ text<|im_end|>\\n ][ new suffix text ]
                                                         ^ the model wrote <|im_end|>; only
                                                           the missing closing is appended

``rendered`` is the template's text for what ``token_ids`` hold; where the two disagree (output
tokens past a stop string, a chunk tokenized apart from its neighbours) the ids are the truth
and ``rendered`` only serves to find where the next piece of template text starts.

When the template renders the history differently once a message is added (a message count in
the system header, a window over the last N messages, old reasoning dropped), the rendering no
longer starts with ``rendered``. The new text is then found by anchoring: the tail of the
template's own rendering of the history (without the new messages) is looked up in the new
rendering, right to left, and what follows it is the new text, accepted only if every new
message's content appears in it in order. Rendering the new messages behind placeholder
messages instead fails on the same templates (the count or the window still shifts), so the
anchor is taken from the real history. A template that writes new messages away from the end
(hoisting every system message to the top) cannot be followed and raises InvalidRequestError.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from enum import Enum
from typing import Any

from agentx.engine.models.tokenizer import Tokenizer
from agentx.errors import InvalidRequestError
from agentx.session.tool_formats import (
    ToolCallFormat,
    detect_tool_call_format,
    get_tool_call_format,
)

__all__ = ["ChatContext"]

# Stands in for an open message's content while its header and footer are found. The quote,
# newline, `<` and `&` make a template that escapes or transforms content (tojson, upper) lose
# it, so such templates are refused rather than followed with wrong text.
_SENTINEL = '[[agentx "open message"\n<&>]]'

# Tail lengths (characters) of the history's rendering tried as anchors, longest first: a long
# anchor rarely matches by chance, a short one survives a template that rewrites the last
# message's start (dropped reasoning).
_ANCHOR_SIZES = (256, 64, 16)


class _Phase(Enum):
    IDLE = "idle"  # ready for prompt_for or open_message
    GENERATING = "generating"  # a prompt was returned; commit_output closes the turn
    OPEN = "open"  # a streamed message is open; append_to_open / close_message


class ChatContext:
    """Messages, exact token history and rendered text of one conversation.

    Every method only appends: ids once returned never change. Misuse (a prompt while a turn
    or a streamed message is open) raises InvalidRequestError and leaves the context unchanged.
    Not thread-safe; one session owns it.
    """

    __slots__ = (
        "_last_prompt_len",
        "_messages",
        "_open_footer",
        "_phase",
        "_rendered",
        "_token_ids",
        "_tokenizer",
        "_tools",
    )

    def __init__(
        self,
        tokenizer: Tokenizer,
        system: str | None = None,
        tools_prompt: str | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self._tools = tools  # for templates that render tools themselves
        self._messages: list[dict[str, Any]] = []
        self._token_ids: list[int] = []
        self._rendered = ""
        self._phase = _Phase.IDLE
        self._last_prompt_len = 0
        self._open_footer = ""
        parts = [text for text in (system, tools_prompt) if text]
        if parts:
            self._messages.append({"role": "system", "content": "\n\n".join(parts)})

    @classmethod
    def with_tools(
        cls,
        tokenizer: Tokenizer,
        system: str | None,
        tools: list[dict[str, Any]] | None,
        tool_format: ToolCallFormat | None = None,
    ) -> ChatContext:
        """A context whose first message offers ``tools`` (``Tool.to_dict()`` dicts) the way
        the model expects: a template that renders tools gets them (in the shape the format's
        family expects; Qwen's lists them in its system turn), otherwise (SmolLM2) the system
        message carries the format's own function-calling prompt after ``system``.
        ``tool_format`` defaults to the one detected from the template."""
        fmt = tool_format or detect_tool_call_format(tokenizer.chat_template)
        native = bool(tools) and "tools" in (tokenizer.chat_template or "")
        if not tools:
            return cls(tokenizer, system)
        if native:
            return cls(tokenizer, system, tools=fmt.template_tools(tools))
        tools_prompt = fmt.tools_system_prompt(tools)
        if tools_prompt is None:  # the format expects the template to list them; it cannot
            tools_prompt = get_tool_call_format("smollm2").tools_system_prompt(tools)
        return cls(tokenizer, system, tools_prompt)

    # --- state ------------------------------------------------------------------------------

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The template dicts so far (a copy); assistant contents as :meth:`commit_output`
        stored them."""
        return copy.deepcopy(self._messages)

    @property
    def token_ids(self) -> list[int]:
        """The exact token history (a copy): what the engine has seen or will see."""
        return list(self._token_ids)

    @property
    def rendered(self) -> str:
        """The template text ``token_ids`` stand for."""
        return self._rendered

    @property
    def num_tokens(self) -> int:
        return len(self._token_ids)

    @property
    def last_prompt_len(self) -> int:
        """Length of the last prompt :meth:`prompt_for` returned (0 before the first)."""
        return self._last_prompt_len

    def fork(self) -> ChatContext:
        """An independent copy with the same history (a subagent starts from here)."""
        other = copy.copy(self)
        other._messages = copy.deepcopy(self._messages)
        other._token_ids = list(self._token_ids)
        return other

    def check_integrity(self) -> None:
        """Raise AssertionError if the state machine or the lengths disagree."""
        assert self._last_prompt_len <= len(self._token_ids)
        if self._phase is _Phase.OPEN:
            assert self._messages, "an open message is the last message"
        else:
            assert not self._open_footer, "a footer waits only while a message is open"
        if self._phase is _Phase.GENERATING:
            assert self._last_prompt_len == len(self._token_ids)

    # --- turns ------------------------------------------------------------------------------

    def prompt_for(self, new_messages: Sequence[dict[str, Any]]) -> list[int]:
        """Append ``new_messages`` (user, tool results, system) and return the whole prompt:
        the old ``token_ids`` + the ids of the new template text, generation prompt included.

        ``prompt_for([])`` adds just the generation prompt (after a streamed tool result).
        Raises InvalidRequestError while a turn or a streamed message is open, or when the
        template does not write the new messages at the end of the conversation.
        """
        self._require(_Phase.IDLE, "prompt_for")
        added = [dict(message) for message in new_messages]
        after = self._render([*self._messages, *added], add_generation_prompt=True)
        delta = self._delta(after, _contents(added))
        if delta is None:
            raise InvalidRequestError(
                "the chat template does not render the new messages at the end of the "
                "conversation, so the token history cannot be extended"
            )
        self._messages.extend(added)
        self._append_text(delta)
        self._phase = _Phase.GENERATING
        self._last_prompt_len = len(self._token_ids)
        return list(self._token_ids)

    def commit_output(
        self,
        output_ids: Sequence[int],
        text: str,
        finish_reason: str,
        tool_calls_text: str | None = None,
    ) -> list[int]:
        """Record the assistant turn the last prompt produced; return the closing ids appended.

        ``output_ids`` go into the history exactly as generated, every one of them (past a stop
        string too: the KV cache holds them). ``text`` is the turn's text without the
        end-of-turn token; ``tool_calls_text`` is raw tool-call markup a parser cut out of it,
        put back at its end. The stored content is that raw text, markup included, because that
        is what the model wrote: a structured ``tool_calls`` field would make the template
        print markup the model never saw. Then come the template's closing tokens the model did
        not write: when the turn ended on an end-of-turn id (``finish_reason`` "stop", or a
        grammar's budget that ended it there) the output already holds their start (SmolLM2:
        ``<|im_end|>``, so only ``\\n`` is added); otherwise (a length stop, a stop string, an
        abort with no output) all of them are.
        """
        self._require(_Phase.GENERATING, "commit_output")
        content = text if tool_calls_text is None else text + tool_calls_text
        message = {"role": "assistant", "content": content}
        template_text, closing = self._assistant_text(message)
        closing_ids = self._tokenizer.encode(closing)
        ended_turn = bool(output_ids) and output_ids[-1] in self._tokenizer.eos_token_ids
        if finish_reason in ("stop", "length") and ended_turn:
            closing_ids = closing_ids[_overlap(output_ids, closing_ids) :]
        self._messages.append(message)
        self._token_ids.extend(output_ids)
        self._token_ids.extend(closing_ids)
        self._rendered += template_text
        self._phase = _Phase.IDLE
        return closing_ids

    # --- streamed messages ------------------------------------------------------------------

    def open_message(self, role: str, **fields: Any) -> list[int]:
        """Start a message whose content arrives in chunks (a streamed tool result); append
        and return the ids of the template's header for it.

        ``fields`` go into the template dict besides role and content (``name``,
        ``tool_call_id``). Raises InvalidRequestError when the template's header and footer
        cannot be isolated (it escapes, transforms or repeats content).
        """
        self._require(_Phase.IDLE, "open_message")
        probe = {**fields, "role": role, "content": _SENTINEL}
        after = self._render([*self._messages, probe], add_generation_prompt=False)
        delta = self._delta(after, [_SENTINEL])
        if delta is None or delta.count(_SENTINEL) != 1:
            raise InvalidRequestError(
                f"the chat template does not write a {role!r} message's content verbatim between "
                "a header and a footer; send the message whole with prompt_for"
            )
        header, footer = delta.split(_SENTINEL)
        self._messages.append({**probe, "content": ""})
        self._open_footer = footer
        self._phase = _Phase.OPEN
        return self._append_text(header)

    def append_to_open(self, text: str) -> list[int]:
        """Append one chunk of the open message; return its ids.

        Only the chunk is tokenized, so a token that would span two chunks in the joined text
        is two tokens here. That is intended: the ids already sent stay the truth, and a later
        ``prompt_for`` extends them rather than re-tokenizing the joined content.
        """
        self._require(_Phase.OPEN, "append_to_open")
        self._messages[-1]["content"] += text
        return self._append_text(text)

    def close_message(self) -> list[int]:
        """Close the open message; append and return the ids of the template's footer."""
        self._require(_Phase.OPEN, "close_message")
        footer, self._open_footer = self._open_footer, ""
        self._phase = _Phase.IDLE
        return self._append_text(footer)

    # --- internals --------------------------------------------------------------------------

    def _require(self, phase: _Phase, action: str) -> None:
        if self._phase is not phase:
            raise InvalidRequestError(
                f"{action} needs the context {phase.value}, it is {self._phase.value}"
                " (commit_output closes a turn, close_message a streamed message)"
            )

    def _render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool) -> str:
        return self._tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tools=self._tools
        )

    def _append_text(self, text: str) -> list[int]:
        ids = self._tokenizer.encode(text)
        self._token_ids.extend(ids)
        self._rendered += text
        return ids

    def _delta(self, after: str, contents: list[str]) -> str | None:
        """The text ``after`` (this conversation plus something new, rendered) adds at its end.

        ``rendered`` is tried first; if the template re-rendered the history, its own current
        rendering of the history (with the generation prompt while a turn is open) is the
        anchor. None when the new contents are not all in what follows.
        """
        if after.startswith(self._rendered):
            delta = after[len(self._rendered) :]
            if _holds_in_order(delta, contents):
                return delta
        if not self._messages:
            return None
        before = self._render(
            self._messages, add_generation_prompt=self._phase is _Phase.GENERATING
        )
        return _anchored_delta(before, after, contents)

    def _assistant_text(self, message: dict[str, Any]) -> tuple[str, str]:
        """(the template's text for ``message`` after the open prompt, its closing part)."""
        after = self._render([*self._messages, message], add_generation_prompt=False)
        content = message["content"]
        delta = self._delta(after, _contents([message]))
        if delta is not None:
            core = content if content in delta else content.strip()
            return delta, delta[delta.find(core) + len(core) :]
        closing = self._end_of_turn_text()
        return content + closing, closing

    def _end_of_turn_text(self) -> str:
        """The end-of-turn token the template writes, for when its closing cannot be diffed."""
        tokenizer = self._tokenizer
        template = tokenizer.chat_template or ""
        texts = sorted(tokenizer.token_to_text(token_id) for token_id in tokenizer.eos_token_ids)
        for text in texts:
            if text in template:
                return text
        if tokenizer.eos_token:
            return tokenizer.eos_token
        raise InvalidRequestError("the chat template's end-of-turn text cannot be found")


def _contents(messages: Sequence[dict[str, Any]]) -> list[str]:
    """The text contents to look for in a rendering; stripped, since templates often trim."""
    texts = (message.get("content") for message in messages)
    return [text.strip() for text in texts if isinstance(text, str) and text.strip()]


def _holds_in_order(text: str, parts: list[str]) -> bool:
    start = 0
    for part in parts:
        found = text.find(part, start)
        if found < 0:
            return False
        start = found + len(part)
    return True


def _anchored_delta(before: str, after: str, contents: list[str]) -> str | None:
    """What ``after`` adds past the point where ``before``'s tail last appears in it.

    Occurrences are tried right to left and the first whose remainder holds ``contents`` in
    order wins: the shortest valid delta, so text that repeats inside the new messages cannot
    pull history into it. The anchor must end early enough to leave room for the contents.
    """
    if after.startswith(before):
        delta = after[len(before) :]
        return delta if _holds_in_order(delta, contents) else None
    limit = len(after) - sum(len(text) for text in contents)
    for size in sorted({min(size, len(before)) for size in _ANCHOR_SIZES}, reverse=True):
        anchor = before[-size:]
        start = after.rfind(anchor, 0, limit)
        while start >= 0:
            delta = after[start + size :]
            if _holds_in_order(delta, contents):
                return delta
            start = after.rfind(anchor, 0, start + size - 1)
    return None


def _overlap(output_ids: Sequence[int], closing_ids: list[int]) -> int:
    """How many leading closing ids the output already ends with."""
    for size in range(min(len(output_ids), len(closing_ids)), 0, -1):
        if list(output_ids[-size:]) == closing_ids[:size]:
            return size
    return 0
