"""P/D disaggregation: prefill and decode instances, each an Engine in its own process, behind
one coordinator. A cold turn prefills on P (which samples the first token) and hands its KV,
the partial last block included, to D through a shared tier; a warm turn prefills on the D
instance holding its session when it has at most ``local_prefill_tokens`` new tokens, else on P
with a hand-over again. Greedy tokens equal a colocated engine's; an instance killed mid-hand-
over fails its request with InstanceDeadError and the others keep serving.

Exact counts below: block_size 16, no drafting (its verification would add computed tokens),
every prompt distinct so the shared tier holds nothing of it before its test.
"""

import multiprocessing
import os
import signal
from dataclasses import replace

import pytest

from agentx import CacheConfig, ConfigError, Engine, EngineConfig, SamplingParams, Session
from agentx.config import DisaggConfig, OffloadConfig, ParallelConfig, SpeculativeConfig
from agentx.engine.backend import EngineBackend
from agentx.engine.disagg import DisaggCoordinator
from agentx.engine.offload import mooncake_master as launcher
from agentx.engine.request import RequestOptions
from agentx.errors import InstanceDeadError, InvalidRequestError, RequestAbortedError

BASE = EngineConfig(
    cache=CacheConfig(num_blocks=64),
    speculative=SpeculativeConfig(enabled=False),
    num_threads=1,
)
THRESHOLD = 8


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def colocated():
    with Engine(BASE) as engine:
        yield engine


def reference(engine: Engine, prompt: list[int], n: int) -> list[int]:
    return engine.add_request(prompt, greedy(n)).result(timeout=300).token_ids


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pd-tier")
    config = replace(BASE, offload=OffloadConfig(disk_path=folder))
    with DisaggCoordinator(config, DisaggConfig(local_prefill_tokens=THRESHOLD)) as coordinator:
        yield coordinator


def tokens(engine: Engine, text: str, n: int) -> list[int]:
    ids = engine.tokenizer.encode(text * 20)
    assert len(ids) >= n
    return ids[:n]


def deltas(before: dict, after: dict, field: str) -> dict[str, int]:
    return {name: getattr(after[name], field) - getattr(before[name], field) for name in after}


def assert_no_kv_left(coordinator: DisaggCoordinator) -> None:
    coordinator.check_integrity()
    for name, stats in coordinator.instance_stats().items():
        assert (stats.kv_num_used_blocks, stats.kv_num_held) == (0, 0), name


def test_config_is_validated_before_any_process_starts():
    with pytest.raises(ConfigError, match="num_prefill"):
        DisaggConfig(num_prefill=0)
    with pytest.raises(ConfigError, match="local_prefill_tokens"):
        DisaggConfig(local_prefill_tokens=-1)
    with pytest.raises(ConfigError, match="tier every instance reads"):
        DisaggCoordinator(BASE)  # no shared tier: nothing to hand KV over through
    with pytest.raises(ConfigError, match="dp=1"):
        DisaggCoordinator(replace(BASE, parallel=ParallelConfig(dp=2)))


def test_a_cold_turn_hands_its_partial_block_over(pd, colocated):
    prompt = tokens(colocated, "The history of the Roman Empire ", 37)  # 2 blocks + 5 tokens
    before = pd.instance_stats()
    gen = pd.add_request(prompt, greedy(8)).result(timeout=300)
    after = pd.instance_stats()
    assert gen.token_ids == reference(colocated, prompt, 8)
    assert (gen.usage.prompt_tokens, gen.usage.cached_tokens, gen.usage.output_tokens) == (37, 0, 8)
    # P computed the prompt; D loaded its 2 full blocks and the partial one and computed only
    # the first token and the 6 decode steps after it: not one prompt token again
    computed = deltas(before, after, "num_computed_tokens")
    assert computed == {"prefill-0": 37, "decode-0": 7}
    assert deltas(before, after, "offload_loaded_blocks")["decode-0"] == 3
    assert pd.counters.num_handover_tail_tokens >= 5
    assert_no_kv_left(pd)


def test_a_prompt_shorter_than_a_block_hands_over_its_partial_block_alone(pd, colocated):
    prompt = tokens(colocated, "Bread and butter ", 7)
    tail_before = pd.counters.num_handover_tail_tokens
    before = pd.instance_stats()
    gen = pd.add_request(prompt, greedy(5)).result(timeout=300)
    after = pd.instance_stats()
    assert gen.token_ids == reference(colocated, prompt, 5)
    assert deltas(before, after, "num_computed_tokens") == {"prefill-0": 7, "decode-0": 4}
    assert deltas(before, after, "offload_loaded_blocks")["decode-0"] == 1
    assert pd.counters.num_handover_tail_tokens - tail_before == 7
    assert_no_kv_left(pd)


def test_a_prompt_of_whole_blocks_hands_over_no_partial_block(pd, colocated):
    prompt = tokens(colocated, "Green tea and oolong ", 32)
    tail_before = pd.counters.num_handover_tail_tokens
    before = pd.instance_stats()
    gen = pd.add_request(prompt, greedy(5)).result(timeout=300)
    after = pd.instance_stats()
    assert gen.token_ids == reference(colocated, prompt, 5)
    assert deltas(before, after, "num_computed_tokens") == {"prefill-0": 32, "decode-0": 4}
    assert deltas(before, after, "offload_loaded_blocks")["decode-0"] == 2
    assert pd.counters.num_handover_tail_tokens == tail_before
    assert_no_kv_left(pd)


def test_concurrent_requests_hand_over_side_by_side(pd, colocated):
    texts = ["Mountains and rivers ", "SELECT name FROM users ", "Dear diary, today "]
    prompts = [tokens(colocated, text, n) for text, n in zip(texts, (19, 33, 50), strict=True)]
    handovers = pd.counters.num_handovers
    streams = [pd.add_request(p, greedy(6)) for p in prompts]
    gens = [s.result(timeout=300) for s in streams]
    assert [g.token_ids for g in gens] == [reference(colocated, p, 6) for p in prompts]
    assert pd.counters.num_handovers == handovers + 3
    assert_no_kv_left(pd)


def test_a_turn_that_ends_at_its_first_token_never_reaches_decode(pd, colocated):
    prompt = tokens(colocated, "A list of prime numbers: ", 20)
    done = pd.counters.num_finished_on_prefill
    gen = pd.add_request(prompt, greedy(1)).result(timeout=300)
    assert gen.token_ids == reference(colocated, prompt, 1)
    assert gen.finish_reason == "length"
    assert pd.counters.num_finished_on_prefill == done + 1
    assert_no_kv_left(pd)


def test_session_turns_take_both_sides_of_the_threshold_and_equal_colocated(pd, colocated):
    c0 = replace(pd.counters)
    p1 = tokens(colocated, "Once upon a time, in a small village by the sea, ", 45)
    t1 = pd.add_request(p1, greedy(6), session_id="s").result(timeout=300)
    assert t1.token_ids == reference(colocated, p1, 6)
    pd.check_integrity()
    held1 = p1 + t1.token_ids[:-1]  # 50 tokens on decode-0

    # warm, exactly THRESHOLD new tokens (the last output and 7 more): D prefills them itself
    p2 = p1 + t1.token_ids + tokens(colocated, "and then ", 7)
    before = pd.instance_stats()
    t2 = pd.add_request(p2, greedy(6), session_id="s").result(timeout=300)
    after = pd.instance_stats()
    assert len(p2) - len(held1) == THRESHOLD
    assert t2.token_ids == reference(colocated, p2, 6)
    assert deltas(before, after, "num_computed_tokens") == {"prefill-0": 0, "decode-0": 8 + 5}
    assert t2.usage.cached_tokens == len(held1)
    held2 = p2 + t2.token_ids[:-1]  # 63 tokens

    # warm, THRESHOLD + 1 new tokens: P prefills, loading the session's full blocks from the
    # tier (D wrote them through), and hands the KV back to the same D instance
    p3 = p2 + t2.token_ids + tokens(colocated, "the end ", 8)
    before = pd.instance_stats()
    t3 = pd.add_request(p3, greedy(6), session_id="s").result(timeout=300)
    after = pd.instance_stats()
    assert len(p3) - len(held2) == THRESHOLD + 1
    assert t3.token_ids == reference(colocated, p3, 6)
    num_hit = len(held2) // 16 * 16  # 48: the tier holds the session's full blocks
    assert t3.usage.cached_tokens == num_hit
    assert deltas(before, after, "num_computed_tokens") == {
        "prefill-0": len(p3) - num_hit,
        "decode-0": 5,
    }
    # P still caches the 2 full blocks of p1 it prefilled; block 2 it loads (D computed it);
    # D holds blocks 0-2 itself and loads block 3 (P computed it) and the partial block 4
    assert deltas(before, after, "offload_loaded_blocks") == {"prefill-0": 1, "decode-0": 2}
    c3 = pd.counters
    assert (c3.num_remote_prefills - c0.num_remote_prefills) == 2
    assert (c3.num_local_prefills - c0.num_local_prefills) == 1
    assert (c3.num_handovers - c0.num_handovers) == 2

    pd.check_integrity()
    assert pd.instance_stats()["decode-0"].kv_num_held == 1
    with pytest.raises(InvalidRequestError, match="holds KV per session_id or per handle"):
        pd.add_request(p3, greedy(2), session_id="s", options=RequestOptions(hold_kv=True))
    pd.end_session("s")
    assert_no_kv_left(pd)


async def test_a_session_runs_three_turns_on_the_coordinator(pd):
    assert isinstance(pd, EngineBackend) and not pd.capabilities().fork_held
    sampling = SamplingParams(temperature=0.0, max_tokens=4)
    async with Session(pd, sampling=sampling) as s:
        first = await s.send("Name a color.")
        assert first.usage.cached_tokens == 0
        previous = first.usage.prompt_tokens + first.usage.output_tokens
        for follow_up in ("Another one.", "And one more."):
            reply = await s.send(follow_up)
            assert reply.usage.cached_tokens >= 16 * ((previous - 1) // 16) > 0  # D's blocks
            previous = reply.usage.prompt_tokens + reply.usage.output_tokens
        assert pd.check_integrity() is None and pd.instance_stats()["decode-0"].kv_num_held == 1
    pd._wait_for_releases()
    assert_no_kv_left(pd)


def test_aborts_end_requests_wherever_they_are_and_leave_no_kv(pd, colocated):
    prompt = tokens(colocated, "Count slowly to a thousand: ", 24)
    stream = pd.add_request(prompt, greedy(400))
    while len(stream.token_ids) < 2:  # the first token from P, then D's
        stream.get(timeout=300)
    pd.abort(stream.request_id)
    with pytest.raises(RequestAbortedError):
        stream.result(timeout=300)
    assert_no_kv_left(pd)

    # a session's turn aborted on D: the session's KV went with it, its next turn is cold
    t1 = pd.add_request(prompt, greedy(4), session_id="ab").result(timeout=300)
    p2 = prompt + t1.token_ids + [13]
    stream = pd.add_request(p2, greedy(400), session_id="ab")  # 2 new tokens: D-local
    stream.get(timeout=300)
    pd.abort(stream.request_id)
    with pytest.raises(RequestAbortedError):
        stream.result(timeout=300)
    assert_no_kv_left(pd)
    remote = pd.counters.num_remote_prefills
    again = pd.add_request(p2, greedy(4), session_id="ab").result(timeout=300)
    assert again.token_ids == reference(colocated, p2, 4)
    assert pd.counters.num_remote_prefills == remote + 1
    pd.end_session("ab")
    assert_no_kv_left(pd)


def test_an_instance_killed_mid_hand_over_fails_its_request_and_the_rest_keep_serving(
    tmp_path, colocated
):
    kills: dict[str, tuple[str, str]] = {}  # request id -> (stage, instance to kill)

    def hook(stage: str, request_id: str) -> None:
        if kills.get(request_id, ("", ""))[0] == stage:
            instance = next(i for i in coordinator.instances if i.name == kills[request_id][1])
            os.kill(instance.pid, signal.SIGKILL)

    config = replace(BASE, offload=OffloadConfig(disk_path=tmp_path))
    disagg = DisaggConfig(num_prefill=2, num_decode=2, local_prefill_tokens=THRESHOLD)
    coordinator = DisaggCoordinator(config, disagg, handover_hook=hook)
    pids = [i.pid for i in coordinator.instances]
    try:
        prompt = tokens(colocated, "def fibonacci(n):\n    ", 30)
        turn = coordinator.add_request(prompt, greedy(4), session_id="s").result(timeout=300)
        assert turn.token_ids == reference(colocated, prompt, 4)

        # P killed after the first token, before its export: prefill-0 took it (least loaded)
        kills["a"] = ("export", "prefill-0")
        a = coordinator.add_request(prompt + [11], greedy(4), request_id="a")
        with pytest.raises(InstanceDeadError) as dead:
            a.result(timeout=300)
        assert dead.value.instance == "prefill-0"
        assert len(a.token_ids) == 1  # the first token had come from P
        other = tokens(colocated, "Numbers: one two three ", 21)
        b = coordinator.add_request(other, greedy(4), request_id="b").result(timeout=300)
        assert b.token_ids == reference(colocated, other, 4)  # on prefill-1 and decode-1

        # D killed after P's export, before its import: the session's KV dies with decode-0
        warm = prompt + turn.token_ids + tokens(colocated, " return fibonacci", 12)
        kills["c"] = ("import", "decode-0")
        c = coordinator.add_request(warm, greedy(4), session_id="s", request_id="c")
        with pytest.raises(InstanceDeadError) as dead:
            c.result(timeout=300)
        assert dead.value.instance == "decode-0"
        # its next turn starts cold on the instances still alive, with the same tokens
        again = coordinator.add_request(warm, greedy(4), session_id="s").result(timeout=300)
        assert again.token_ids == reference(colocated, warm, 4)
        assert coordinator.counters.num_failed == 2
        assert sorted(coordinator.instance_stats()) == ["decode-1", "prefill-1"]
        coordinator.end_session("s")
        assert_no_kv_left(coordinator)  # prefill-1 released what it exported for c

        # D killed while it decodes: the request fails; with no D left a request fails at once
        long = coordinator.add_request(other, greedy(400))
        while len(long.token_ids) < 2:
            long.get(timeout=300)
        decode = coordinator.decode[1]
        os.kill(decode.pid, signal.SIGKILL)
        with pytest.raises(InstanceDeadError, match="decode-1"):
            long.result(timeout=300)
        with pytest.raises(InstanceDeadError, match="no decode instance is alive"):
            coordinator.add_request(other, greedy(4))
        assert coordinator.get_num_live_requests() == 0
        assert_no_kv_left(coordinator)  # prefill-1: nothing used, nothing held
    finally:
        coordinator.close()
    assert [p for p in multiprocessing.active_children() if p.pid in pids] == []
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.skipif(
    not launcher.has_private_network(),
    reason="Mooncake binds every interface: run inside a private network namespace "
    "(make test runs pytest under unshare -n)",
)
def test_the_hand_over_runs_through_a_mooncake_master_started_for_the_run(colocated):
    config = replace(BASE, offload=OffloadConfig(mooncake="auto", mooncake_bytes=64 << 20))
    with DisaggCoordinator(config) as coordinator:
        master = coordinator.master
        assert master is not None and master.running
        prompt = tokens(colocated, "The Mooncake store on loopback ", 41)  # 2 blocks + 9
        before = coordinator.instance_stats()
        gen = coordinator.add_request(prompt, greedy(6)).result(timeout=300)
        after = coordinator.instance_stats()
        assert gen.token_ids == reference(colocated, prompt, 6)
        assert deltas(before, after, "num_computed_tokens") == {"prefill-0": 41, "decode-0": 5}
        assert deltas(before, after, "offload_loaded_blocks")["decode-0"] == 3
        assert_no_kv_left(coordinator)
    assert not master.running
