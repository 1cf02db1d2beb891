"""Exact-state tests of the host and disk tiers: LRU order, pins, in-flight protection, capacity,
restart warm, corruption = miss, disk full = skipped with one warning."""

import errno
import logging

import pytest
import torch

from agentx.engine.block_hash import hash_block
from agentx.engine.offload import DiskTier, HostTier
from agentx.errors import ConfigError

PAGE = 64


def H(i: int) -> bytes:
    return hash_block(None, [i])


def page(i: int) -> torch.Tensor:
    return torch.full((PAGE,), i % 251, dtype=torch.uint8)


def put(tier, ids):
    """Store the blocks synchronously (prepare, write, complete); return what was planned."""
    hashes = [H(i) for i in ids]
    planned = tier.prepare_store(hashes)
    pages = [page(ids[hashes.index(h)]) for h in planned]
    ok = tier.write(planned, pages)
    tier.complete_store(planned, ok)
    tier.check_integrity()
    return [ids[hashes.index(h)] for h in planned]


def get(tier, ids):
    hashes = [H(i) for i in ids]
    num = tier.prepare_load(hashes)
    pages = [torch.zeros(PAGE, dtype=torch.uint8) for _ in range(num)]
    ok = tier.read(hashes[:num], pages)
    tier.complete_load(hashes[:num])
    tier.check_integrity()
    return ok, pages


def lru(tier):
    return [[H(i) for i in range(100)].index(h) for h in tier.get_lru_order()]


@pytest.fixture(params=["host", "disk"])
def tier4(request, tmp_path):
    """A tier with room for exactly 4 blocks."""
    if request.param == "host":
        return HostTier(PAGE, num_blocks=4)
    probe = DiskTier(tmp_path, "m", PAGE, capacity_bytes=1)
    return DiskTier(tmp_path, "m", PAGE, capacity_bytes=4 * probe.file_bytes)


def test_store_lookup_roundtrip(tier4):
    assert put(tier4, [0, 1, 2]) == [0, 1, 2]
    assert put(tier4, [1, 2, 3]) == [3]  # present ones are skipped
    assert tier4.lookup([H(0), H(1), H(9), H(3)]) == 2
    ok, pages = get(tier4, [0, 1, 2, 9])
    assert ok == [True, True, True]
    assert [int(p[0]) for p in pages] == [0, 1, 2]
    stats = tier4.get_stats()
    assert (stats.num_blocks, stats.num_stored, stats.num_loaded, stats.num_in_flight) == (
        4,
        4,
        3,
        0,
    )


def test_lru_eviction_order(tier4):
    put(tier4, [0, 1, 2, 3])
    get(tier4, [0])  # 0 becomes most recent
    assert lru(tier4) == [1, 2, 3, 0]
    assert put(tier4, [4, 5]) == [4, 5]
    assert lru(tier4) == [3, 0, 4, 5]
    assert tier4.get_stats().num_evicted == 2


def test_pinned_evicted_last(tier4):
    put(tier4, [0, 1, 2, 3])
    tier4.pin([H(0), H(1)])
    put(tier4, [4, 5])
    assert lru(tier4) == [0, 1, 4, 5]
    put(tier4, [6, 7, 8])  # only pinned ones are left to evict: oldest pinned goes first
    assert lru(tier4) == [1, 6, 7, 8]
    tier4.unpin([H(1)])
    assert tier4.get_stats().num_pinned == 0


def test_in_flight_never_evicted(tier4):
    put(tier4, [0, 1])
    storing = tier4.prepare_store([H(2), H(3)])
    assert tier4.prepare_load([H(0), H(1)]) == 2
    assert tier4.prepare_store([H(4)]) == []  # all four are in flight: no room
    assert tier4.lookup([H(2)]) == 0  # a storing block is invisible
    assert tier4.get_stats().num_in_flight == 4
    tier4.complete_load([H(0), H(1)])
    assert lru(tier4) == [2, 3, 0, 1]  # a load is a use
    assert tier4.prepare_store([H(4)]) == [H(4)]  # 0 is the least recent idle block
    assert lru(tier4) == [2, 3, 1, 4]
    tier4.complete_store(storing, [True, False])  # a failed store is forgotten
    tier4.complete_store([H(4)], [False])
    assert lru(tier4) == [1, 2]  # a completed store is the most recent use
    tier4.check_integrity()


def test_drop_in_flight_lands_dropped(tier4):
    put(tier4, [0, 1])
    assert tier4.prepare_load([H(0)]) == 1
    tier4.drop([H(0), H(1), H(7)])
    assert lru(tier4) == [0]  # still being read
    assert tier4.lookup([H(0)]) == 0
    tier4.complete_load([H(0)])
    assert lru(tier4) == []
    tier4.check_integrity()


def test_host_slots_and_evicted_pages():
    host = HostTier(PAGE, num_blocks=2)
    host.record_evictions = True
    put(host, [0, 1])
    put(host, [2])
    (evicted,) = host.take_evicted()
    assert evicted.block_hash == H(0)
    assert int(evicted.page[0]) == 2  # the slot was reused by block 2
    assert host.take_evicted() == []
    assert int(host.get_page(H(1))[0]) == 1
    assert host.get_page(H(0)) is None


def test_disk_restart_warm(tmp_path):
    disk = DiskTier(tmp_path, "llama-fp32-b16", PAGE, capacity_bytes=1 << 20)
    put(disk, [0, 1, 2])
    get(disk, [0])
    disk.close()
    again = DiskTier(tmp_path, "llama-fp32-b16", PAGE, capacity_bytes=1 << 20)
    assert again.lookup([H(0), H(1), H(2)]) == 3
    assert set(lru(again)) == {0, 1, 2}
    ok, pages = get(again, [1, 2])
    assert ok == [True, True] and int(pages[1][0]) == 2
    other = DiskTier(tmp_path, "gemma-bf16-b16", PAGE, capacity_bytes=1 << 20)
    assert other.lookup([H(0)]) == 0  # another fingerprint never sees these pages


def test_disk_restart_respects_capacity(tmp_path):
    disk = DiskTier(tmp_path, "m", PAGE, capacity_bytes=1 << 20)
    put(disk, [0, 1, 2])
    small = DiskTier(tmp_path, "m", PAGE, capacity_bytes=2 * disk.file_bytes)
    assert small.get_stats().num_blocks == 2
    small.check_integrity()


def test_disk_corrupt_block_is_a_miss(tmp_path, caplog):
    disk = DiskTier(tmp_path, "m", PAGE, capacity_bytes=1 << 20)
    put(disk, [0, 1])
    path = disk.path_of(H(1))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        ok, _ = get(disk, [0, 1])
    assert ok == [True, False]
    assert "checksum" in caplog.text
    assert disk.lookup([H(0), H(1)]) == 1  # never served again
    put(disk, [2])  # the worker's next write deletes the bad file
    assert not path.exists()


def test_disk_truncated_file_dropped_on_restart(tmp_path):
    disk = DiskTier(tmp_path, "m", PAGE, capacity_bytes=1 << 20)
    put(disk, [0, 1])
    path = disk.path_of(H(0))
    path.write_bytes(path.read_bytes()[:10])
    again = DiskTier(tmp_path, "m", PAGE, capacity_bytes=1 << 20)
    assert again.lookup([H(0)]) == 0 and again.lookup([H(1)]) == 1
    assert not path.exists()


def test_disk_full_skips_with_one_warning(tmp_path, caplog, monkeypatch):
    disk = DiskTier(tmp_path, "m", PAGE, capacity_bytes=1 << 20)
    real = disk._write_file

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk, "_write_file", full)
    with caplog.at_level(logging.WARNING):
        assert put(disk, [0, 1, 2]) == [0, 1, 2]
        put(disk, [3])
    assert caplog.text.count("disk full") == 1
    assert disk.lookup([H(0)]) == 0 and disk.get_stats().num_failed == 4
    assert list(disk.folder.glob("*/*")) == []  # no temp file left behind
    monkeypatch.setattr(disk, "_write_file", real)
    put(disk, [4])
    assert disk.lookup([H(4)]) == 1


def test_disk_start_up_skips_stray_entries(tmp_path, caplog):
    disk = DiskTier(tmp_path, "m", PAGE, capacity_bytes=1 << 20)
    put(disk, [0, 1])
    disk.close()
    fan_out = disk.path_of(H(0)).parent
    stray_dir = fan_out / ("ab" * 16 + ".kv")  # a directory named like a block
    stray_dir.mkdir()
    dangling = fan_out / ("cd" * 16 + ".kv")  # a link named like a block, pointing nowhere
    dangling.symlink_to(tmp_path / "gone")
    tmp_dir = fan_out / "ef.kv.tmp123"  # a directory named like a leftover temp file
    tmp_dir.mkdir()
    with caplog.at_level(logging.WARNING):
        again = DiskTier(tmp_path, "m", PAGE, capacity_bytes=1 << 20)
    assert again.num_skipped_entries == 3
    assert "skipped 3 unreadable entries" in caplog.text
    assert again.lookup([H(0), H(1)]) == 2  # the good blocks are all still served
    assert again.get_stats().num_blocks == 2
    assert stray_dir.is_dir() and tmp_dir.is_dir()  # never deleted: not ours to remove
    again.check_integrity()


def test_disk_start_up_skips_an_unlistable_fan_out_folder(tmp_path, caplog, monkeypatch):
    disk = DiskTier(tmp_path, "m", PAGE, capacity_bytes=1 << 20)
    put(disk, [0])
    bad = disk.path_of(H(0)).parent
    real = type(bad).iterdir

    def iterdir(self):
        if self == bad:  # root ignores mode bits, so a chmod 000 cannot show this in tests
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(type(bad), "iterdir", iterdir)
    with caplog.at_level(logging.WARNING):
        again = DiskTier(tmp_path, "m", PAGE, capacity_bytes=1 << 20)
    assert again.num_skipped_entries == 1 and "Permission denied" in caplog.text
    assert again.get_stats().num_blocks == 0  # not indexed at start-up ...
    assert again.lookup([H(0)]) == 1  # ... but adopted when asked for (readable after all)


def test_disk_folder_that_cannot_be_used_is_a_config_error(tmp_path, monkeypatch):
    a_file = tmp_path / "not-a-folder"
    a_file.write_text("x")
    with pytest.raises(ConfigError, match="not-a-folder"):
        DiskTier(a_file, "m", PAGE, capacity_bytes=1 << 20)

    def read_only(self, *args, **kwargs):  # root ignores mode bits: a read-only mount
        raise OSError(errno.EROFS, "Read-only file system", str(self))

    monkeypatch.setattr(type(tmp_path), "write_text", read_only)
    with pytest.raises(ConfigError, match="Read-only file system"):
        DiskTier(tmp_path / "ro", "m", PAGE, capacity_bytes=1 << 20)
