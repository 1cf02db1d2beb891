"""The (legacy) Completions API, ``POST /v1/completions``: a raw prompt in, its continuation out.

What makes a base model (no chat template) usable over the API, in the shape vLLM's,
llama-cpp-python's and SGLang's servers answer it::

    prompt       a string, a list of strings, token ids, or a list of token-id lists; each
                 prompt is ``n`` choices (choice index = prompt index * n + k)
    suffix       fill-in-the-middle: the prompt becomes <prefix-token> prompt <suffix-token>
                 suffix <middle-token>, for a model whose vocabulary has FIM tokens; else 400
    echo         the prompt's text is put before the output
    logprobs     0 to 5: every output token's logprob and the top ones (with echo, the
                 prompt's tokens too, the first with a null logprob), in the legacy shape
                 (tokens, token_logprobs, top_logprobs, text_offset); raw model logprobs
    max_tokens   default 16 (OpenAI's), capped by the context left
    stop, temperature, top_p, top_k, seed, stream, stream_options.include_usage

Bodies are JSON-ready dicts (a stream chunk is the same ``text_completion`` object with the
new text, ``finish_reason`` null until the choice ends). Prompts are tokenized in a worker
thread and salted by tenant as chat requests are (service.py). It does not know HTTP.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from agentx.engine.backend import EngineBackend
from agentx.engine.request import RequestOptions
from agentx.engine.streams import RequestStream
from agentx.errors import InvalidRequestError
from agentx.openai.requests import (
    parse_int,
    parse_max_tokens,
    parse_sampling,
    parse_tenant,
)
from agentx.openai.service import (
    ChatService,
    ChunkStream,
    cache_salt,
    choice_sampling,
    prepare_off_loop,
)
from agentx.openai.timing import RequestClock

__all__ = ["CompletionService", "fim_tokens"]

DEFAULT_MAX_TOKENS = 16
_MAX_CHOICES = 16
_FIM_TOKEN_SETS = (
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, SmolLM2
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder
    ("<|fim_begin|>", "<|fim_hole|>", "<|fim_end|>"),  # DeepSeek-Coder (ASCII spelling)
)
_MAX_LOGPROBS = 5  # OpenAI's limit for this route's ``logprobs``
_REFUSED = {
    "best_of": "best_of is not supported",
    "logit_bias": "logit_bias is not supported",
    "presence_penalty": "presence_penalty is not supported",
    "frequency_penalty": "frequency_penalty is not supported",
}


@dataclass(slots=True)
class _Choice:
    index: int
    prompt_text: str  # what echo shows
    stream: RequestStream

    @property
    def first_token_id(self) -> int | None:
        ids = self.stream.prompt_token_ids
        return ids[0] if ids else None


@dataclass(slots=True)
class _Call:
    header: dict[str, Any]
    choices: list[_Choice]
    num_prompt_tokens: int
    echo: bool
    include_usage: bool
    clock: RequestClock | None
    token_text: Callable[[int], str] | None = None  # set when the request asked for logprobs


def fim_tokens(engine: EngineBackend) -> tuple[int, int, int] | None:
    """The (prefix, suffix, middle) token ids of the model's fill-in-the-middle format."""
    backend = engine.tokenizer.backend
    for names in _FIM_TOKEN_SETS:
        ids = [backend.token_to_id(name) for name in names]
        if all(i is not None for i in ids):
            return ids[0], ids[1], ids[2]
    return None


class CompletionService:
    """``/v1/completions`` on ``chat``'s engine, tenants and timing."""

    def __init__(self, chat: ChatService) -> None:
        self.chat = chat

    async def create(self, body: object, tenant: str | None = None) -> dict[str, Any]:
        call = await self._start(body, tenant)
        try:
            choices = [await self._collect(call, choice) for choice in call.choices]
        finally:
            self._end(call)
        return {**call.header, "choices": choices, "usage": self._usage(call)}

    async def open_stream(self, body: object, tenant: str | None = None) -> ChunkStream:
        call = await self._start(body, tenant)
        return ChunkStream(self._chunks(call), lambda: self._end(call))

    # ---- one call ----------------------------------------------------------------------------

    async def _start(self, body: object, tenant: str | None) -> _Call:
        engine = await self.chat.get_engine()
        return await prepare_off_loop(self._prepare, self._end, engine, body, tenant)

    def _prepare(self, engine: EngineBackend, body: object, tenant: str | None) -> _Call:
        if not isinstance(body, Mapping):
            raise InvalidRequestError("the request body must be a JSON object")
        for name, reason in _REFUSED.items():
            value = body.get(name)
            if value not in (None, False, 0, 0.0, {}) and not (name == "best_of" and value == 1):
                raise InvalidRequestError(f"{name}: {reason}")
        clock = RequestClock()
        n = parse_int(body, "n", 1)
        if not 1 <= n <= _MAX_CHOICES:
            raise InvalidRequestError(f"n must be between 1 and {_MAX_CHOICES}, got {n}")
        prompts = [self._encode(engine, p, body.get("suffix")) for p in _prompts(body)]
        sampling = parse_sampling(body)
        logprobs = _logprobs(body)
        if logprobs is not None:  # with echo, the prompt's tokens are scored too
            echo = bool(body.get("echo"))
            sampling = replace(
                sampling, logprobs=logprobs, prompt_logprobs=logprobs if echo else None
            )
        max_tokens = parse_max_tokens(body) or DEFAULT_MAX_TOKENS
        salt = cache_salt(tenant, parse_tenant(body))
        stream_options = body.get("stream_options") or {}
        model = body.get("model")
        header = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": model if isinstance(model, str) and model else self.chat.model_name,
        }
        call = _Call(header, [], 0, bool(body.get("echo")), False, clock)
        if logprobs is not None:
            call.token_text = engine.tokenizer.token_to_text
        call.include_usage = isinstance(stream_options, Mapping) and bool(
            stream_options.get("include_usage")
        )
        try:
            for p, (ids, text) in enumerate(prompts):
                budget = max(1, min(max_tokens, engine.max_model_len - len(ids)))
                call.num_prompt_tokens += len(ids)
                for k in range(n):
                    seeded = choice_sampling(replace(sampling, max_tokens=budget), k)
                    options = RequestOptions(cache_salt=salt)
                    stream = engine.add_request(ids, seeded, options=options)
                    call.choices.append(_Choice(p * n + k, text, stream))
        except BaseException:
            self._end(call)
            raise
        return call

    def _encode(
        self, engine: EngineBackend, prompt: str | list[int], suffix: Any
    ) -> tuple[list, str]:
        """The prompt's token ids and the text echo shows."""
        tokenizer = engine.tokenizer
        if suffix is not None and not isinstance(suffix, str):
            raise InvalidRequestError("suffix must be a string")
        if isinstance(prompt, list):
            if suffix:
                raise InvalidRequestError("suffix needs a text prompt, not token ids")
            vocab = tokenizer.vocab_size
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:  # checked before decoding: a negative id is an OverflowError there
                raise InvalidRequestError(
                    f"token ids outside the vocabulary [0, {vocab}): {bad[:5]}"
                )
            return prompt, tokenizer.decode(prompt)
        self.chat.check_text_fits(engine, len(prompt) + len(suffix or ""))
        if not suffix:
            return tokenizer.encode(prompt, add_special_tokens=True), prompt
        fim = fim_tokens(engine)
        if fim is None:
            raise InvalidRequestError("suffix: this model has no fill-in-the-middle tokens")
        prefix_id, suffix_id, middle_id = fim
        ids = [prefix_id, *tokenizer.encode(prompt), suffix_id, *tokenizer.encode(suffix)]
        return [*ids, middle_id], prompt

    async def _collect(self, call: _Call, choice: _Choice) -> dict[str, Any]:
        parts = [choice.prompt_text] if call.echo else []
        records: list = []
        async for out in choice.stream:
            call.clock.tick(len(out.new_token_ids))
            parts.append(out.new_text)
            records += [*(out.prompt_logprobs if call.echo else ()), *out.logprobs]
        logprobs = _legacy_logprobs(records, call.token_text, choice.first_token_id)
        return _choice(choice.index, "".join(parts), _finish_reason(choice.stream), logprobs)

    async def _chunks(self, call: _Call) -> AsyncIterator[dict[str, Any]]:
        try:
            for choice in call.choices:
                # with logprobs the echo waits for the first delta: it carries the prompt's
                echo = call.echo and bool(choice.prompt_text)
                if echo and call.token_text is None:
                    yield {**call.header, "choices": [_choice(choice.index, choice.prompt_text)]}
                    echo = False
                async for out in choice.stream:
                    call.clock.tick(len(out.new_token_ids))
                    if echo:
                        lps = _legacy_logprobs(
                            list(out.prompt_logprobs), call.token_text, choice.first_token_id
                        )
                        text = choice.prompt_text
                        yield {**call.header, "choices": [_choice(choice.index, text, None, lps)]}
                        echo = False
                    if out.new_text or (call.token_text and out.logprobs):
                        lps = _legacy_logprobs(list(out.logprobs), call.token_text)
                        pieces = _choice(choice.index, out.new_text, None, lps)
                        yield {**call.header, "choices": [pieces]}
                reason = _finish_reason(choice.stream)
                yield {**call.header, "choices": [_choice(choice.index, "", reason)]}
            if call.include_usage:
                yield {**call.header, "choices": [], "usage": self._usage(call)}
        finally:
            self._end(call)

    def _end(self, call: _Call) -> None:
        if call.clock is not None:
            clock, call.clock = call.clock, None
            self.chat.finish_timing("completions", clock, call.num_prompt_tokens)
        engine = self.chat.engine
        for choice in call.choices:
            if not choice.stream.finished:
                engine.abort(choice.stream.request_id)

    @staticmethod
    def _usage(call: _Call) -> dict[str, int]:
        outputs = [c.stream.final for c in call.choices if c.stream.final is not None]
        completion = sum(out.num_output_tokens for out in outputs)
        cached = sum(out.num_cached_tokens for out in outputs)
        return {
            "prompt_tokens": call.num_prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": call.num_prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }


def _prompts(body: Mapping) -> list[str | list[int]]:
    """``prompt`` as a list of prompts (each a string or token ids)."""
    raw = body.get("prompt")
    if isinstance(raw, str):
        return [raw]
    if isinstance(raw, list) and raw:
        if all(_is_token(t) for t in raw):
            return [list(raw)]
        if all(isinstance(p, str) for p in raw):
            return list(raw)
        if all(isinstance(p, list) and p and all(_is_token(t) for t in p) for p in raw):
            return [list(p) for p in raw]
    raise InvalidRequestError(
        "prompt must be a string, a list of strings, token ids or a list of token-id lists"
    )


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _finish_reason(stream: RequestStream) -> str:
    final = stream.final
    reason = final.finish_reason if final is not None else "stop"
    return reason if reason in ("stop", "length") else "stop"


def _logprobs(body: Mapping) -> int | None:
    """``logprobs`` (0 to 5 top tokens a position, as OpenAI's legacy route); None: off."""
    value = body.get("logprobs")
    if value is None:
        return None
    if not _is_token(value) or not 0 <= value <= _MAX_LOGPROBS:
        raise InvalidRequestError(f"logprobs must be an integer from 0 to {_MAX_LOGPROBS}")
    return value


def _legacy_logprobs(
    records: list, token_text: Callable[[int], str] | None, first_token_id: int | None = None
) -> dict | None:
    """The route's ``logprobs`` object for the engine's records: the tokens' texts, their
    logprobs, the top ones by text and each token's offset in the choice's text. An echoed
    prompt's first record is None (nothing before it predicts it): that token leads with a null
    logprob, as OpenAI's echo does (``first_token_id`` names it)."""
    if token_text is None:
        return None
    out: dict[str, list] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    offset = 0
    for record in records:
        token_id = first_token_id if record is None else record.token_id
        text = token_text(token_id)
        out["tokens"].append(text)
        out["token_logprobs"].append(None if record is None else record.logprob)
        top = (
            None if record is None or not record.top else {token_text(t): v for t, v in record.top}
        )
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def _choice(
    index: int, text: str, finish_reason: str | None = None, logprobs: dict | None = None
) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
