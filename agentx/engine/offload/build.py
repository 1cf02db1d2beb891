"""One call that builds the tier chain the engine asked for (host -> disk -> Mooncake)."""

from __future__ import annotations

import os

from agentx.config import OffloadConfig
from agentx.engine.offload.base import KVTier
from agentx.engine.offload.disk import DiskTier
from agentx.engine.offload.fingerprint import layout_fingerprint
from agentx.engine.offload.host import HostTier
from agentx.engine.offload.mooncake import MooncakeTier
from agentx.engine.offload.mooncake_master import MooncakeMaster
from agentx.engine.offload.tiered import TieredStore

__all__ = ["build_tiered_store", "layout_fingerprint", "store_from_config"]


def build_tiered_store(
    page_bytes: int,
    fingerprint: str,
    host_blocks: int = 0,
    disk_root: str | os.PathLike | None = None,
    disk_bytes: int = 0,
    mooncake_address: str | None = None,
    mooncake_segment_bytes: int = 64 << 20,
    mooncake_allow_network: bool = False,
) -> TieredStore | None:
    """The tiers whose sizes are given, top-down; None when none is.

    ``fingerprint`` names the model and page layout (model id, dtype, block size, layer
    layout): the disk folder and the Mooncake keys are namespaced by it. ``mooncake_address``
    is a running master's ``host:port`` (see ``MooncakeMaster`` to start one on loopback).
    """
    tiers: list[KVTier] = []
    if host_blocks > 0:
        tiers.append(HostTier(page_bytes, host_blocks))
    if disk_root is not None and disk_bytes > 0:
        tiers.append(DiskTier(disk_root, fingerprint, page_bytes, disk_bytes))
    if mooncake_address:
        tiers.append(
            MooncakeTier(
                mooncake_address,
                page_bytes,
                fingerprint,
                segment_bytes=mooncake_segment_bytes,
                allow_network=mooncake_allow_network,
            )
        )
    return TieredStore(tiers) if tiers else None


def store_from_config(
    config: OffloadConfig, page_bytes: int, fingerprint: str
) -> tuple[TieredStore | None, MooncakeMaster | None]:
    """The tiers an engine's OffloadConfig asks for, and the Mooncake master it started
    (``mooncake="auto"``; the caller stops it on close)."""
    master = None
    address = config.mooncake
    if address == "auto":
        master = MooncakeMaster(allow_network=config.mooncake_allow_network).start()
        address = master.address
    try:
        store = build_tiered_store(
            page_bytes,
            fingerprint,
            host_blocks=config.host_bytes // page_bytes,
            disk_root=config.disk_path,
            disk_bytes=config.disk_bytes,
            mooncake_address=address,
            mooncake_segment_bytes=config.mooncake_bytes,
            mooncake_allow_network=config.mooncake_allow_network,
        )
    except BaseException:  # a master started for tiers that never came up is stopped
        if master is not None:
            master.stop()
        raise
    return store, master
