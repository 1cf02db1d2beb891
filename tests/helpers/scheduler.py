"""A scheduler over a small KV manager with a fixed step-cost model and a fake clock, and one
step with a fake runner: what the prefill-share and lane tests drive (no model involved)."""

from agentx.config import SchedulerConfig
from agentx.engine.outputs import ModelRunnerOutput
from agentx.engine.scheduler import FixedStepCost, Scheduler, StepCost
from tests.helpers.kv import make_manager

# 20 ms a step + 0.5 ms a token + 2 ms a request: 4 decodes and one chunk leave
# 100 - (20 + 4 * 0.5 + 5 * 2) = 68 ms for the chunk, 136 tokens
COST = StepCost(base_ms=20.0, token_ms=0.5, request_ms=2.0)


class FakeClock:
    """Seconds; a step advances it by what ``cost`` says the step takes."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_scheduler(cost_model=None, clock=None, num_blocks=700, **cfg):
    cfg.setdefault("decode_step_target_ms", 100.0)
    # one lane, every waiting turn clipped to the chunk share: what the share tests pin (the
    # lanes and short-turn tests turn them on)
    cfg.setdefault("short_turn_tokens", 0)
    cfg.setdefault("cold_prefill_tokens", 0)
    return Scheduler(
        SchedulerConfig(**cfg),
        make_manager(num_blocks),
        max_model_len=4096,
        cost_model=cost_model or FixedStepCost(COST),
        clock=clock or FakeClock(),
    )


def step(s, cost=COST):
    """One step with a fake runner; a fake clock runs for ``cost``'s time of the step."""
    out = s.schedule()
    if isinstance(s.clock, FakeClock):
        s.clock.now += cost.estimate_ms(out.num_scheduled_tokens, len(out.scheduled)) / 1e3
    sampled = {x.request_id: 1000 + x.num_output_tokens for x in out.scheduled if x.sample}
    s.update_from_output(out, ModelRunnerOutput(sampled))
    s.check_integrity()
    return {x.request_id: len(x.token_ids) for x in out.scheduled}
