"""Budget-aware grammars: a constrained output always ends complete and valid within max_tokens.

A grammar mask keeps every token valid, but nothing in it makes the output *finish*: sampled
freely, a string or a list may run until ``max_tokens`` cuts it. A budgeted request therefore
keeps a **plan**, a token sequence that takes its grammar from where it is to an accepting
state, and the invariant ``len(plan) <= tokens left``::

    tokens left  R = 7      output so far: {"path": "src/a.py", "hunks": [{"lines": ["abc
    plan         P = "]  }]  }}  ]  </  tool_call>        (len 6 <= 7: the model stays free)

- slack (``R > len(P)``): the grammar's own mask; after the model samples ``t``, a plan from the
  new state must fit ``R - 1``. The old plan usually still does (``t`` went on with a string);
  else one is looked up or searched for. When none fits, ``t`` is replaced by ``P[0]``, the
  first token of the way out (and the output is marked closed by the budget).
- no slack (``R == len(P)``): the mask is ``P[0]`` alone; the rest of the output is the plan.

The output thus always ends in an accepting state of the grammar, on the last token at the
latest. Plans come from :class:`CompletionSearch`: a best-first search over real matcher copies
(so every plan it returns is a token sequence the grammar accepts, whatever its heuristics
miss), trying closing punctuation first, then short values, then the shortest and longest
tokens the mask allows; states are told apart by their token mask, which also keys a memo of
plans shared by every request on the grammar (a plan taken from it is checked before use).

This file knows llguidance matchers only through the methods it calls on them and knows nothing
about requests or scheduling; ``structured.py`` wires it into :class:`GrammarMatcher`.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

__all__ = ["CompletionSearch", "CompletionVocab", "GrammarBudget"]

Matcher = Any  # llguidance.LLMatcher (not imported: this file only calls its methods)
Plan = tuple[int, ...]

# Bytes that end what is open (a string, a list, an object, a group, a tag), in the order tried.
_CLOSERS = b"\"]})>'"
# Bytes of the shortest values (empty string, list, object, the number 0) and separators.
_VALUES = set(_CLOSERS) | set(b"[{0, :")
_WORD_VALUES = (b"true", b"false", b"null")
_NUM_FALLBACK = 2  # the shortest and the longest allowed tokens tried when nothing ranked is
_MAX_TRIES = 12  # candidate tokens tried per state (most of them continue the same state)
_MAX_CHILDREN = 3  # new states kept per state
_MAX_VISITS = 3  # states with one mask the search follows
_REPAIR_NODES = 48  # states a search may expand while a request waits (one step's tokens)
_START_NODES = 1024  # states the search for a grammar's shortest output may expand
_MEMO_SIZE = 1 << 14
_DIVE_TRIES = 1024  # tokens the last-resort dive tries per state
_DIVE_STEPS = 512  # tokens the last-resort dive may take


class CompletionVocab:
    """Which tokens the completion search tries first, built once from a tokenizer's bytes."""

    def __init__(self, token_bytes: Sequence[bytes], special: set[int], eos_token_id: int) -> None:
        self.eos_token_id = eos_token_id
        ranked = []
        for token_id, data in enumerate(token_bytes):
            if not data or token_id in special:
                continue
            if set(data) <= set(_CLOSERS):
                ranked.append((0, _CLOSERS.index(data[0]), -len(data), token_id))
            elif set(data) <= _VALUES or data in _WORD_VALUES:
                ranked.append((1, 0, -len(data), token_id))
        self._ranked = np.array([r[-1] for r in sorted(ranked)], dtype=np.int64)
        lengths = np.array([len(b) for b in token_bytes], dtype=np.int64)
        usable = np.array(
            [bool(b) and i not in special for i, b in enumerate(token_bytes)], dtype=bool
        )
        self._by_length = np.nonzero(usable)[0][np.argsort(lengths[usable], kind="stable")]

    def candidates(self, mask: bytes) -> Iterator[int]:
        """Allowed tokens in the order the search tries them; ``mask`` is a packed bitmask."""
        words = np.frombuffer(mask, dtype=np.uint32)
        ranked = _allowed(words, self._ranked)
        yield from ranked.tolist()
        allowed = _allowed(words, self._by_length)
        if len(allowed) <= 2 * _NUM_FALLBACK:
            ends = allowed[::-1].tolist()
        else:
            ends = allowed[-_NUM_FALLBACK:][::-1].tolist() + allowed[:_NUM_FALLBACK].tolist()
        done = set(ranked.tolist())
        yield from (t for t in ends if t not in done and t != self.eos_token_id)

    def all_candidates(self, mask: bytes) -> Iterator[int]:
        """Every allowed token but EOS: the ranked ones first, then the rest shortest first."""
        words = np.frombuffer(mask, dtype=np.uint32)
        ranked = _allowed(words, self._ranked).tolist()
        yield from ranked
        done = set(ranked)
        yield from (
            t
            for t in _allowed(words, self._by_length).tolist()
            if t not in done and t != self.eos_token_id
        )


def _allowed(words: np.ndarray, token_ids: np.ndarray) -> np.ndarray:
    """The ``token_ids`` (kept in order) whose bit is set in the packed mask ``words``."""
    bits = (words[token_ids >> 5] >> (token_ids & 31).astype(np.uint32)) & 1
    return token_ids[bits.astype(bool)]


class CompletionSearch:
    """Short ways to finish one grammar from any state; one per compiled grammar, shared by its
    requests (its memo is a dict: reads and writes are atomic under the GIL)."""

    def __init__(self, vocab: CompletionVocab) -> None:
        self.vocab = vocab
        self._memo: dict[int, Plan] = {}  # mask hash -> a plan found from a state with it
        self._shortest: dict[int, Plan] = {}  # the same for thorough searches (start states)
        # the first error a matcher copy hit on a token its mask allowed (llguidance's own
        # limits: too many parser items, a row over its cap): the grammar fails when run
        self.failure: str | None = None

    @property
    def eos_token_id(self) -> int:
        return self.vocab.eos_token_id

    def shortest(self, matcher: Matcher) -> Plan | None:
        """The shortest plan the search finds from ``matcher``'s state (None: none found)."""
        if matcher.is_accepting():
            return ()
        mask = matcher.compute_bitmask()
        plan = self._shortest.get(hash(mask))
        if plan is not None and self.completes(matcher, plan):
            return plan
        plan = self._search(matcher, mask, 1 << 30, _START_NODES, greedy=False)
        if plan is None and self.failure is None:
            plan = self._dive(matcher, mask)
        if plan is not None:
            self._remember(mask, plan)
            self._shortest[hash(mask)] = plan
        return plan

    def find(self, matcher: Matcher, max_len: int) -> Plan | None:
        """A plan of at most ``max_len`` tokens from ``matcher``'s state, or None."""
        if matcher.is_accepting():
            return ()
        mask = matcher.compute_bitmask()
        plan = self._memo.get(hash(mask))
        if plan is not None and len(plan) <= max_len and self.completes(matcher, plan):
            return plan
        for greedy in (True, False):
            plan = self._search(matcher, mask, max_len, _REPAIR_NODES, greedy)
            if plan is not None:
                self._remember(mask, plan)
                return plan
        return None

    def completes(self, matcher: Matcher, plan: Plan) -> bool:
        """``plan`` is accepted from ``matcher``'s state and ends where the grammar may stop."""
        if not plan:
            return matcher.is_accepting()
        return matcher.validate_tokens([*plan, self.eos_token_id]) == len(plan) + 1

    def _remember(self, mask: bytes, plan: Plan) -> None:
        if len(self._memo) >= _MEMO_SIZE:
            self._memo.clear()
        self._memo[hash(mask)] = plan

    def _search(
        self, matcher: Matcher, mask: bytes, max_len: int, max_nodes: int, greedy: bool
    ) -> Plan | None:
        """Best-first by token count over states reached on matcher copies; ``greedy`` follows
        only the first new state of each (a quick dive that may miss the shortest plan)."""
        tie = itertools.count()
        seen = {hash(mask): 1}
        heap = [(0, next(tie), (), matcher, mask)]
        for _ in range(max_nodes):
            if not heap:
                return None
            cost, _, plan, state, state_mask = heapq.heappop(heap)
            if state_mask is None:  # an accepting state: pushed without a mask
                return plan
            for steps, child, child_mask in self._children(state, state_mask, seen):
                if cost + len(steps) <= max_len:
                    heapq.heappush(
                        heap, (cost + len(steps), next(tie), plan + steps, child, child_mask)
                    )
                    if greedy:
                        break
        return None

    def _dive(self, matcher: Matcher, mask: bytes) -> Plan | None:
        """The last resort for a start state: one greedy walk taking, at each state, the first
        allowed token (closers, short values, then every token shortest first) that ends the
        grammar or changes its mask. It gets through what the mask cannot count (30 required
        items look alike) and past the one letter among thousands (``[^x]*xyz``); a plan it
        finds is a real one, not always the shortest."""
        plan: Plan = ()
        state = matcher
        while len(plan) < _DIVE_STEPS:
            for token_id in itertools.islice(self.vocab.all_candidates(mask), _DIVE_TRIES):
                child, steps = self._step(state, token_id)
                if child is None:
                    continue
                if child.is_accepting():
                    return plan + steps
                child_mask = child.compute_bitmask()
                if child_mask != mask:
                    break
            else:
                return None
            plan, state, mask = plan + steps, child, child_mask
        return None

    def _step(self, state: Matcher, token_id: int) -> tuple[Matcher | None, Plan]:
        """A copy of ``state`` past ``token_id`` and the tokens it forces; None if it fails
        (an llguidance error is kept in ``failure``)."""
        child = state.deep_copy()
        steps: Plan = (token_id,)
        if child.consume_token(token_id):
            forced = child.compute_ff_tokens()
            if forced and child.consume_tokens(forced):
                steps += tuple(forced)
        if child.is_error():
            self.failure = self.failure or child.get_error() or "the grammar stopped"
            return None, steps
        return child, steps

    def _children(
        self, state: Matcher, mask: bytes, seen: dict[int, int]
    ) -> Iterator[tuple[Plan, Matcher, bytes | None]]:
        """States one token (and the tokens it forces) away: ``(steps, matcher, mask)``, mask
        None for an accepting state.

        A mask stands for a state, loosely: a token that keeps the mask as it was most likely
        went on with the same thing (text in a string) and is followed only when nothing else
        is; a mask met ``_MAX_VISITS`` times already is not followed again (two states may
        share a mask: ``[a-z]+@[a-z]+`` allows letters alone before and after the ``@``)."""
        kept, same = 0, None
        for token_id in itertools.islice(self.vocab.candidates(mask), _MAX_TRIES):
            child, steps = self._step(state, token_id)
            if child is None:
                continue
            child_mask = None if child.is_accepting() else child.compute_bitmask()
            if child_mask is not None:
                if child_mask == mask:
                    same = same or (steps, child, child_mask)
                    continue
                key = hash(child_mask)
                if seen.get(key, 0) >= _MAX_VISITS:
                    continue
                seen[key] = seen.get(key, 0) + 1
            yield steps, child, child_mask
            kept += 1
            if kept == _MAX_CHILDREN:
                return
        if kept == 0 and same is not None:  # a run of a letter in a{50}: go on with it
            yield same


class GrammarBudget:
    """One request's budget over its grammar: the plan, the tokens left, whether the budget
    decided a token (``closed``). Called by one thread at a time: the mask worker before a
    step's sample, the engine loop after it."""

    __slots__ = ("closed", "num_left", "plan", "search")

    def __init__(self, search: CompletionSearch, plan: Plan, num_left: int) -> None:
        if len(plan) > num_left:
            raise ValueError(f"a plan of {len(plan)} tokens does not fit {num_left}")
        self.search = search
        self.plan = plan
        self.num_left = num_left
        self.closed = False

    @property
    def forced_token(self) -> int | None:
        """The only token the budget allows next (no slack left), or None."""
        return self.plan[0] if self.plan and len(self.plan) >= self.num_left else None

    def commit(self, matcher: Matcher, token_id: int) -> int:
        """Consume the sampled ``token_id`` or, when no plan from the state it leads to fits
        the budget, the plan's next token instead; returns the token consumed."""
        self.num_left -= 1
        plan = self.plan
        if plan and token_id == plan[0]:
            matcher.consume_token(token_id)
            self.plan = plan[1:]
            return token_id
        if not matcher.consume_token(token_id):
            return token_id  # not a token the mask allowed: the matcher reports the error
        new_plan = self._replan(matcher, plan)
        if new_plan is not None:
            self.plan = new_plan
            return token_id
        matcher.rollback(1)
        instead = plan[0] if plan else self.search.eos_token_id  # no plan: it may stop now
        matcher.consume_token(instead)
        self.plan = plan[1:]
        self.closed = True
        return instead

    def _replan(self, matcher: Matcher, old: Plan) -> Plan | None:
        if len(old) <= self.num_left and self.search.completes(matcher, old):
            return old  # the token went on with what the plan closes (text in a string)
        return self.search.find(matcher, self.num_left)
