"""The vLLM backend itself: priorities, hints it cannot honour (reported, never dropped), cache
salt, stop strings, the process-wide state vLLM changes, and an agentx engine running beside it
with the same greedy tokens. (The Session tests on both backends: test_session_backends.py.)"""

import gc

import anyio
import pytest
import torch

from agentx import EngineConfig, RequestOptions, SamplingParams, Session
from agentx.engine.vllm import VLLMConfig
from tests.helpers.parity import PARITY_PROMPTS, TOP, check_logprobs_close, parity_sampling

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

CHAT = [{"role": "user", "content": "Name three fruits."}]
VLLM_MIN_EXACT = 6


async def drain(stream):
    async for _ in stream:
        pass
    return stream.to_generation()


async def test_priority_orders_the_queue(vllm_engine):
    sampling = SamplingParams(max_tokens=8, ignore_eos=True)
    a, b, c = (Session(vllm_engine, sampling=sampling) for _ in range(3))
    a.hint(priority=-2)  # a runs first and is never preempted by b
    b.hint(priority=-1)
    c.hint(priority=5)
    order = []

    async def turn(name, s, delay):
        await anyio.sleep(delay)
        # a decodes 48 tokens: b and c arrive while it holds the only running slot
        length = SamplingParams(max_tokens=48, ignore_eos=True) if name == "a" else None
        await s.send(f"Session {name}.", sampling=length)
        order.append(name)

    async with anyio.create_task_group() as tg:
        tg.start_soon(turn, "a", a, 0)
        tg.start_soon(turn, "c", c, 0.3)
        tg.start_soon(turn, "b", b, 0.6)
    assert order == ["a", "b", "c"]
    for s in (a, b, c):
        await s.close()


async def test_unsupported_hints_are_reported_not_dropped(vllm_engine):
    caps = vllm_engine.capabilities()
    assert not caps.pin and not caps.tool_latency and not caps.release_drop_cached
    async with Session(vllm_engine, sampling=SamplingParams(max_tokens=4)) as s:
        s.hint(pin=True, tool_latency=2.0, turns_left=3)
        await s.send("Hi.")
        s.hint(release=True)
    assert {"Pin", "ToolLatency", "Release(drop_cached)"} <= vllm_engine.unsupported_warned
    assert not any(caps.honours(h) for h in s._hints if type(h).__name__ in ("Pin", "Release"))


async def test_cache_salt_isolates_and_counts_come_from_vllm(vllm_engine):
    prompt = vllm_engine.tokenizer.encode(vllm_engine.tokenizer.apply_chat_template(CHAT * 4))
    sampling = SamplingParams(max_tokens=2)
    first = await drain(
        vllm_engine.add_request(prompt, sampling, options=RequestOptions(cache_salt="a"))
    )
    again = await drain(
        vllm_engine.add_request(prompt, sampling, options=RequestOptions(cache_salt="a"))
    )
    other = await drain(
        vllm_engine.add_request(prompt, sampling, options=RequestOptions(cache_salt="b"))
    )
    block = vllm_engine.capabilities().block_size
    assert first.usage.cached_tokens == 0 and other.usage.cached_tokens == 0
    assert again.usage.cached_tokens == (len(prompt) - 1) // block * block
    assert again.token_ids == first.token_ids == other.token_ids


async def test_stop_strings_end_the_text_as_on_agentx(vllm_engine, default_engine):
    prompt = default_engine.tokenizer.encode(default_engine.tokenizer.apply_chat_template(CHAT))
    free = await drain(vllm_engine.add_request(prompt, SamplingParams(max_tokens=24)))
    word = free.text.split()[2]
    sampling = SamplingParams(max_tokens=24, stop=(word,))
    cut = await drain(vllm_engine.add_request(prompt, sampling))
    assert cut.finish_reason == "stop" and cut.stop_reason == word
    assert cut.text == free.text[: free.text.index(word)]
    assert vllm_engine.get_num_live_requests() == 0


def test_process_state_vllm_changed_is_put_back(vllm_engine):
    changes = "\n".join(vllm_engine.process_changes)
    assert "torch.set_num_threads: replaced" in changes and "distributed: False -> True" in changes
    assert torch.set_num_threads.__module__ == "torch"  # vLLM's no-op replacement is gone
    assert gc.isenabled() and gc.get_freeze_count() == 0
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" in changes  # kept: vLLM reads it while it runs


def test_agentx_engine_beside_vllm_is_close_by_logprobs(vllm_engine, make_engine):
    """Two engines, two arithmetics (agentx's fp32 kernels, vLLM's CPU ones): judged by the
    parity rule on the fixed prompt set, with vLLM's own logprobs passed through."""
    before = torch.get_num_threads()
    # fp32 weights, as the folder vLLM loads: both compute with the same numbers
    engine = make_engine(quantization="none", num_threads=1)
    assert torch.get_num_threads() == 1  # set_num_threads works again
    torch.set_num_threads(before)
    prompts = [engine.tokenizer.encode(p) for p in PARITY_PROMPTS]
    ours = engine.generate(prompts, parity_sampling())
    theirs = [vllm_engine.add_request(p, parity_sampling()).result(timeout=300) for p in prompts]
    check_logprobs_close(ours, theirs, min_exact=VLLM_MIN_EXACT, names=("agentx", "vLLM"))
    for gen in theirs:  # vLLM's records: one per token, the top-5 most likely first
        assert [r.token_id for r in gen.logprobs] == gen.token_ids
        assert all(len(r.top) == TOP and r.top[0][1] >= r.top[-1][1] for r in gen.logprobs)
    scored = vllm_engine.add_request(
        prompts[5], SamplingParams(max_tokens=1, prompt_logprobs=2)
    ).result(timeout=120)
    mine = engine.generate([prompts[5]], SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    assert scored.prompt_logprobs[0] is None and len(scored.prompt_logprobs) == len(prompts[5])
    assert [r.token_id for r in scored.prompt_logprobs[1:]] == prompts[5][1:]
    for a, b in zip(mine.prompt_logprobs[1:], scored.prompt_logprobs[1:], strict=True):
        assert abs(a.logprob - b.logprob) < 0.05  # fp32 both: the same numbers, another order
    assert isinstance(engine.config, EngineConfig) and isinstance(vllm_engine.config, VLLMConfig)
