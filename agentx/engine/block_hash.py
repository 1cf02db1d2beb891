"""Block hashes: the key of a full block in the prefix cache, in every tier.

A block's hash covers its parent's hash, its own token ids and extra keys (an isolation salt,
later a LoRA or multimodal id), so equal hashes mean equal prefixes, not merely equal blocks.
The digest is stable across processes (no ``hash()`` randomisation, no PYTHONHASHSEED), which
the disk and Mooncake tiers rely on to share blocks between engines, and the router's prefix
index relies on to name the same blocks the replicas cache.

A leaf module: the KV cache, the requests, the offload tiers and the router all import it, and
it imports nothing of agentx's.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

__all__ = [
    "NULL_BLOCK_ID",
    "BlockHash",
    "extend_block_hashes",
    "hash_block",
    "hash_partial_block",
    "parent_key",
    "salt_key",
]

BlockHash = bytes

# block 0 of every pool: never allocated, never freed; the slot a padded block table points at
NULL_BLOCK_ID = 0

_DIGEST_BYTES = 16


def salt_key(cache_salt: str | None) -> bytes:
    """The extra key a request's cache salt adds to each of its block hashes."""
    return cache_salt.encode() if cache_salt else b""


def hash_block(
    parent: BlockHash | None, token_ids: Sequence[int], extra_keys: bytes = b""
) -> BlockHash:
    h = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    h.update(parent or b"\0" * _DIGEST_BYTES)
    h.update(array("q", token_ids).tobytes())
    h.update(extra_keys)
    return h.digest()


def parent_key(block_hashes: Sequence[BlockHash], index: int, extra_keys: bytes = b"") -> BlockHash:
    """The key block ``index``'s siblings share: the previous block's hash, or for the first
    block a root key of the extra keys (longer than a digest, so it equals no block's hash)."""
    return block_hashes[index - 1] if index > 0 else b"\0" * (_DIGEST_BYTES + 1) + extra_keys


def extend_block_hashes(
    block_hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: bytes = b"",
) -> None:
    """Append the hashes of every newly full block of ``token_ids`` to ``block_hashes``.

    ``block_hashes`` already covers the first ``len(block_hashes)`` blocks; a trailing partial
    block is not hashed (its content is not final).
    """
    num_full = len(token_ids) // block_size
    parent = block_hashes[-1] if block_hashes else None
    for i in range(len(block_hashes), num_full):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], extra_keys)
        block_hashes.append(parent)


def hash_partial_block(
    parent: BlockHash | None, token_ids: Sequence[int], extra_keys: bytes = b""
) -> BlockHash:
    """The tier key of a partial last block handed to another engine (offload/manager.py).

    A digest of its own personalization: it never equals a full block's hash, so the prefix
    cache never finds a partial block under it.
    """
    h = hashlib.blake2b(digest_size=_DIGEST_BYTES, person=b"agentx:tail")
    h.update(parent or b"\0" * _DIGEST_BYTES)
    h.update(array("q", token_ids).tobytes())
    h.update(extra_keys)
    return h.digest()
