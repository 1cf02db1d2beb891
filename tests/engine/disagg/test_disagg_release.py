"""A P/D session's held KV released while its request still runs (a caller that aborted the
turn, or broke out of its stream, releases the request's id at once): the request, finishing
first, must not leave its KV held on D with nobody to release it (found by the P/D soak)."""

from dataclasses import replace

import pytest

from agentx import CacheConfig, EngineConfig, SamplingParams
from agentx.config import DisaggConfig, OffloadConfig, SpeculativeConfig
from agentx.engine.disagg import DisaggCoordinator
from agentx.engine.request import RequestOptions

pytestmark = pytest.mark.slow

BASE = EngineConfig(
    cache=CacheConfig(num_blocks=64), speculative=SpeculativeConfig(enabled=False), num_threads=1
)


def test_held_kv_released_in_flight_is_released_when_the_request_ends(tmp_path):
    config = replace(BASE, offload=OffloadConfig(disk_path=tmp_path))
    with DisaggCoordinator(config, DisaggConfig()) as pd:
        ids = pd.tokenizer.encode("The history of the Roman Empire " * 8)[:40]
        sampling = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        stream = pd.add_request(ids, sampling, options=RequestOptions(hold_kv=True))
        pd.release_held_soon(stream.request_id)  # before it finished: it was in flight
        out = stream.result(timeout=300)
        assert len(out.token_ids) == 12  # the release does not cut the request short
        pd.check_integrity()
        stats = pd.instance_stats()
        assert stats["decode-0"].kv_num_held == 0  # was 1: held for a session nobody ends
        assert stats["prefill-0"].kv_num_held == 0
        # a turn released after it ended is released at once, as before
        again = pd.add_request(ids, sampling, options=RequestOptions(hold_kv=True))
        again.result(timeout=300)
        assert pd.instance_stats()["decode-0"].kv_num_held == 1
        pd.release_held_soon(again.request_id)
        assert pd.instance_stats()["decode-0"].kv_num_held == 0
        pd.check_integrity()
