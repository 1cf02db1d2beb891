"""Reliability of the engine on the real default model: a bad request never kills the loop,
hints and sampling values are checked on the caller's thread, an errored grammar reports an
error, tier pins end with their held KV, held KV never crosses a cache salt, the tiers' namespace
keys on the weights and shares across pool sizes, and a failed construction leaks no thread."""

import threading
import time
from dataclasses import replace

import pytest

from agentx import (
    CacheConfig,
    ConfigError,
    Engine,
    EngineConfig,
    InvalidRequestError,
    RequestAbortedError,
    SamplingParams,
    SamplingParamsError,
)
from agentx.config import OffloadConfig
from agentx.engine.hints import BranchPoint, Pin, Priority, ToolLatency, TurnsLeft
from agentx.engine.request import Request, RequestStatus
from agentx.engine.structured import StructuredOutput

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)
POOL = CacheConfig(num_blocks=64)


@pytest.fixture(scope="module")
def engine():
    engine = Engine(EngineConfig(cache=POOL, offload=OffloadConfig(host_bytes=96 << 20)))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def prompt(engine):
    return engine.tokenizer.encode("The history of the Roman Empire " * 30)[:100]


def wait_for(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def assert_idle(engine):
    """No request, no held KV, every block free: what each test leaves behind."""
    wait_for(lambda: not engine.has_pending_controls() and engine.get_num_live_requests() == 0)
    engine.check_integrity()
    stats = engine.stats()
    assert stats.kv_num_held == 0 and stats.kv_num_used_blocks == 0


def test_unhashable_held_kv_is_rejected_and_the_engine_lives(engine, prompt):
    with pytest.raises(InvalidRequestError, match="held_kv"):
        engine.add_request(prompt, GREEDY, held_kv=["a", "list"])
    with pytest.warns(DeprecationWarning), pytest.raises(InvalidRequestError):
        engine.add_request(prompt, GREEDY, extends={"not": "a handle"})
    for bad in (dict(hold_kv="yes"), dict(cache_salt=5), dict(priority=1.5), dict(hints=("x",))):
        with pytest.raises(InvalidRequestError):
            engine.add_request(prompt, GREEDY, **bad)
    reference = engine.add_request(prompt, GREEDY).result(timeout=60).token_ids
    assert (
        len(reference) == 4 and engine.add_request(prompt, GREEDY).result().token_ids == reference
    )
    assert_idle(engine)


@pytest.mark.parametrize(
    "make",
    [
        lambda: ToolLatency("8"),
        lambda: ToolLatency(float("inf")),
        lambda: ToolLatency(float("nan")),
        lambda: ToolLatency(-1.0),
        lambda: ToolLatency(True),
        lambda: BranchPoint(0),
        lambda: BranchPoint("4"),
        lambda: TurnsLeft(-3),
        lambda: Priority(0.5),
        lambda: Pin("no"),
    ],
)
def test_bad_hint_values_raise_on_construction(make):
    with pytest.raises(InvalidRequestError):
        make()


def test_a_tool_wait_never_idles_with_the_step_lock_held(engine, prompt):
    stream = engine.add_request(prompt, GREEDY, hold_kv=True, hints=(ToolLatency(30.0),))
    stream.result(timeout=60)
    wait_for(lambda: engine.core.offload.tool_waits)  # a prefetch is now due in ~30 s
    held = 0
    for _ in range(200):  # the loop polls every 5 ms; a caller must not queue behind it
        held += engine._step_lock.locked()
        time.sleep(0.001)
    assert held < 50
    assert engine.release_held(stream.request_id)
    assert not engine.core.offload.tool_waits
    assert_idle(engine)


@pytest.mark.parametrize(
    "kw",
    [
        dict(temperature=float("inf")),
        dict(temperature=1e-40),
        dict(temperature=float("nan")),
        dict(temperature="0.7"),
        dict(top_p="1"),
        dict(max_tokens=True),
        dict(stop=7),
        dict(ignore_eos="no"),
    ],
)
def test_bad_sampling_values_are_rejected(kw):
    with pytest.raises(SamplingParamsError):
        SamplingParams(**kw)


def test_a_grammar_that_rejects_a_token_finishes_with_an_error(engine):
    backend = engine.core._grammar_backend()
    matcher = backend.new_matcher(StructuredOutput(choice=("yes", "no")))
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=8), grammar=matcher)
    bad = engine.tokenizer.encode("zebra")[0]
    request.append_output_token(bad)
    assert request.check_stop(engine.max_model_len)
    assert request.status == RequestStatus.FINISHED_ERROR
    assert request.stop_reason == "grammar_error"


def test_structured_output_choice_and_compile_cache(engine, monkeypatch):
    with pytest.raises(InvalidRequestError, match="sequence of strings"):
        StructuredOutput(choice="abc")
    backend = engine.core._grammar_backend()
    monkeypatch.setattr("agentx.engine.structured.MAX_COMPILED_GRAMMARS", 2)
    for i in range(4):
        backend.compile(StructuredOutput(regex=f"a{{{i + 1}}}"))
    assert list(backend._compiled) == ["regex:a{3}", "regex:a{4}"]


def test_block_size_zero_is_a_config_error():
    for bad in (0, -16, 3, "16"):
        with pytest.raises(ConfigError, match="block_size"):
            CacheConfig(block_size=bad)


def test_tier_pins_end_when_the_held_kv_is_released(engine, prompt):
    offload = engine.core.offload
    host = offload.store.tiers[0]
    stream = engine.add_request(prompt, GREEDY, hold_kv=True)
    stream.result(timeout=60)
    with engine._step_lock:
        offload.flush()
    assert engine.pin_held(stream.request_id)
    assert host.get_stats().num_pinned == 6  # 103 computed tokens: 6 full blocks
    assert engine.release_held(stream.request_id)  # not drop_cached: the blocks stay cached
    assert host.get_stats().num_pinned == 0 and not offload.tier_pins
    # a pinned turn that the next turn adopts hands its pin on, it does not pile up
    first = engine.add_request(prompt, GREEDY, hold_kv=True)
    first.result(timeout=60)
    assert engine.pin_held(first.request_id)
    follow = prompt + first.token_ids + engine.tokenizer.encode(" and then")
    second = engine.add_request(follow, GREEDY, hold_kv=True, held_kv=first.request_id)
    second.result(timeout=60)
    wait_for(lambda: first.request_id not in offload.tier_pins)
    assert host.get_stats().num_pinned == 0
    assert engine.release_held(second.request_id)
    assert_idle(engine)


def test_held_kv_never_crosses_a_cache_salt(engine, prompt):
    first = engine.add_request(prompt, GREEDY, hold_kv=True, cache_salt="tenant-a")
    first.result(timeout=60)
    guess = prompt + first.token_ids + [42]
    other = engine.add_request(guess, GREEDY, held_kv=first.request_id, cache_salt="tenant-b")
    assert other.result(timeout=60).usage.cached_tokens == 0  # tells nothing about a's context
    assert first.request_id in engine.core.kv.held  # and b could not spend a's handle
    same = engine.add_request(guess, GREEDY, held_kv=first.request_id, cache_salt="tenant-a")
    assert same.result(timeout=60).usage.cached_tokens == len(prompt) + 4 - 1
    assert_idle(engine)


def test_the_tier_namespace_keys_on_the_weights_not_the_path(tmp_path):
    from agentx.engine.offload.fingerprint import checkpoint_digest

    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + bytes(range(256)) * 20_000)
    before = checkpoint_digest(path)
    data = bytearray(path.read_bytes())
    data[3_000_000] ^= 0xFF  # other weights, same path, same size
    path.write_bytes(bytes(data))
    assert checkpoint_digest(path) != before
    assert checkpoint_digest(path) == checkpoint_digest(path)


def test_engines_with_other_pool_sizes_share_the_disk_tier(engine, prompt, tmp_path):
    from agentx.engine.offload.fingerprint import page_fingerprint

    layout = engine.core.runner.layout
    assert page_fingerprint("w", "float32", "auto", layout, "llama") == page_fingerprint(
        "w", "float32", "auto", replace(layout, num_blocks=7), "llama"
    )
    offload = OffloadConfig(disk_path=tmp_path)
    with Engine(EngineConfig(cache=CacheConfig(num_blocks=32), offload=offload)) as a:
        expected = a.add_request(prompt, GREEDY).result(timeout=60).token_ids
        with a._step_lock:
            a.core.offload.flush()
    with Engine(EngineConfig(cache=CacheConfig(num_blocks=48), offload=offload)) as b:
        out = b.add_request(prompt, GREEDY).result(timeout=60)
        assert out.token_ids == expected
        assert b.stats().offload_loaded_blocks == 6


def test_a_failed_construction_leaves_no_transfer_thread(monkeypatch):
    def refuse(*args, **kwargs):
        raise RuntimeError("offload manager refused")

    monkeypatch.setattr("agentx.engine.core.OffloadManager", refuse)
    before = set(threading.enumerate())
    with pytest.raises(RuntimeError, match="refused"):
        Engine(EngineConfig(cache=POOL, offload=OffloadConfig(host_bytes=16 << 20)))
    wait_for(lambda: not [t for t in threading.enumerate() if t not in before and t.is_alive()])


def test_a_request_parked_for_a_tier_load_spends_its_stale_held_kv(prompt, tmp_path):
    """Found by the soak: a turn whose held KV no longer continued its prompt (a rolled-back
    tool stream) loaded its prefix from a tier, took the loaded KV in place of the stale one,
    and the stale one stayed held forever."""
    offload = OffloadConfig(disk_path=tmp_path)
    with Engine(EngineConfig(cache=POOL, offload=offload)) as a:
        a.add_request(prompt, GREEDY).result(timeout=60)
        with a._step_lock:
            a.core.offload.flush()
    with Engine(EngineConfig(cache=POOL, offload=offload)) as b:
        other = b.tokenizer.encode("A recipe for bread and butter " * 10)[:40]
        stale = b.add_request(other, GREEDY, hold_kv=True)
        stale.result(timeout=60)
        out = b.add_request(prompt, GREEDY, held_kv=stale.request_id).result(timeout=60)
        assert out.usage.cached_tokens == 96  # 6 blocks loaded from disk
        assert_idle(b)


def test_close_stops_the_grammar_mask_thread():
    """Found by the soak: each engine that ran a constrained request left a thread behind."""
    # Other engines in this process (a module's fixture) may hold their own mask thread: look
    # only at the threads this engine started.
    before = set(threading.enumerate())
    with Engine(EngineConfig(cache=POOL)) as engine:
        sampling = SamplingParams(max_tokens=3, structured=StructuredOutput(choice=("yes", "no")))
        engine.add_request("Answer:", sampling).result(timeout=60)
        started = set(threading.enumerate()) - before
        mine = [t for t in started if t.name.startswith("agentx-grammar")]
        assert len(mine) == 1
    assert not mine[0].is_alive()


def test_a_request_aborted_before_it_ran_spends_the_held_kv_it_named(engine, prompt):
    """Found by the soak: a streamed tool result's next chunk, cancelled before the engine
    admitted it, left the previous chunk's held KV behind (nobody names it any more)."""
    first = engine.add_request(prompt, GREEDY, hold_kv=True)
    first.result(timeout=60)
    follow = prompt + first.token_ids + [42]
    with engine._cond:  # queued with its abort: the loop sees both before it schedules
        second = engine.add_request(follow, GREEDY, hold_kv=True, held_kv=first.request_id)
        engine.abort(second.request_id)
    with pytest.raises(RequestAbortedError):
        second.result(timeout=60)
    assert_idle(engine)


def test_no_tier_serves_one_salt_to_another(engine):
    from agentx.engine.request import RequestOptions

    text = engine.tokenizer.encode("Salted prefixes stay with their tenant. " * 20)[:90]
    engine.add_request(text, GREEDY, cache_salt="tenant-x").result(timeout=60)
    offload = engine.core.offload
    with engine._step_lock:
        offload.flush()

    def hashes(salt):
        options = RequestOptions(cache_salt=salt)
        return engine.core.make_request("probe", text, GREEDY, options=options).block_hashes

    assert offload.store.lookup(hashes("tenant-x")).num_hits == 5
    assert offload.store.lookup(hashes("tenant-y")).num_hits == 0
    assert offload.store.lookup(hashes(None)).num_hits == 0
    other = engine.add_request(text, GREEDY, cache_salt="tenant-y").result(timeout=60)
    assert other.usage.cached_tokens == 0
    assert_idle(engine)


def test_a_disk_folder_of_another_layout_is_never_read(prompt, tmp_path):
    offload = OffloadConfig(disk_path=tmp_path)
    with Engine(EngineConfig(cache=POOL, offload=offload)) as a:
        a.add_request(prompt, GREEDY).result(timeout=60)
        with a._step_lock:
            a.core.offload.flush()
        folder_a = a.core.offload.store.get_tier("disk").folder
    config = EngineConfig(cache=POOL, offload=offload, quantization="none")
    with Engine(config) as b:  # fp32 weights and KV: other pages
        b.add_request(prompt, GREEDY).result(timeout=60)
        assert b.stats().offload_loaded_blocks == 0
        assert b.core.offload.store.get_tier("disk").folder != folder_a


def test_a_dead_engine_is_freed_while_its_failed_streams_are_kept():
    """Found by the soak: each crashed engine stayed in memory (~200 MiB) as long as anyone
    kept a stream it failed: the error's traceback held the loop's frames."""
    import gc
    import weakref

    from agentx import EngineDeadError

    engine = Engine(EngineConfig(cache=POOL))

    def crash(*args, **kwargs):
        raise RuntimeError("injected fault inside a step")

    engine.core.runner.execute = crash
    streams = [engine.add_request("hello", GREEDY) for _ in range(2)]
    for stream in streams:
        with pytest.raises(EngineDeadError) as info:
            stream.result(timeout=60)
        assert "injected fault" in str(info.value.__cause__)
        assert "crash" in "".join(info.value.__cause__.__notes__)  # the traceback, as text
    engine.close()
    ref = weakref.ref(engine)
    del engine, crash, info
    gc.collect()
    assert ref() is None


def test_calls_after_close_raise_engine_closed():
    from agentx import EngineClosedError

    engine = Engine(EngineConfig(cache=POOL))
    engine.close()
    for call in (
        lambda: engine.add_request("hello", GREEDY),
        lambda: engine.fork_held("req-0", 2),
        lambda: engine.export_held("req-0"),
    ):
        with pytest.raises(EngineClosedError):
            call()
    engine.abort("req-0")  # idempotent no-ops, never a hang
    engine.release_held_soon("req-0")
    engine.release_held_eventually("req-0")
    engine.close()
    assert engine.closed and engine.get_num_live_requests() == 0


def test_a_disk_path_that_is_a_file_is_a_config_error(tmp_path):
    a_file = tmp_path / "cache"
    a_file.write_text("not a folder")
    threads = set(threading.enumerate())
    with pytest.raises(ConfigError, match="cannot hold the disk tier"):  # was: a raw OSError
        Engine(EngineConfig(cache=POOL, offload=OffloadConfig(disk_path=a_file)))
    wait_for(lambda: set(threading.enumerate()) <= threads)
