"""The Mooncake tier through the real engine, against a real ``mooncake_master`` on loopback:
two engine processes share a prefix through it (greedy tokens identical to a cold run), and a
master killed mid-run leaves the engine serving from its other tiers until it returns.

Mooncake binds every interface, so these run only inside a private network namespace
(``make test`` runs pytest under ``unshare -n``)."""

import json
import subprocess
import sys
import textwrap
import time

import pytest

from agentx import CacheConfig, Engine, EngineConfig, SamplingParams
from agentx.config import OffloadConfig
from agentx.engine.offload import mooncake_master as launcher

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not launcher.has_private_network(),
        reason="Mooncake binds every interface: run inside a private network namespace "
        "(make test runs pytest under unshare -n)",
    ),
]

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
PAGE_BYTES = 16 * 30 * 2 * 3 * 64 * 4


@pytest.fixture
def master(tmp_path):
    m = launcher.MooncakeMaster(log_path=tmp_path / "master.log").start()
    yield m
    m.stop()


@pytest.fixture(scope="module")
def prompt_and_cold():
    with Engine(EngineConfig(cache=CacheConfig(num_blocks=64, enable_prefix_caching=False))) as e:
        a = e.tokenizer.encode("The history of the Roman Empire " * 30)[:180]
        again = a + [13, 42]
        yield a, again, e.add_request(again, GREEDY).result(timeout=300).token_ids


def engine_with(address: str, host_bytes: int = 0) -> Engine:
    offload = OffloadConfig(host_bytes=host_bytes, mooncake=address, mooncake_bytes=64 << 20)
    return Engine(EngineConfig(cache=CacheConfig(num_blocks=16), offload=offload))


def flush(engine: Engine) -> None:
    with engine._step_lock:
        engine.core.offload.flush()


CHILD = textwrap.dedent(
    """
    import json, sys
    from agentx import CacheConfig, Engine, EngineConfig, SamplingParams
    from agentx.config import OffloadConfig
    address, tokens = sys.argv[1], json.loads(sys.argv[2])
    offload = OffloadConfig(mooncake=address, mooncake_bytes=64 << 20)
    with Engine(EngineConfig(cache=CacheConfig(num_blocks=16), offload=offload)) as engine:
        gen = engine.add_request(tokens, SamplingParams(max_tokens=6, ignore_eos=True)).result()
        stats = engine.stats()
    print(json.dumps({"tokens": gen.token_ids, "cached": gen.usage.cached_tokens,
                      "loaded": stats.offload_loaded_blocks}))
    """
)


def test_two_engine_processes_share_a_prefix_through_mooncake(master, prompt_and_cold):
    a, again, cold = prompt_and_cold
    with engine_with(master.address) as first:
        first.add_request(a, GREEDY).result(timeout=300)
        flush(first)
        assert first.stats().offload_stored_blocks == 11
        out = subprocess.run(
            [sys.executable, "-c", CHILD, master.address, json.dumps(again)],
            capture_output=True,
            text=True,
            timeout=600,
        )
    assert out.returncode == 0, out.stderr[-2000:]
    child = json.loads(out.stdout.strip().splitlines()[-1])
    assert child["loaded"] == 11 and child["cached"] == 176
    assert child["tokens"] == cold


def test_a_killed_master_is_skipped_and_rejoined(master, prompt_and_cold):
    a, again, cold = prompt_and_cold
    with engine_with(master.address, host_bytes=32 * PAGE_BYTES) as engine:
        engine.add_request(a, GREEDY).result(timeout=300)
        flush(engine)
        tier = engine.core.offload.store.get_tier("mooncake")
        master.stop()
        # the engine keeps serving: the host tier still holds the prefix, mooncake is skipped
        gen = engine.add_request(again, GREEDY).result(timeout=300)
        assert gen.token_ids == cold
        other = engine.tokenizer.encode("A recipe for bread and butter " * 30)[:180]
        engine.add_request(other, GREEDY).result(timeout=300)
        flush(engine)
        assert not tier.healthy
        master.start()  # same port; a restarted master has lost its objects
        deadline = time.monotonic() + 30
        while not tier.healthy:
            assert time.monotonic() < deadline, "the tier never reconnected"
            time.sleep(0.2)
        before = tier.get_stats().num_stored
        third = engine.tokenizer.encode("Notes on the geology of Iceland " * 30)[:180]
        engine.add_request(third, GREEDY).result(timeout=300)
        flush(engine)
        assert tier.get_stats().num_stored > before  # stores reach the master again
        engine.check_integrity()
