"""The int8 KV cache (``CacheConfig(kv_cache_dtype="int8")``, ``kernels/ref/kv_int8.py``).

Kernels: exact codes and scales for known rows; the compiled writer stores the reference's
bytes; the compiled paged attention over an int8 cache equals the reference (which reads it
dequantized) on partial blocks, GQA ratios, windows (freed blocks poisoned), shuffled small
and large blocks; a prefill chunk's rows equal the same rows alone, bit for bit. Config: int8
on CUDA is refused. Engine tests (the same arithmetic, exact; and int8 against bf16 by the
parity rule) are in ``test_kv_int8_engine.py``.
"""

import pytest
import torch

from agentx import CacheConfig, EngineConfig
from agentx.errors import ConfigError
from agentx.kernels import cpu, cpu_attention_fits
from agentx.kernels.ref import attention as ref_attention
from agentx.kernels.ref.kv_int8 import SCALE_BYTES, dequantize_rows, head_dim_of, quantize_rows

needs_kernels = pytest.mark.skipif(
    not cpu.available(), reason="the compiled CPU kernels need an AVX2 CPU and a C++ compiler"
)
NAN_BYTES = torch.tensor([float("nan")]).view(torch.int8)  # a poisoned scale


def test_quantize_exact_codes_and_scales():
    x = torch.zeros(2, 8)
    x[0, :5] = torch.tensor([1.0, -0.5, 0.25, -1 / 254, 3 / 254])  # x * 127: 127, -63.5, ...
    rows = quantize_rows(x)
    assert rows.shape == (2, 8 + SCALE_BYTES) and rows.dtype == torch.int8
    # half to even: -63.5 -> -64, 31.75 -> 32, -0.5 -> 0 (even), 1.5 -> 2
    assert rows[0, :8].tolist() == [127, -64, 32, 0, 2, 0, 0, 0]
    assert rows[0, 8:].view(torch.float32).item() == torch.tensor(1.0 / 127).item()
    assert rows[1].tolist() == [0] * 12  # an all-zero row: scale 0, codes 0
    back = dequantize_rows(rows)
    assert back[1].tolist() == [0.0] * 8 and back[0, 0].item() == 127 * (1 / 127)


def test_round_trip_error_is_half_a_step():
    x = torch.randn(64, 3, 128, generator=torch.Generator().manual_seed(0)) * 4
    back = dequantize_rows(quantize_rows(x))
    step = x.abs().amax(-1, keepdim=True) / 127
    assert ((back - x).abs() <= step / 2 * (1 + 1e-5)).all()


def _int8_cache(num_blocks, block_size, num_kv_heads, head_dim, gen):
    floats = torch.randn(num_blocks, 2, block_size, num_kv_heads, head_dim, generator=gen)
    floats *= torch.rand(num_blocks, 2, block_size, num_kv_heads, 1, generator=gen) * 4
    return quantize_rows(floats)  # (..., head_dim + 4) int8


def _decode_case(heads, kv_heads, head_dim, block_size, window):
    gen = torch.Generator().manual_seed(heads * head_dim + block_size)
    seq_lens = [1, 15, 1300, 33, 16]  # a partial block, one long context among short ones
    num_blocks = 2 + sum(-(-n // block_size) for n in seq_lens)
    cache = _int8_cache(num_blocks, block_size, kv_heads, head_dim, gen)
    max_blocks = max(-(-n // block_size) for n in seq_lens)
    ids = torch.randperm(num_blocks - 1, generator=gen) + 1  # shuffled, never block 0
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.long)
    used = 0
    for i, n in enumerate(seq_lens):
        nb = -(-n // block_size)
        tables[i, :nb] = ids[used : used + nb]
        used += nb
    q = torch.randn(len(seq_lens), heads, head_dim, generator=gen)
    loc = list(range(len(seq_lens) + 1))
    decode_ids = torch.arange(len(seq_lens))
    return q, cache, (loc, seq_lens, tables, decode_ids, [], head_dim**-0.5, window)


DECODE_CASES = [
    (9, 3, 64, 16, None),
    (4, 4, 128, 32, None),
    (8, 2, 256, 16, 100),
    (9, 3, 64, 16, 5),
    (6, 2, 64, 8, None),
]


@needs_kernels
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,window", DECODE_CASES)
def test_int8_decode_matches_reference(heads, kv_heads, head_dim, block_size, window):
    q, cache, args = _decode_case(heads, kv_heads, head_dim, block_size, window)
    seq_lens, tables = args[1], args[2]
    assert head_dim_of(cache) == head_dim and cpu_attention_fits(cache)
    want = ref_attention.paged_attention(q, cache, *args)
    # the reference reads an int8 cache as its dequantized floats, exactly
    floats = ref_attention.paged_attention(q, dequantize_rows(cache).contiguous(), *args)
    assert torch.equal(want, floats)
    if window is not None:  # blocks wholly out of the window may already be freed: poison them
        for i, n in enumerate(seq_lens):
            for b in range(max(0, n - window) // block_size):
                cache[tables[i, b], ..., head_dim:] = NAN_BYTES
    got = cpu.paged_attention(q, cache, *args)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=3e-5)


@needs_kernels
def test_int8_mixed_prefill_and_decode_rows():
    gen = torch.Generator().manual_seed(11)
    cache = _int8_cache(40, 16, 3, 64, gen)
    tables = torch.arange(1, 37).reshape(3, 12)
    seq_lens, loc = [40, 150, 7], [0, 1, 6, 7]  # decode, a 5-token chunk, decode
    q = torch.randn(7, 9, 64, generator=gen)
    args = (q, cache, loc, seq_lens, tables, torch.tensor([0, 2]), [1], 0.125, None)
    torch.testing.assert_close(
        cpu.paged_attention(*args), ref_attention.paged_attention(*args), rtol=1e-5, atol=3e-5
    )


@needs_kernels
@pytest.mark.parametrize("block_size,window", [(8, None), (16, None), (128, None), (8, 37)])
def test_int8_chunk_rows_equal_rows_alone(block_size, window):
    # A 70-row chunk at context 700 (two 512-key splits, tiles of 16 rows, 64-key chunks over
    # shuffled blocks) equals the reference, and each row equals the same row decoded alone,
    # bit for bit, whatever the thread count: what makes prefix hits and chunking exact.
    gen = torch.Generator().manual_seed(block_size)
    num_blocks = 2 + -(-700 // block_size)
    cache = _int8_cache(num_blocks, block_size, 3, 64, gen)
    table = (torch.randperm(num_blocks - 1, generator=gen)[: num_blocks - 2] + 1).view(1, -1)
    q = torch.randn(70, 9, 64, generator=gen)
    no_decodes = torch.tensor([], dtype=torch.long)
    chunk = (q, cache, [0, 70], [700], table, no_decodes, [0], 0.125, window)
    got = cpu.paged_attention(*chunk)
    torch.testing.assert_close(got, ref_attention.paged_attention(*chunk), rtol=1e-5, atol=3e-5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(cpu.paged_attention(*chunk), got)
    finally:
        torch.set_num_threads(threads)
    for r in (0, 5, 63, 64, 69):
        alone = cpu.paged_attention(
            q[r : r + 1], cache, [0, 1], [631 + r], table, torch.tensor([0]), [], 0.125, window
        )
        assert torch.equal(alone[0], got[r])


@needs_kernels
@pytest.mark.skipif(not cpu.available() or not cpu.has_avx512(), reason="needs AVX-512 VNNI")
@pytest.mark.parametrize("case", DECODE_CASES)
def test_int8_avx512_equals_avx2(case):
    # the case's decode rows, then a 3-row prefill chunk of one more request (a tile of rows):
    # the AVX-512 loops run every lane as the AVX2 code does, bit for bit
    q, cache, args = _decode_case(*case)
    qs = torch.cat([q, q[:3] * 0.5])
    loc = list(range(len(args[1]) + 1)) + [len(args[1]) + 3]
    seq_lens = [*args[1], 40]
    tables = torch.cat([args[2], args[2][2:3]])
    rest = (loc, seq_lens, tables, torch.arange(len(args[1])), [len(args[1])], *args[5:])
    outs = []
    for isa in ("avx2", "avx512"):
        with cpu.use_isa(isa):
            outs.append(cpu.paged_attention(qs, cache, *rest))
    assert torch.equal(outs[0], outs[1])
    torch.testing.assert_close(
        outs[1], ref_attention.paged_attention(qs, cache, *rest), rtol=1e-5, atol=3e-5
    )


@needs_kernels
@pytest.mark.parametrize("num_kv_heads,head_dim", [(3, 64), (2, 128), (1, 256)])
def test_compiled_writer_stores_the_reference_bytes(num_kv_heads, head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    k = torch.randn(21, num_kv_heads, head_dim, generator=gen) * 3
    v = torch.randn(21, num_kv_heads, head_dim, generator=gen) / 7
    k[3] = 0.0  # all-zero rows
    v[4, 0] = 0.0
    k[5, 0, 0] = 1e-30  # a scale that underflows to 0
    k[6] = k[6].round()  # ties at .5 after scaling are likely: integer rows
    slots = torch.randperm(6 * 8, generator=gen)[:21]
    caches = [torch.zeros(6, 2, 8, num_kv_heads, head_dim + 4, dtype=torch.int8) for _ in "ab"]
    ref_attention.write_kv(k, v, caches[0], slots)
    torch.ops.agentx.write_kv_int8(k, v, caches[1], slots)
    assert torch.equal(caches[0], caches[1])
    assert caches[0].any()


def test_int8_on_cuda_is_refused():
    with pytest.raises(ConfigError, match="CPU only"):
        EngineConfig(device="cuda", cache=CacheConfig(kv_cache_dtype="int8"))
    with pytest.raises(ConfigError, match="kv_cache_dtype must be"):
        CacheConfig(kv_cache_dtype="int4")
    assert CacheConfig(kv_cache_dtype="int8").kv_cache_dtype == "int8"


def test_int8_page_holds_codes_and_scales():
    from agentx.engine.kv_cache.specs import FullAttentionSpec

    bf16 = FullAttentionSpec(16, torch.bfloat16, 3, 64)
    int8 = FullAttentionSpec(16, torch.int8, 3, 64)
    assert int8.row_size == 68 and bf16.row_size == 64
    assert (int8.page_size_bytes, bf16.page_size_bytes) == (2 * 16 * 3 * 68, 2 * 16 * 3 * 64 * 2)
