"""Held conversations: what lets a stateless caller's turn N compute only its new tokens.

A Chat Completions caller re-sends the whole history every call. Rendering it afresh would
re-tokenize the model's own replies (the ids can differ from the ones it generated) and would
recompute the partial last block, so the service keeps, per recent reply, the exact token
history that produced it (a :class:`ChatContext`) and the engine's held KV for it. A new call
whose messages extend a held conversation's messages continues that context, so its prompt is
token-exact with the previous prompt + output, and names the held KV, so the engine adopts it
whole (partial tail block included)::

    held:    [system][u1][a1][t1][a2]              keys ("user", ...), ("assistant", ...), ...
    request: [system][u1][a1][t1][a2][t2][u3]      same setup, held keys are a prefix
                                      ^ only these are rendered, tokenized and computed

This file owns the bounded LRU of such conversations. Entries are keyed by their setup (system
text and tools, which make up the first message) and their message keys; the token prefix they
stand for is ``context.token_ids``. A lookup takes the entry out (its held KV moves to the
request that continues it), eviction and ``clear`` release the held KV, so nothing is leaked.
It does not know requests, sampling or the HTTP layer. Thread-safe: the sync client drives it
from its own loop thread.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from agentx.openai.requests import MessageKey
from agentx.session.context import ChatContext

__all__ = ["ConversationCache", "HeldConversation"]

Setup = tuple[str | None, ...]  # system text, tools JSON, cache salt


@dataclass(slots=True)
class HeldConversation:
    """One finished reply: the messages it ends (reply included), their exact token history,
    and the engine's held KV for those tokens (None when the engine kept none)."""

    setup: Setup
    keys: tuple[MessageKey, ...]
    context: ChatContext
    handle: str | None


class ConversationCache:
    """At most ``capacity`` held conversations, least recently stored evicted first.

    ``release`` gives a handle's held KV back to the engine (``Engine.release_held_soon``); it
    is called exactly once for every handle that leaves the cache other than by ``take``.
    """

    def __init__(self, capacity: int, release: Callable[[str], None]) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._release = release
        self._entries: OrderedDict[int, HeldConversation] = OrderedDict()
        self._next_id = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def take(self, setup: Setup, keys: tuple[MessageKey, ...]) -> HeldConversation | None:
        """Remove and return the longest held conversation that ``keys`` extend (or equal)
        under the same setup; None when there is none. The caller owns its handle now."""
        with self._lock:
            best_id, best_len = None, -1
            for entry_id, entry in self._entries.items():
                size = len(entry.keys)
                if entry.setup == setup and size > best_len and keys[:size] == entry.keys:
                    best_id, best_len = entry_id, size
            return None if best_id is None else self._entries.pop(best_id)

    def put(self, entry: HeldConversation) -> None:
        """Store a finished reply's conversation; evicts the oldest past capacity."""
        evicted = []
        with self._lock:
            self._entries[self._next_id] = entry
            self._next_id += 1
            while len(self._entries) > self.capacity:
                evicted.append(self._entries.popitem(last=False)[1])
        for old in evicted:
            self._drop(old)

    def clear(self) -> None:
        """Release every held conversation."""
        with self._lock:
            entries, self._entries = list(self._entries.values()), OrderedDict()
        for entry in entries:
            self._drop(entry)

    def get_handles(self) -> list[str]:
        """The held KV handles the cache owns, oldest first (no side effects)."""
        with self._lock:
            return [e.handle for e in self._entries.values() if e.handle is not None]

    def check_integrity(self) -> None:
        with self._lock:
            assert len(self._entries) <= self.capacity
            handles = [e.handle for e in self._entries.values() if e.handle is not None]
            assert len(handles) == len(set(handles)), "a held KV handle is owned twice"
            for entry in self._entries.values():
                entry.context.check_integrity()

    def _drop(self, entry: HeldConversation) -> None:
        if entry.handle is not None:
            self._release(entry.handle)
