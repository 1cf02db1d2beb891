"""Translating agentx's request records into vLLM's, and vLLM's outputs back.

Pure functions over small records; the only state they touch is the one request's
:class:`~agentx.engine.text_state.TextState`. Detokenizing and stop strings stay agentx's (vLLM
runs with ``detokenize=False``), so a turn's text and where a stop string ends it are the same
on both backends; the grammar is agentx's too (its llguidance JSON options, its Lark rules),
compiled by vLLM's "guidance" structured-output backend.
"""

from __future__ import annotations

from typing import Any

from agentx.engine.outputs import TokenLogprob
from agentx.engine.sampling import SamplingParams
from agentx.engine.structured import StructuredOutput, compact_json

__all__ = ["finish_of", "logprobs_of", "to_vllm_sampling", "to_vllm_structured"]


def to_vllm_structured(spec: StructuredOutput) -> Any:
    """vLLM's ``StructuredOutputsParams`` for ``spec``: agentx's compact JSON whitespace (the
    schema's ``x-guidance`` key, which llguidance reads over vLLM's defaults), the same regex,
    choices and Lark grammar."""
    import json

    from vllm.sampling_params import StructuredOutputsParams

    if spec.json_schema is not None:
        schema = spec.json_schema
        schema = json.loads(schema) if isinstance(schema, str) else schema
        return StructuredOutputsParams(json=compact_json(schema))
    if spec.regex is not None:
        return StructuredOutputsParams(regex=spec.regex)
    if spec.choice is not None:
        return StructuredOutputsParams(choice=list(spec.choice))
    return StructuredOutputsParams(grammar=spec.grammar)


def to_vllm_sampling(sampling: SamplingParams) -> Any:
    """vLLM's ``SamplingParams`` streaming deltas of token ids only. Stop strings are left to
    agentx's TextState (vLLM would need its own detokenizer for them)."""
    from vllm import SamplingParams as VLLMSamplingParams
    from vllm.sampling_params import RequestOutputKind

    return VLLMSamplingParams(
        temperature=sampling.temperature,
        top_k=sampling.top_k if sampling.top_k > 0 else 0,
        top_p=sampling.top_p,
        seed=sampling.seed,
        max_tokens=sampling.max_tokens,
        stop_token_ids=list(sampling.stop_token_ids),
        ignore_eos=sampling.ignore_eos,
        detokenize=False,
        skip_special_tokens=False,
        output_kind=RequestOutputKind.DELTA,
        logprobs=sampling.logprobs,  # vLLM's default mode: raw logprobs, as agentx's
        prompt_logprobs=sampling.prompt_logprobs,
        structured_outputs=(
            to_vllm_structured(sampling.structured) if sampling.structured is not None else None
        ),
    )


def finish_of(
    finish_reason: str | None, stop_reason: int | str | None, token_ids: list[int]
) -> tuple[str | None, int | str | None]:
    """agentx's ``(finish_reason, stop_reason)`` for vLLM's: an EOS stop (vLLM's stop reason
    None) names the EOS token, as agentx's engine does; everything else maps as it is."""
    if finish_reason == "stop" and stop_reason is None and token_ids:
        return "stop", token_ids[-1]
    return finish_reason, stop_reason


def logprobs_of(
    entries: Any, token_ids: list[int], k: int | None
) -> tuple[TokenLogprob | None, ...]:
    """agentx's records for vLLM's per-position logprob dicts (token id -> ``Logprob`` with
    ``logprob`` and ``rank``; the chosen token's entry is always there), one per token of
    ``token_ids``; a position without an entry (a prompt's first) is None."""
    if entries is None or k is None:
        return ()
    records: list[TokenLogprob | None] = []
    for token_id, entry in zip(token_ids, entries, strict=True):
        if entry is None:
            records.append(None)
            continue
        chosen = entry[token_id]
        ranked = sorted(entry.items(), key=lambda pair: pair[1].rank)[:k]
        top = tuple((int(tid), float(lp.logprob)) for tid, lp in ranked)
        records.append(TokenLogprob(token_id, float(chosen.logprob), int(chosen.rank), top))
    return tuple(records)
