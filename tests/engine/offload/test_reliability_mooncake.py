"""Mooncake faults: damaged or misplaced objects are misses, a timed-out put never stores other
bytes under its keys, a client outside a private network namespace refuses to start, and a
master started for an engine that fails to build is stopped."""

import time

import pytest
import torch

from agentx import CacheConfig, Engine, EngineConfig
from agentx.config import OffloadConfig
from agentx.engine.block_hash import hash_block
from agentx.engine.offload import mooncake_master as launcher
from agentx.errors import OffloadError

PAGE = 4096

private = pytest.mark.skipif(
    not launcher.has_private_network(),
    reason="Mooncake binds every interface: run inside a private network namespace",
)


def H(i: int) -> bytes:
    return hash_block(None, [i])


@pytest.fixture
def master(tmp_path):
    m = launcher.MooncakeMaster(log_path=tmp_path / "master.log").start()
    yield m
    m.stop()


def make_tier(address, **kw):
    from agentx.engine.offload.mooncake import MooncakeTier

    kw.setdefault("timeout_s", 2.0)
    kw.setdefault("retry_interval_s", 0.2)
    return MooncakeTier(address, PAGE, fingerprint="reliability", **kw)


def put(tier, i: int) -> list[bool]:
    planned = tier.prepare_store([H(i)])
    ok = tier.write(planned, [torch.full((PAGE,), i, dtype=torch.uint8)])
    tier.complete_store(planned, ok)
    return ok


def read(tier, i: int) -> torch.Tensor | None:
    page = torch.zeros(PAGE, dtype=torch.uint8)
    assert tier.prepare_load([H(i)]) == 1
    (ok,) = tier.read([H(i)], [page])
    tier.complete_load([H(i)])
    return page if ok else None


def wait_healthy(tier, timeout=10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not tier.healthy:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_a_client_refuses_to_start_outside_a_private_namespace(monkeypatch):
    from agentx.engine.offload import mooncake

    monkeypatch.setattr(mooncake, "has_private_network", lambda: False, raising=False)
    monkeypatch.setattr(launcher, "has_private_network", lambda: False)
    with pytest.raises(OffloadError, match="private network namespace"):
        make_tier("127.0.0.1:1")


@private
def test_a_damaged_object_is_a_miss(master):
    tier = make_tier(master.address)
    try:
        assert put(tier, 3) == [True]
        assert int(read(tier, 3)[0]) == 3
        size = getattr(tier, "object_bytes", PAGE)
        key = tier.key(H(3))
        assert tier._store.upsert(key, bytes([7]) * size) == 0  # same key, other bytes
        assert read(tier, 3) is None
        tier.check_integrity()
    finally:
        tier.close()


@private
def test_a_timed_out_put_never_stores_other_bytes_under_its_key(master):
    tier = make_tier(master.address, timeout_s=0.3)
    real_put = tier._store.batch_put_from
    calls = []

    def slow_put(*args):
        calls.append(args[0])
        if len(calls) == 1:
            time.sleep(1.0)  # past the timeout: the caller gives up, the put goes on
        return real_put(*args)

    class SlowStore:  # the client's methods are read-only: wrap it
        def __init__(self, store):
            self._store = store

        def __getattr__(self, name):
            return getattr(self._store, name)

        batch_put_from = staticmethod(slow_put)

    tier._store = SlowStore(tier._store)
    try:
        assert put(tier, 1) == [False]  # timed out; the put still runs, reading the staging rows
        assert wait_healthy(tier)  # the probe finds the master fine meanwhile
        assert len(calls) == 1
        # the next write must not copy its page into the rows the stuck put is reading
        assert tier.write([H(2)], [torch.full((PAGE,), 2, dtype=torch.uint8)]) == [False]
        time.sleep(1.0)  # the stuck put returns
        assert wait_healthy(tier)
        page = read(tier, 1) if tier.contains([H(1)]) == [True] else None
        assert page is None or int(page.max()) == int(page.min()) == 1
    finally:
        tier.close()


@private
def test_a_failed_engine_stops_the_master_it_started(monkeypatch):
    started = []

    class Recorded(launcher.MooncakeMaster):
        def start(self, timeout: float = 10.0):
            started.append(self)
            return super().start(timeout)

    def refuse(*args, **kwargs):
        raise RuntimeError("offload manager refused")

    monkeypatch.setattr("agentx.engine.offload.build.MooncakeMaster", Recorded)
    monkeypatch.setattr("agentx.engine.core.OffloadManager", refuse)
    offload = OffloadConfig(mooncake="auto", mooncake_bytes=16 << 20)
    with pytest.raises(RuntimeError, match="refused"):
        Engine(EngineConfig(cache=CacheConfig(num_blocks=16), offload=offload))
    assert len(started) == 1 and not started[0].running
