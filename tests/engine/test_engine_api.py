"""The engine's contract: streaming, usage, stop conditions, sampling, aborts and errors."""

import dataclasses
import threading

import anyio
import pytest

from agentx import (
    CacheConfig,
    EngineClosedError,
    EngineDeadError,
    InvalidRequestError,
    PromptTooLongError,
    RequestAbortedError,
    RequestOptions,
    SamplingParams,
    SamplingParamsError,
)
from agentx.engine.outputs import EngineStats
from agentx.engine.request import Request

pytestmark = pytest.mark.slow


def test_stream_deltas_add_up_to_the_result(default_engine):
    async def main():
        deltas = []
        async for out in default_engine.stream(
            "The capital of France is", SamplingParams(max_tokens=12)
        ):
            deltas.append(out)
        return deltas

    deltas = anyio.run(main)
    gen = default_engine.generate(["The capital of France is"], SamplingParams(max_tokens=12))[0]
    assert [t for d in deltas for t in d.new_token_ids] == gen.token_ids
    assert "".join(d.new_text for d in deltas) == gen.text
    assert [d.finish_reason for d in deltas][:-1] == [None] * (len(deltas) - 1)
    assert deltas[-1].finish_reason == gen.finish_reason


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_concurrent_streams_under_both_backends(default_engine, backend):
    prompts = ["One, two, three,", "Alpha, beta,", "Red, green,"]
    results = {}

    async def consume(i):
        tokens = []
        async for out in default_engine.stream(
            prompts[i], SamplingParams(max_tokens=10, ignore_eos=True)
        ):
            tokens += out.new_token_ids
        results[i] = tokens

    async def main():
        async with anyio.create_task_group() as tg:
            for i in range(3):
                tg.start_soon(consume, i)

    anyio.run(main, backend=backend)
    expected = default_engine.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))
    assert [results[i] for i in range(3)] == [g.token_ids for g in expected]


def test_eos_stops_and_is_not_in_the_text(default_engine):
    tok = default_engine.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "Say hi."}])
    gen = default_engine.generate([prompt], SamplingParams(max_tokens=64))[0]
    assert gen.finish_reason == "stop"
    assert gen.token_ids[-1] in tok.eos_token_ids and gen.stop_reason == gen.token_ids[-1]
    assert "<|im_end|>" not in gen.text
    assert gen.usage.output_tokens == len(gen.token_ids)


def test_stop_token_ids_and_max_tokens(default_engine):
    base = default_engine.generate(["1, 2, 3,"], SamplingParams(max_tokens=10, ignore_eos=True))[0]
    stop_at = base.token_ids[3]
    gen = default_engine.generate(
        ["1, 2, 3,"], SamplingParams(max_tokens=10, stop_token_ids=(stop_at,))
    )[0]
    first = base.token_ids.index(stop_at)
    assert gen.token_ids == base.token_ids[: first + 1]
    assert gen.finish_reason == "stop" and gen.stop_reason == stop_at
    assert base.finish_reason == "length" and len(base.token_ids) == 10


def test_stop_string_truncates_text(default_engine):
    base = default_engine.generate(["1, 2, 3,"], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    stop = base.text[6:9]
    gen = default_engine.generate(["1, 2, 3,"], SamplingParams(max_tokens=12, stop=[stop]))[0]
    cut = base.text.index(stop)
    assert gen.text == base.text[:cut]
    assert gen.finish_reason == "stop" and gen.stop_reason == stop
    with_stop = default_engine.generate(
        ["1, 2, 3,"], SamplingParams(max_tokens=12, stop=[stop], include_stop_str_in_output=True)
    )[0]
    assert with_stop.text == base.text[: cut + len(stop)]
    default_engine.check_integrity()


def test_seeded_sampling_is_reproducible_alone_and_batched(default_engine):
    p = SamplingParams(
        temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=16, ignore_eos=True
    )
    alone = default_engine.generate(["Once upon a time"], p)[0].token_ids
    batched = default_engine.generate(["Hello", "Once upon a time", "def f():"], p)[1].token_ids
    assert alone == batched
    other = SamplingParams(temperature=1.0, seed=99, max_tokens=16, ignore_eos=True)
    assert default_engine.generate(["Once upon a time"], other)[0].token_ids != alone


def test_top_k_1_is_greedy(default_engine):
    greedy = default_engine.generate(["The sky is"], SamplingParams(max_tokens=8, ignore_eos=True))
    topk = default_engine.generate(
        ["The sky is"],
        SamplingParams(temperature=0.7, top_k=1, seed=5, max_tokens=8, ignore_eos=True),
    )
    assert topk[0].token_ids == greedy[0].token_ids


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": 0},
        {"max_tokens": -3},
        {"temperature": -0.1},
        {"temperature": float("nan")},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": -1},
        {"stop": [""]},
        {"stop_token_ids": [-1]},
        {"stop_token_ids": [True]},
        {"seed": -1},
        {"seed": 2**63},  # the sampler mixes seeds modulo 2**63: it would alias seed 0
        {"seed": True},
        {"stop": ["x"] * 65},  # at most 64 stop strings (OpenAI allows 4)
        {"stop": ["x" * 1025]},  # of at most 1,024 characters
    ],
)
def test_bad_sampling_values_are_rejected(kwargs):
    with pytest.raises(SamplingParamsError):
        SamplingParams(**kwargs)


def test_bad_prompts_are_rejected_before_scheduling(default_engine, make_engine):
    before = default_engine.stats()
    with pytest.raises(InvalidRequestError, match="empty"):
        default_engine.add_request([])
    with pytest.raises(InvalidRequestError, match="empty"):
        default_engine.add_request("")
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        default_engine.add_request([1, 2, 49152])
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        default_engine.add_request([1, -5])
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        default_engine.add_request([1, True])  # a bool is not a token id
    with pytest.raises(InvalidRequestError, match="not bytes"):
        default_engine.add_request(b"Hello")  # would iterate as ids 72, 101, ...
    with pytest.raises(PromptTooLongError, match="context"):
        default_engine.add_request([1] * 8192)
    small = make_engine(cache=CacheConfig(num_blocks=64))  # 63 usable blocks: 1,008 tokens
    with pytest.raises(PromptTooLongError, match="pool"):
        small.add_request([1] * 100, SamplingParams(max_tokens=1000))
    assert small.get_num_live_requests() == 0
    assert default_engine.get_num_live_requests() == 0
    assert default_engine.stats().num_steps == before.num_steps


def test_request_options_come_as_one_record_or_as_its_fields(default_engine):
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    prompt = "A record of options, salted for one tenant only. " * 4
    options = RequestOptions(priority=2, cache_salt="options-test")
    by_record = default_engine.add_request(prompt, params, options=options).result(timeout=60)
    by_fields = default_engine.add_request(
        prompt, params, priority=2, cache_salt="options-test"
    ).result(timeout=60)
    assert by_record.token_ids == by_fields.token_ids and len(by_record.token_ids) == 3
    # the same salt: the second run hits every full block of the first's prompt
    block_size = default_engine.core.kv.block_size
    num_full = (by_record.usage.prompt_tokens - 1) // block_size * block_size
    assert by_record.usage.cached_tokens == 0 and by_fields.usage.cached_tokens == num_full > 0
    with pytest.raises(InvalidRequestError, match="priority must be an int"):
        RequestOptions(priority="high")
    with pytest.raises(InvalidRequestError, match="priority must be an int"):
        default_engine.add_request("Hello", params, options=options, priority=1.5)
    with pytest.raises(TypeError, match="unexpected keyword"):
        default_engine.add_request("Hello", params, priorty=1)
    assert RequestOptions(hints=[]).hints == ()
    assert default_engine.get_num_live_requests() == 0


def test_abort_frees_blocks_and_fails_the_stream(default_engine):
    stream = default_engine.add_request(
        "Count to one hundred:", SamplingParams(max_tokens=500, ignore_eos=True)
    )
    stream.get(timeout=60)  # it is running and holds blocks
    default_engine.abort(stream.request_id)
    with pytest.raises(RequestAbortedError):
        stream.result(timeout=60)
    default_engine.check_integrity()
    assert default_engine.stats().kv_num_used_blocks == 0


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_cancelling_the_consumer_aborts_the_request(default_engine, backend):
    seen = []

    async def main():
        with anyio.move_on_after(30) as scope:
            async for out in default_engine.stream(
                "Tell me a long story.", SamplingParams(max_tokens=2000, ignore_eos=True)
            ):
                seen.extend(out.new_token_ids)
                if len(seen) >= 3:
                    scope.cancel()
        assert scope.cancel_called

    anyio.run(main, backend=backend)
    # a consumer slower than the loop gets several tokens in one output: at least 3, never all
    assert 3 <= len(seen) < 2000
    # the abort is picked up by the loop thread before its next step
    for _ in range(100):
        if default_engine.get_num_live_requests() == 0 and default_engine.stats().num_running == 0:
            break
        threading.Event().wait(0.05)
    default_engine.check_integrity()
    assert default_engine.stats().kv_num_used_blocks == 0


def test_engine_loop_crash_fails_waiting_requests(make_engine):
    engine = make_engine()

    def boom():
        raise RuntimeError("injected fault")

    engine.core.step = boom
    stream = engine.add_request("hello")
    with pytest.raises(EngineDeadError) as info:
        stream.result(timeout=30)
    assert isinstance(info.value.__cause__, RuntimeError)
    with pytest.raises(EngineDeadError):
        engine.add_request("again")


def test_close_fails_live_requests_and_rejects_new_ones(make_engine):
    engine = make_engine()
    stream = engine.add_request("Write a poem.", SamplingParams(max_tokens=2000, ignore_eos=True))
    stream.get(timeout=60)
    engine.close()
    with pytest.raises(EngineClosedError):
        stream.result(timeout=30)
    with pytest.raises(EngineClosedError):
        engine.add_request("after close")
    engine.core.check_integrity()
    assert engine.core.kv.get_num_used_blocks() == 0
    engine.close()  # idempotent


def test_priority_queue_admits_lower_priority_value_first():
    from agentx import EngineConfig, SchedulerConfig
    from agentx.engine.core import EngineCore

    # a core without the client's loop thread, driven by hand for an exact order
    core = EngineCore(EngineConfig(scheduler=SchedulerConfig(policy="priority", max_num_seqs=1)))
    p = SamplingParams(max_tokens=2, ignore_eos=True)
    for rid, prio in [("late-low", 5), ("urgent", -1), ("normal", 0)]:
        core.add_request(
            core.make_request(rid, [1, 2, 3], p, options=RequestOptions(priority=prio))
        )
    order = []
    while core.has_unfinished_requests():
        for out in core.step():
            if out.finished:
                order.append(out.request_id)
    assert order == ["urgent", "normal", "late-low"]
    assert isinstance(core.scheduler.requests, dict) and not core.scheduler.requests
    assert Request  # the engine's own record type is importable for tests like this
    core.close()
    assert core.runner.model is None and core.runner.kv_caches == []  # a closed core holds none


def test_runner_rows_are_released_when_the_last_requests_finish(make_engine):
    from agentx import SchedulerConfig

    engine = make_engine(scheduler=SchedulerConfig(max_num_seqs=4))
    for _ in range(6):  # 24 requests through 4 rows: a leaked row would exhaust them
        engine.generate(["a", "b", "c", "d"], SamplingParams(max_tokens=2, ignore_eos=True))
        # a control op wakes the loop for a step with nothing to schedule: the ids that
        # finished last are reported to the runner there, not lost
        engine.release_held_soon("no-such-handle")
        for _ in range(100):
            if not engine.core.runner.input_batch.row_of:
                break
            threading.Event().wait(0.05)
        assert engine.core.runner.input_batch.row_of == {}
        engine.check_integrity()
    assert len(engine.core.runner.input_batch.free_rows) == 4


def test_sampling_limits_are_inclusive():
    assert SamplingParams(seed=0).seed == 0 and SamplingParams(seed=2**63 - 1).seed == 2**63 - 1
    assert len(SamplingParams(stop=["x" * 1024] * 64).stop) == 64


def test_request_ids_never_clash_with_live_requests_or_held_kv(default_engine):
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    prompt = "Request ids name one live request or one held KV. " * 2
    slow = default_engine.add_request(prompt, SamplingParams(max_tokens=64), request_id="dup")
    with pytest.raises(InvalidRequestError, match="'dup' is already live"):
        default_engine.add_request(prompt, params, request_id="dup")
    slow.result(timeout=120)
    held = default_engine.add_request(prompt, params, request_id="kept", hold_kv=True)
    tokens = held.result(timeout=60).token_ids
    for options in ({}, {"hold_kv": True}):
        with pytest.raises(InvalidRequestError, match="'kept' names held KV"):
            default_engine.add_request(prompt, params, request_id="kept", **options)
    assert (
        default_engine.core.kv.get_held("kept").num_tokens
        == len(default_engine.tokenize(prompt)) + 1
    )  # untouched: the prompt and the first output token (the last is not computed)
    again = default_engine.add_request(
        default_engine.tokenize(prompt) + tokens, params, request_id="kept", held_kv="kept"
    )  # continuing from it under its own id is fine
    assert again.result(timeout=60).usage.cached_tokens > 0
    assert default_engine.core.kv.get_held("kept") is None


def test_engine_stats_old_names_of_num_cached_tokens_warn_and_agree():
    zeros = {field.name: 0 for field in dataclasses.fields(EngineStats)}
    stats = EngineStats(**{**zeros, "num_cached_tokens": 48, "prefix_cache_query_tokens": 64})
    assert stats.prefix_cache_hit_rate == 0.75
    with pytest.warns(DeprecationWarning, match="prefix_cache_hit_tokens.*num_cached_tokens"):
        assert stats.prefix_cache_hit_tokens == 48
    with pytest.warns(DeprecationWarning, match="num_reused_tokens.*num_cached_tokens"):
        assert stats.num_reused_tokens == 48
