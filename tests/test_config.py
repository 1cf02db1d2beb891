"""Config values are refused when the config is built: NaN, fractions, bools and wrong types
raise ConfigError naming the field, never a TypeError or an AttributeError later."""

import math

import pytest

from agentx import ConfigError
from agentx.config import (
    CacheConfig,
    EngineConfig,
    OffloadConfig,
    SchedulerConfig,
    SpeculativeConfig,
)

NAN = math.nan


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: CacheConfig(num_blocks=2.5), "num_blocks"),
        (lambda: CacheConfig(num_blocks=True), "num_blocks"),
        (lambda: CacheConfig(kv_cache_bytes=NAN), "kv_cache_bytes"),
        (lambda: CacheConfig(kv_cache_bytes=1.5e9), "kv_cache_bytes"),
        (lambda: SchedulerConfig(max_num_batched_tokens=NAN), "max_num_batched_tokens"),
        (lambda: SchedulerConfig(max_num_seqs=4.0), "max_num_seqs"),
        (lambda: SchedulerConfig(long_prefill_token_threshold=NAN), "long_prefill_token_threshold"),
        (lambda: SchedulerConfig(decode_step_target_ms=NAN), "decode_step_target_ms"),
        (lambda: SchedulerConfig(step_cost_token_ms="1"), "step_cost_token_ms"),
        (lambda: SchedulerConfig(step_cost_token_ms=0), "step_cost_token_ms must be positive"),
        (lambda: SchedulerConfig(short_turn_tokens=True), "short_turn_tokens"),
        (lambda: SchedulerConfig(cold_prefill_tokens=-1), "cold_prefill_tokens"),
        (lambda: SchedulerConfig(decode_step_min_prefill_tokens=0), "decode_step_min_prefill"),
        (lambda: SchedulerConfig(prefill_drafts_min_kept=-0.1), "prefill_drafts_min_kept"),
        (lambda: OffloadConfig(host_bytes=NAN), "host_bytes"),
        (lambda: OffloadConfig(disk_bytes=2.5), "disk_bytes"),
        (lambda: OffloadConfig(prefetch_margin_s=NAN), "prefetch_margin_s"),
        (lambda: OffloadConfig(disk_path=3), "disk_path"),
        (lambda: SpeculativeConfig(num_speculative_tokens=2.5), "num_speculative_tokens"),
        (lambda: SpeculativeConfig(num_first_draft_tokens=0), "num_first_draft_tokens"),
        (lambda: EngineConfig(max_model_len=2.5), "max_model_len"),
        (lambda: EngineConfig(max_model_len=NAN), "max_model_len"),
        (lambda: EngineConfig(num_threads=1.5), "num_threads"),
        (lambda: EngineConfig(device=0), "device"),
        (lambda: EngineConfig(seed=1.5), "seed"),
    ],
)
def test_bad_values_are_config_errors(make, field):
    with pytest.raises(ConfigError, match=field):
        make()


def test_good_values_still_build():
    config = EngineConfig(
        cache=CacheConfig(num_blocks=2, kv_cache_bytes=1),
        scheduler=SchedulerConfig(decode_step_target_ms=0, step_cost_base_ms=0.5),
        offload=OffloadConfig(host_bytes=0, prefetch_margin_s=0),
        max_model_len=2,
        device="cuda:1",
    )
    assert config.cache.num_blocks == 2 and config.max_model_len == 2
