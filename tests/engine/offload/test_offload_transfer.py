"""The transfer worker and the tiered store: queued stores and loads, events, promotion,
demotion, failures midway."""

import threading

import pytest
import torch

from agentx.engine.block_hash import hash_block
from agentx.engine.offload import (
    DiskTier,
    HostTier,
    TieredStore,
    TransferEvent,
    TransferJob,
    TransferWorker,
)

PAGE = 64


def H(i: int) -> bytes:
    return hash_block(None, [i])


def pages_of(ids) -> list[torch.Tensor]:
    return [torch.full((PAGE,), i, dtype=torch.uint8) for i in ids]


def empty(n) -> list[torch.Tensor]:
    return [torch.zeros(PAGE, dtype=torch.uint8) for _ in range(n)]


def drain(store: TieredStore) -> list[TransferEvent]:
    assert store.wait_idle(10)
    events = store.take_events()
    store.check_integrity()
    return events


@pytest.fixture
def tiers(tmp_path):
    host = HostTier(PAGE, num_blocks=2)
    disk = DiskTier(tmp_path, "m", PAGE, capacity_bytes=1 << 20)
    store = TieredStore([host, disk])
    yield store
    store.close()


def test_store_then_load_from_host(tiers):
    ticket = tiers.store([H(0), H(1)], pages_of([0, 1]))
    assert ticket.kind == "store" and tiers.num_pending == 1
    (ev,) = drain(tiers)
    assert (ev.job_id, ev.kind, ev.done, ev.failed) == (ticket.job_id, "store", (H(0), H(1)), ())
    assert tiers.lookup([H(0), H(1), H(2)]).tiers == ("host", "host")
    dst = empty(3)
    ticket = tiers.load([H(0), H(1), H(2)], dst)
    assert ticket.hashes == (H(0), H(1))  # the hit prefix
    (ev,) = drain(tiers)
    assert ev.done == (H(0), H(1)) and ev.ok
    assert [int(p[0]) for p in dst] == [0, 1, 0]
    assert tiers.num_hits == {"host": 2, "disk": 0} and tiers.num_misses == 1


def test_store_again_is_done_not_rewritten(tiers):
    tiers.store([H(0)], pages_of([0]))
    drain(tiers)
    tiers.store([H(0), H(1)], pages_of([0, 1]))
    (ev,) = drain(tiers)
    assert ev.done == (H(0), H(1))
    assert tiers.get_tier("host").get_stats().num_stored == 2


def test_demote_on_host_eviction(tiers):
    tiers.store([H(0), H(1), H(2)], pages_of([0, 1, 2]))  # host holds 2, both in flight
    (ev,) = drain(tiers)
    assert ev.done == (H(0), H(1)) and ev.skipped == (H(2),)
    tiers.store([H(2)], pages_of([2]))  # now block 0 is evicted and goes down
    (ev,) = drain(tiers)
    assert ev.done == (H(2),)
    assert tiers.lookup([H(0), H(1), H(2)]).tiers == ("disk", "host", "host")
    dst = empty(1)
    tiers.load([H(0)], dst)
    drain(tiers)
    assert int(dst[0][0]) == 0  # demoted bytes are the evicted block's, not its successor's


def test_promote_on_lower_hit(tiers):
    tiers.store([H(5), H(6)], pages_of([5, 6]), tiers=["disk"])
    drain(tiers)
    assert tiers.lookup([H(5), H(6)]).tiers == ("disk", "disk")
    dst = empty(2)
    tiers.load([H(5), H(6)], dst)
    (ev,) = drain(tiers)
    assert ev.done == (H(5), H(6)) and [int(p[0]) for p in dst] == [5, 6]
    assert tiers.lookup([H(5), H(6)]).tiers == ("host", "host")
    assert tiers.num_hits["disk"] == 2


def test_load_failure_midway_fails_the_rest(tiers, monkeypatch):
    tiers.store([H(0), H(1), H(2)], pages_of([0, 1, 2]), tiers=["disk"])
    drain(tiers)
    disk = tiers.get_tier("disk")
    real = disk._read_block

    def flaky(block_hash, entry, page):
        if block_hash == H(1):
            raise OSError("device gone")
        return real(block_hash, entry, page)

    monkeypatch.setattr(disk, "_read_block", flaky)
    tiers.load([H(0), H(1), H(2)], empty(3))
    (ev,) = drain(tiers)  # integrity: no pin left behind
    assert ev.kind == "load" and ev.done == () and ev.failed == (H(0), H(1), H(2))
    assert tiers.lookup([H(0)]).tiers == ("disk",)


def test_load_checksum_failure_is_a_prefix(tiers):
    tiers.store([H(0), H(1), H(2)], pages_of([0, 1, 2]), tiers=["disk"])
    drain(tiers)
    disk = tiers.get_tier("disk")
    path = disk.path_of(H(1))
    path.write_bytes(path.read_bytes()[:-1] + b"\xff")
    tiers.load([H(0), H(1), H(2)], empty(3))
    (ev,) = drain(tiers)
    assert ev.done == (H(0),) and ev.failed == (H(1), H(2))
    assert tiers.lookup([H(0), H(1)]).num_hits == 1  # promoted 0 only; 1 is gone


def test_store_failure_midway(tiers, monkeypatch):
    host = tiers.get_tier("host")
    monkeypatch.setattr(host, "_write_block", lambda *a: (_ for _ in ()).throw(RuntimeError()))
    tiers.store([H(0), H(1)], pages_of([0, 1]), tiers=["host", "disk"])
    (ev,) = drain(tiers)
    assert ev.done == () and ev.failed == (H(0), H(1))
    assert tiers.lookup([H(0)]).num_hits == 0


def test_unhealthy_or_full_tier_skips(tmp_path):
    host = HostTier(PAGE, num_blocks=1)
    store = TieredStore([host])
    held = host.prepare_store([H(9)])  # the only slot is in flight
    store.store([H(0)], pages_of([0]))
    assert store.wait_idle(10)
    (ev,) = store.take_events()
    assert ev.skipped == (H(0),) and ev.done == ev.failed == ()
    host.complete_store(held, [False])
    store.check_integrity()
    store.close()


def test_pin_and_drop_reach_every_tier(tiers):
    tiers.store([H(0)], pages_of([0]), tiers=["host", "disk"])
    drain(tiers)
    tiers.pin([H(0)])
    assert [s.num_pinned for s in tiers.get_stats()] == [1, 1]
    tiers.drop([H(0)])
    assert [s.num_blocks for s in tiers.get_stats()] == [0, 0]


class _Gate(TransferJob):
    kind = "store"
    hashes = ()

    def __init__(self, job_id, gate):
        self.job_id, self.gate = job_id, gate

    def run(self):
        assert self.gate.wait(10)
        return TransferEvent(self.job_id, "store", (), ())

    def fail(self, exc):
        return TransferEvent(self.job_id, "store", (), ())


def test_submit_never_blocks_and_events_keep_order():
    worker = TransferWorker()
    gates = [threading.Event(), threading.Event()]
    worker.submit(_Gate(1, gates[0]))
    worker.submit(_Gate(2, gates[1]))  # queued behind a blocked job: the caller goes on
    assert worker.take_events() == [] and worker.num_pending == 2
    gates[0].set()
    assert not worker.wait_idle(0.05)
    assert [e.job_id for e in worker.take_events()] == [1]
    gates[1].set()
    worker.close()
    assert [e.job_id for e in worker.take_events()] == [2]
    with pytest.raises(RuntimeError):
        worker.submit(_Gate(3, gates[0]))


class _Broken(_Gate):
    hashes = (H(0),)

    def run(self):
        raise RuntimeError("midway")

    def fail(self, exc):
        raise RuntimeError("and its cleanup too")


def test_worker_survives_a_job_whose_cleanup_fails():
    worker = TransferWorker()
    opened = threading.Event()
    opened.set()
    worker.submit(_Broken(1, None))
    worker.submit(_Gate(2, opened))
    assert worker.wait_idle(10)
    first, second = worker.take_events()
    assert (first.job_id, first.done, first.failed) == (1, (), (H(0),))
    assert second.job_id == 2
    worker.close()


def test_random_ops_never_serve_wrong_bytes(tmp_path):
    """Seeded random stores / loads / pins / drops through host(3) -> disk(5): every loaded
    page equals what was stored under its hash, and the bookkeeping stays consistent."""
    import random

    rng = random.Random(0)
    host = HostTier(PAGE, num_blocks=3)
    disk = DiskTier(tmp_path, "m", PAGE, capacity_bytes=5 * (PAGE + 48))
    store = TieredStore([host, disk])
    num_loaded = 0
    try:
        for step in range(150):
            ids = rng.sample(range(12), rng.randint(1, 4))
            op = rng.random()
            if op < 0.4:
                store.store([H(i) for i in ids], pages_of(ids), tiers=rng.choice([None, ["disk"]]))
            elif op < 0.8:
                dst = empty(len(ids))
                ticket = store.load([H(i) for i in ids], dst)
                assert store.wait_idle(10)
                for ev in store.take_events():
                    if ev.job_id == ticket.job_id:
                        for h, page in zip(ev.done, dst, strict=False):
                            assert (
                                int(page.min())
                                == int(page.max())
                                == ids[[H(i) for i in ids].index(h)]
                            )
                            num_loaded += 1
            elif op < 0.9:
                store.pin([H(i) for i in ids])
            else:
                store.drop([H(i) for i in ids])
            if step % 10 == 0:
                drain(store)
        drain(store)
        assert num_loaded > 20
    finally:
        store.close()
