"""A step's work and its floors (agentx/bench/step_bounds.py), exactly, on hand-built shapes
and on the default model."""

import pytest
import torch

from agentx import kernels
from agentx.bench.step_bounds import (
    Floors,
    ModelShape,
    Rates,
    RowSpan,
    StepWork,
    attention_products,
    floors,
    mean_work,
    measure_rates,
    model_shape,
    step_work,
)
from agentx.errors import ConfigError
from agentx.kernels import cpu

# two attention layers of 2 heads x head_dim 4, 16 bytes of K and V a token: one full, one
# with a sliding window of 3 keys
SHAPE = ModelShape(
    linear_macs_per_row=100,
    linear_bytes=1000,
    lm_head_macs_per_row=10,
    lm_head_bytes=50,
    attention=((2, 4, None, 16), (2, 4, 3, 16)),
)


def test_a_decode_row_and_a_first_chunk_count_every_key_once_a_request():
    decode = RowSpan(start=5, rows=1, logit_rows=1)  # position 5: keys 0..5
    chunk = RowSpan(start=0, rows=4, logit_rows=0)  # positions 0..3: 1 + 2 + 3 + 4 keys
    work = step_work(SHAPE, [decode, chunk])
    # full layer: 6 + 10 keys seen, 6 + 4 read; window 3: 3 + (1 + 2 + 3 + 3), 3 + 4
    assert work == StepWork(
        linear_macs=500,
        lm_head_macs=10,
        attention_macs=(16 + 12) * 2 * 4 * 2,
        linear_bytes=1000,
        lm_head_bytes=50,
        kv_bytes=(10 + 7) * 16,
    )
    assert work.bytes == 1000 + 50 + 272


def test_a_later_chunk_under_a_window_reads_its_window_and_its_rows():
    chunk = RowSpan(start=10, rows=2, logit_rows=2)  # positions 10, 11
    work = step_work(SHAPE, [chunk])
    # full: 11 + 12 keys seen, 12 read; window 3: keys 8..10 and 9..11, 4 read
    assert work.attention_macs == (23 + 6) * 16
    assert work.kv_bytes == (12 + 4) * 16
    assert (work.lm_head_macs, work.lm_head_bytes) == (20, 50)


def test_a_step_without_logits_reads_no_lm_head():
    work = step_work(SHAPE, [RowSpan(start=0, rows=1, logit_rows=0)])
    assert (work.lm_head_macs, work.lm_head_bytes) == (0, 0)
    assert step_work(SHAPE, []).bytes == 0


def test_floors_divide_each_component_by_its_rate():
    work = StepWork(
        linear_macs=2000,
        lm_head_macs=30,
        attention_macs=640,
        linear_bytes=400,
        lm_head_bytes=100,
        kv_bytes=500,
    )
    rates = Rates(read_bytes=100, linear_macs=1000, lm_head_macs=10, attention_macs=64)
    got = floors(work, rates)
    assert got == Floors(linear=(4.0, 2.0), lm_head=(1.0, 3.0), attention=(5.0, 10.0))
    assert (got.memory, got.compute) == (10.0, 15.0)


@pytest.mark.skipif(not cpu.available(), reason="the compiled CPU kernels do not build here")
def test_attention_products_follow_the_kernel_s_loops():
    # VDPBF16PS only for bf16 caches on the AVX-512 loops of a CPU with AVX512_BF16
    assert attention_products(torch.float32) == "fp32"
    assert attention_products(torch.int8) == "fp32"
    with cpu.use_isa("avx2"):
        assert attention_products(torch.bfloat16) == "fp32"
    with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
        flags = next(line.split() for line in f if line.startswith("flags"))
    # the ISA the kernels run at now (AGENTX_CPU_ISA may cap it below what the CPU has)
    wide = cpu.get_isa() != "avx2"
    bf16 = kernels.cpu_kernels_enabled() and wide and "avx512_bf16" in flags
    assert attention_products(torch.bfloat16) == ("bf16" if bf16 else "fp32")


def test_mean_work_is_field_wise_and_refuses_no_steps():
    a = step_work(SHAPE, [RowSpan(start=5, rows=1, logit_rows=1)])
    b = step_work(SHAPE, [RowSpan(start=0, rows=4, logit_rows=0)])
    mean = mean_work([a, b])
    assert mean.linear_macs == 250
    assert mean.attention_macs == (a.attention_macs + b.attention_macs) / 2
    with pytest.raises(ConfigError):
        mean_work([])


def test_the_default_model_s_shape(default_engine):
    runner = default_engine.core.runner
    shape = model_shape(runner.model, runner.kv_caches)
    # SmolLM2-135M: 30 layers of q|k|v 576 -> 960, o 576 -> 576, gate|up 576 -> 3072,
    # down 1536 -> 576; a tied LM head over 49,152 tokens; 9 heads of 64 over 3 KV heads
    assert shape.linear_macs_per_row == 30 * (576 * 960 + 576 * 576 + 576 * 3072 + 1536 * 576)
    assert shape.lm_head_macs_per_row == 49152 * 576
    token = 2 * 3 * 64 * runner.kv_caches[0].element_size()
    assert shape.attention == ((9, 64, None, token),) * 30
    if kernels.cpu_kernels_enabled():  # packed: under a byte a weight
        assert 0 < shape.linear_bytes < shape.linear_macs_per_row
    else:  # AGENTX_KERNELS=ref: quantization "auto" keeps float32 weights
        assert shape.linear_bytes == 4 * shape.linear_macs_per_row
    kv_dtype = runner.kv_caches[0].dtype
    rates = measure_rates(runner.model, threads=1, rows=8, kv_dtype=kv_dtype)
    assert min(rates.read_bytes, rates.linear_macs, rates.lm_head_macs, rates.attention_macs) > 0
    assert rates.attention_products == attention_products(kv_dtype)
    assert measure_rates(runner.model, threads=1, rows=8).attention_products == "fp32"


def test_a_model_without_attention_is_refused():
    with pytest.raises(ConfigError, match="no paged attention"):
        model_shape(torch.nn.Linear(2, 2), [])
