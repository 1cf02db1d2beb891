"""Mooncake Store tier against a real ``mooncake_master`` on loopback.

Mooncake clients bind every interface, so these tests start Mooncake only inside a private
network namespace (``make test`` runs pytest under ``unshare -n``); elsewhere they are skipped
with that reason, and only the refusal itself is tested.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from agentx.engine.block_hash import hash_block
from agentx.engine.offload import HostTier, TieredStore
from agentx.engine.offload import mooncake_master as launcher
from agentx.errors import OffloadError

PAGE = 4096
ROOT = Path(__file__).resolve().parents[3]

private = pytest.mark.skipif(
    not launcher.has_private_network(),
    reason="Mooncake binds every interface: run inside a private network namespace "
    "(make test runs pytest under unshare -n)",
)


def H(i: int) -> bytes:
    return hash_block(None, [i])


def pages_of(ids) -> list[torch.Tensor]:
    return [torch.full((PAGE,), i, dtype=torch.uint8) for i in ids]


def empty(n) -> list[torch.Tensor]:
    return [torch.zeros(PAGE, dtype=torch.uint8) for _ in range(n)]


def put(tier, ids) -> list[bool]:
    hashes = [H(i) for i in ids]
    planned = tier.prepare_store(hashes)
    ok = tier.write(planned, pages_of([ids[hashes.index(h)] for h in planned]))
    tier.complete_store(planned, ok)
    return ok


def wait_until(cond, timeout=15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return False


@pytest.fixture
def master(tmp_path):
    m = launcher.MooncakeMaster(log_path=tmp_path / "master.log").start()
    yield m
    m.stop()


def make_tier(address, **kw):
    from agentx.engine.offload.mooncake import MooncakeTier

    kw.setdefault("timeout_s", 2.0)
    kw.setdefault("retry_interval_s", 0.2)
    return MooncakeTier(address, PAGE, fingerprint="smollm2-fp32-b16", **kw)


def test_refuses_to_start_outside_a_private_namespace(monkeypatch):
    monkeypatch.setattr(launcher, "has_private_network", lambda: False)
    with pytest.raises(OffloadError, match="private network namespace"):
        launcher.MooncakeMaster().start()


@private
def test_put_get_roundtrip(master):
    tier = make_tier(master.address)
    try:
        assert tier.healthy
        assert put(tier, [0, 1, 2]) == [True, True, True]
        assert tier.lookup([H(0), H(1), H(2), H(3)]) == 3
        assert tier.prepare_store([H(1), H(3)]) == [H(3)]  # present ones are skipped
        tier.complete_store([H(3)], [False])
        dst = empty(3)
        assert tier.prepare_load([H(0), H(1), H(2)]) == 3
        assert tier.read([H(0), H(1), H(2)], dst) == [True, True, True]
        tier.complete_load([H(0), H(1), H(2)])
        assert [int(p[0]) for p in dst] == [0, 1, 2]
        assert put(tier, [5]) == [True]
        tier.drop([H(5), H(1)])  # 1 was just read: its lease keeps it (the master frees it later)
        assert tier.contains([H(5), H(1)]) == [False, True]
        tier.check_integrity()
        assert tier.get_stats().num_in_flight == 0
    finally:
        tier.close()


PEER = textwrap.dedent(
    """
    import sys, torch
    from agentx.engine.block_hash import hash_block
    from agentx.engine.offload.mooncake import MooncakeTier
    H = lambda i: hash_block(None, [i])
    print("READY", flush=True)
    tier = MooncakeTier(sys.stdin.readline().strip(), 4096, fingerprint="smollm2-fp32-b16")
    hashes = [H(i) for i in (10, 11)]
    planned = tier.prepare_store(hashes)
    ok = tier.write(planned, [torch.full((4096,), i, dtype=torch.uint8) for i in (10, 11)])
    tier.complete_store(planned, ok)
    mine = [H(0), H(1)]
    num = tier.prepare_load(mine)
    dst = [torch.zeros(4096, dtype=torch.uint8) for _ in range(num)]
    got = tier.read(mine[:num], dst)
    tier.complete_load(mine[:num])
    print("PEER", ok, tier.lookup(mine), got, [int(p.sum()) for p in dst], flush=True)
    sys.stdin.readline()  # keep this client (and its segment) alive until told
    tier.close()
    """
)


@pytest.fixture(scope="module")
def peer():
    """A second engine process, started early: importing agentx takes seconds, so it imports
    while the other tests of this module run, then waits for a master address on stdin."""
    if not launcher.has_private_network():
        yield None
        return
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", PEER],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        text=True, env=env,
    )  # fmt: skip
    yield proc
    proc.kill()
    proc.wait()


@pytest.fixture(autouse=True)
def _start_peer_early(peer):
    """Every test of this module asks for the peer, so the first one starts it."""


@private
def test_master_killed_then_restarted(master):
    tier = make_tier(master.address)
    store = TieredStore([HostTier(PAGE, num_blocks=4), tier])
    try:
        store.store([H(0)], pages_of([0]), tiers=["mooncake"])
        assert store.wait_idle(10) and store.take_events()[0].done == (H(0),)
        master.kill()
        start = time.monotonic()
        assert tier.lookup([H(0)]) == 0  # the dead master makes a miss, quickly
        assert not tier.healthy
        assert store.lookup([H(0)]).num_hits == 0
        store.store([H(1)], pages_of([1]), tiers=["mooncake"])
        assert store.wait_idle(10)
        (ev,) = store.take_events()
        assert ev.skipped == (H(1),)
        assert time.monotonic() - start < 5
        store.check_integrity()

        master.start()  # same port: the tier reconnects by itself
        assert wait_until(lambda: tier.healthy)
        assert tier.lookup([H(0)]) == 0  # a restarted master has lost its objects

        def stored_again():  # the client remounts its segment a moment after the restart
            store.store([H(2)], pages_of([2]), tiers=["mooncake"])
            assert store.wait_idle(10)
            return store.take_events()[0].done == (H(2),)

        assert wait_until(stored_again)
        dst = empty(1)
        store.load([H(2)], dst)
        assert store.wait_idle(10) and store.take_events()[0].done == (H(2),)
        assert int(dst[0][0]) == 2
        store.check_integrity()
    finally:
        store.close()


@private
def test_master_absent_is_unhealthy_not_hanging():
    start = time.monotonic()
    tier = make_tier(f"127.0.0.1:{launcher.free_port()}")
    try:
        assert not tier.healthy
        assert tier.lookup([H(0)]) == 0 and tier.prepare_store([H(0)]) == []
        assert tier.prepare_load([H(0)]) == 0
        assert time.monotonic() - start < 10  # no connect retries for minutes
    finally:
        tier.close()


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


@private
def test_hung_master_times_out_then_recovers(master):
    tier = make_tier(master.address, lookup_timeout_s=0.3)
    try:
        assert put(tier, [0]) == [True]
        os.kill(master.pid, signal.SIGSTOP)  # alive but silent: TCP still connects
        try:
            # the signal lands when the master is next scheduled: a lookup sent before that
            # would still be answered
            assert wait_until(lambda: _state(master.pid) == "T")
            start = time.monotonic()
            assert tier.lookup([H(0)]) == 0
            # the 0.3 s timeout answered, not TCP's (minutes): a bound a loaded box keeps
            assert time.monotonic() - start < 10
            assert not tier.healthy and tier.prepare_store([H(1)]) == []
        finally:
            os.kill(master.pid, signal.SIGCONT)
        assert wait_until(lambda: tier.healthy)
        assert tier.lookup([H(0)]) == 1  # the same master: its objects are still there
    finally:
        tier.close()


@private
def test_three_tiers_promote_from_mooncake(master, tmp_path):
    from agentx.engine.offload import build_tiered_store

    store = build_tiered_store(
        PAGE, "smollm2-fp32-b16", host_blocks=2, disk_root=tmp_path, disk_bytes=1 << 20,
        mooncake_address=master.address,
    )  # fmt: skip
    try:
        assert [t.name for t in store.tiers] == ["host", "disk", "mooncake"]
        store.store([H(0), H(1)], pages_of([0, 1]), tiers=["mooncake"])
        store.store([H(2)], pages_of([2]), tiers=["disk"])
        assert store.wait_idle(10) and all(e.ok for e in store.take_events())
        hit = store.lookup([H(0), H(1), H(2), H(3)])
        assert hit.tiers == ("mooncake", "mooncake", "disk")
        dst = empty(4)
        assert store.load([H(0), H(1), H(2), H(3)], dst).hashes == (H(0), H(1), H(2))
        assert store.wait_idle(10)
        (ev,) = store.take_events()
        assert ev.done == (H(0), H(1), H(2)) and [int(p[0]) for p in dst[:3]] == [0, 1, 2]
        # host holds 2: 0 and 1 were promoted; 2 did not fit (0 and 1 were in flight)
        assert store.lookup([H(0), H(1), H(2)]).tiers == ("host", "host", "disk")
        store.check_integrity()
    finally:
        store.close()


@private
def test_two_processes_share_blocks(master, peer):
    tier = make_tier(master.address)
    try:
        assert put(tier, [0, 1]) == [True, True]
        assert peer.stdout.readline() == "READY\n"
        peer.stdin.write(master.address + "\n")
        peer.stdin.flush()
        line = peer.stdout.readline()
        assert line.split(" ", 1) == ["PEER", f"[True, True] 2 [True, True] [0, {PAGE}]\n"]
        # and this process reads what the peer stored, while the peer is alive
        assert tier.lookup([H(10), H(11)]) == 2
        dst = empty(2)
        tier.prepare_load([H(10), H(11)])
        assert tier.read([H(10), H(11)], dst) == [True, True]
        tier.complete_load([H(10), H(11)])
        assert [int(p[0]) for p in dst] == [10, 11]
        peer.communicate("\n", timeout=20)
    finally:
        tier.close()
