"""The CUDA-only runner options, as far as a CPU can check them: the config's validation."""

import pytest

from agentx import EngineConfig
from agentx.errors import ConfigError


@pytest.mark.parametrize("sizes", [(0, 1), (4, 2), (1, 1), [1, 2], (1, 2.0), (True,)])
def test_cuda_graph_batch_sizes_must_be_increasing_positive_ints(sizes):
    with pytest.raises(ConfigError, match="cuda_graph_batch_sizes"):
        EngineConfig(cuda_graph_batch_sizes=sizes)


def test_cuda_graph_batch_sizes_default_and_off():
    assert EngineConfig().cuda_graph_batch_sizes[0] == 1
    assert EngineConfig(cuda_graph_batch_sizes=()).cuda_graph_batch_sizes == ()
