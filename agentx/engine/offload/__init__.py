"""KV offload below device memory: tier interface, host / disk / Mooncake tiers, the tiered
store that chains them and the transfer worker that moves their bytes off the engine thread.

Driven by the engine core; knows block hashes and byte pages, never requests or the scheduler.
The Mooncake package is imported only when a Mooncake tier connects.
"""

from agentx.engine.offload.base import EvictedBlock, KVTier, TierStats
from agentx.engine.offload.build import build_tiered_store
from agentx.engine.offload.disk import DiskTier
from agentx.engine.offload.host import HostTier
from agentx.engine.offload.mooncake import MooncakeTier
from agentx.engine.offload.mooncake_master import MooncakeMaster, has_private_network
from agentx.engine.offload.tiered import TieredStore, TierLookup, TransferTicket
from agentx.engine.offload.transfer import TransferEvent, TransferJob, TransferWorker

__all__ = [
    "DiskTier",
    "EvictedBlock",
    "HostTier",
    "KVTier",
    "MooncakeMaster",
    "MooncakeTier",
    "TierLookup",
    "TierStats",
    "TieredStore",
    "TransferEvent",
    "TransferJob",
    "TransferTicket",
    "TransferWorker",
    "build_tiered_store",
    "has_private_network",
]
