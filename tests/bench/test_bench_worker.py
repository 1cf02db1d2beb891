"""The worker protocol and the subprocess adapter (on the fake worker)."""

import asyncio
import sys

import pytest

from agentx.bench import protocol
from agentx.bench.adapter import BenchEngineError, Done, GenerateRequest, Tokens
from agentx.bench.fake_adapter import fake_encode
from agentx.bench.segments import Prompt
from agentx.bench.worker_adapter import WorkerAdapter

FAKE = [sys.executable, "-m", "agentx.bench.fake_worker", "--model", "x", "--threads", "1"]


def test_protocol_lines():
    assert protocol.generate_op("r1", "s", [1, 2], 3) == (
        b'{"op":"generate","id":"r1","session":"s","prompt":[1,2],"max_tokens":3}\n'
    )
    assert protocol.done_ev("r1", 3, None) == (
        b'{"ev":"done","id":"r1","num_output":3,"num_cached":null}\n'
    )
    assert protocol.decode(protocol.tokens_ev("r1", 2), "ev") == {
        "ev": "tokens",
        "id": "r1",
        "n": 2,
    }
    assert protocol.decode(protocol.shutdown_op(), "op") == {"op": "shutdown"}
    assert protocol.decode(protocol.stats_op(), "op") == {"op": "stats"}
    assert protocol.decode(protocol.stats_ev({"n": 1}), "ev") == {"ev": "stats", "stats": {"n": 1}}
    with pytest.raises(protocol.ProtocolError, match="lacks \\['n'\\]"):
        protocol.decode(b'{"ev":"tokens","id":"r1"}', "ev")
    with pytest.raises(protocol.ProtocolError, match="unknown ev"):
        protocol.decode(b'{"ev":"hello"}', "ev")
    with pytest.raises(protocol.ProtocolError, match="not JSON"):
        protocol.decode(b"{", "op")


async def collect(engine, rid, prompt, n):
    return [e async for e in engine.generate(GenerateRequest(rid, "s", prompt, n))]


def test_worker_adapter_on_the_fake_worker():
    async def go():
        engine = WorkerAdapter("fake", FAKE)
        info = await engine.start()
        assert (info.engine, info.version) == ("fake", "0")
        prompt = list(range(100, 140))
        a, b = await asyncio.gather(
            collect(engine, "a", prompt, 3), collect(engine, "b", list(range(40)), 2)
        )
        assert a == [Tokens(1), Tokens(1), Tokens(1), Done(3, 0)]
        assert b == [Tokens(1), Tokens(1), Done(2, 0)]
        again = await collect(engine, "c", prompt + [7], 1)
        assert again == [Tokens(1), Done(1, 32)]  # two 16-token blocks were cached
        await engine.end_session("s")
        # the "stats" op: the worker's engine counters (agentx's carry its drafting counters)
        assert await engine.final_stats() == {"num_finished_requests": 3}
        await engine.close()
        await engine.close()  # idempotent
        assert await engine.final_stats() is None
        with pytest.raises(BenchEngineError):
            await collect(engine, "d", prompt, 1)

    asyncio.run(go())


def test_worker_that_dies_fails_requests():
    async def go():
        engine = WorkerAdapter("bad", [sys.executable, "-c", "import sys; sys.exit(3)"])
        with pytest.raises(BenchEngineError, match="exited with code 3"):
            await engine.start()
        await engine.close()

    asyncio.run(go())


def test_speculative_flag_reaches_the_engine_config():
    from agentx import SpeculativeConfig
    from agentx.bench.agentx_adapter import AgentxOptions
    from agentx.bench.worker import parse_args

    assert parse_args([]).speculative is None
    assert AgentxOptions().engine_config().speculative == SpeculativeConfig()
    for flag, enabled in (("on", True), ("off", False)):
        assert parse_args(["--speculative", flag]).speculative == flag
        options = AgentxOptions(speculative=enabled)
        assert options.engine_config().speculative.enabled is enabled
        assert options.describe()["speculative"] is enabled


def test_in_process_and_worker_engines_default_to_the_library_config():
    """``agentx-inproc`` (AgentxOptions) and the worker measure the engine a user gets: the same
    quantization and dtype as a bare ``EngineConfig()`` (in-process once ran fp32 weights)."""
    from agentx import EngineConfig
    from agentx.bench.agentx_adapter import AgentxOptions
    from agentx.bench.worker import agentx_options, parse_args

    default = EngineConfig()
    for options in (AgentxOptions(), agentx_options(parse_args([]))):
        config = options.engine_config()
        assert (config.quantization, config.dtype) == (default.quantization, default.dtype)
        assert config.quantization == "auto"


def test_kv_cache_dtype_flag_reaches_the_engine_config():
    from agentx.bench.worker import agentx_options, parse_args

    default = agentx_options(parse_args([]))
    assert default.engine_config().cache.kv_cache_dtype == "auto"
    options = agentx_options(parse_args(["--kv-cache-dtype", "int8"]))
    assert options.engine_config().cache.kv_cache_dtype == "int8"
    assert options.describe()["kv_cache_dtype"] == "int8"
    with pytest.raises(SystemExit):  # argparse's error: not a cache element type
        parse_args(["--kv-cache-dtype", "int4"])


def test_block_size_and_huge_pages_flags_reach_the_engine_config():
    from agentx import CacheConfig
    from agentx.bench.worker import agentx_options, parse_args

    default = agentx_options(parse_args([]))
    assert default.engine_config().cache.block_size == CacheConfig().block_size == 16
    assert default.engine_config().cache.huge_pages is False
    assert "block_size" not in default.describe() and "huge_pages" not in default.describe()
    options = agentx_options(parse_args(["--block-size", "64", "--huge-pages"]))
    cache = options.engine_config().cache
    assert (cache.block_size, cache.huge_pages) == (64, True)
    assert options.describe()["block_size"] == 64
    assert options.describe()["huge_pages"] is True


def test_parallel_flags_reach_the_engine_config():
    from agentx import ParallelConfig
    from agentx.bench.worker import agentx_options, parse_args

    assert agentx_options(parse_args([])).engine_config().parallel == ParallelConfig()
    args = parse_args(["--tp", "2", "--dcp", "2", "--pcp", "1", "--ep", "1", "--dp", "3"])
    options = agentx_options(args)
    assert options.parallel == {"tp": 2, "dcp": 2, "dp": 3}
    assert options.engine_config().parallel == ParallelConfig(tp=2, dcp=2, dp=3)
    assert options.describe()["parallel"] == {"tp": 2, "dcp": 2, "dp": 3}
    ep = agentx_options(parse_args(["--ep", "4"])).engine_config().parallel
    assert (ep.ep, ep.world_size) == (4, 4)


def test_output_ids_come_back_when_asked():
    assert protocol.generate_op("r", "s", [1], 2, return_ids=True).endswith(
        b'"max_tokens":2,"return_ids":true}\n'
    )
    assert protocol.done_ev("r", 2, 0, (5, 6)).endswith(b'"num_cached":0,"token_ids":[5,6]}\n')

    async def go():
        engine = WorkerAdapter("fake", FAKE, encode=fake_encode)
        await engine.start()
        request = GenerateRequest("a", "s", Prompt(("some text here", (7, 8))), 2, return_ids=True)
        events = [e async for e in engine.generate(request)]
        plain = await collect(engine, "b", [1, 2, 3], 2)
        await engine.close()
        return events, plain

    events, plain = asyncio.run(go())
    n = len(fake_encode("some text here")) + 2  # the text, tokenized here, then the ids
    assert events[-1] == Done(2, 0, tuple(17 + (n * 31 + i) % 1000 for i in range(2)))
    assert plain[-1] == Done(2, 0)  # not asked: no ids
