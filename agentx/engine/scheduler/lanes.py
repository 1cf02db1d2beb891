"""First-turn lanes: cold first turns and warm turns share each step by a fixed split.

Agent traffic mixes cold first turns (a long system + tool prompt, nothing cached) with warm
turns (a few hundred new tokens on a long cached context). Without lanes a running cold prefill
takes the step's chunk tokens first, in admission order, and a warm turn that arrives behind it
waits for every one of its chunks. With lanes:

    step's chunk tokens (what decodes leave for requests given more than one token)
    +---------------------------------------------+--------------------+
    | warm lane: running warm chunks, then warm   | cold lane: at most |
    | turns admitted (ahead of any cold waiting)  | ``share`` of them  |
    +---------------------------------------------+--------------------+

A request joins the cold lane when it is admitted with more than ``cold_tokens`` tokens left to
compute after its prefix hit, and leaves it when its prompt is computed (it then decodes like
any other). While a cold request runs, ``share`` of the chunk tokens is kept for it, so it is
never starved; while warm work is in the step or waiting, the cold lane gets no more than that.
With no warm work it takes everything left. Decodes are outside both lanes: they run first.

Knows nothing about blocks or the model: the scheduler asks it which lane a request is in and
how many tokens the cold lane may take.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from agentx.engine.request import Request

__all__ = ["FirstTurnLanes"]


@dataclass(frozen=True, slots=True)
class FirstTurnLanes:
    cold_tokens: int  # more uncached tokens than this at admission: a cold first turn
    share: float  # of a step's chunk tokens, the cold lane's while warm work is present

    def joins_cold_lane(self, num_tokens: int, num_hit: int) -> bool:
        """Whether a request admitted with ``num_hit`` of its ``num_tokens`` cached is cold."""
        return num_tokens - num_hit > self.cold_tokens

    @staticmethod
    def is_cold(request: Request) -> bool:
        """In the cold lane: admitted cold and its prompt not yet computed."""
        return request.in_cold_lane and request.num_computed_tokens < request.num_prompt_tokens

    def get_cold_share(self, num_chunk_tokens: int) -> int:
        """The cold lane's tokens out of a step's ``num_chunk_tokens`` (at least one)."""
        return max(1, math.floor(self.share * num_chunk_tokens))
