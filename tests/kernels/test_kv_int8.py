"""The int8 KV cache (``CacheConfig(kv_cache_dtype="int8")``, ``kernels/ref/kv_int8.py``).

Kernels: exact codes and scales for known rows; the compiled writer stores the reference's
bytes; the compiled paged attention over an int8 cache (integer dot products over int16 codes
of the query and of each chunk's probabilities: paged_attention.cpp, "int8 caches") is close
to the reference (which reads the cache dequantized, in float32) on partial blocks, GQA ratios,
windows (freed blocks poisoned), shuffled small and large blocks; where the codes are exact, it
gives the predicted bits (a dominant key returns its value row; the largest sums do not
overflow); a prefill chunk's rows equal the same rows alone, and AVX-512 equals AVX2, bit for
bit. Config: int8 on CUDA is refused. Engine tests (the same arithmetic, exact; and int8
against bf16 by the parity rule) are in ``test_kv_int8_engine.py``.
"""

import pytest
import torch

from agentx import CacheConfig, EngineConfig, kernels
from agentx.errors import ConfigError
from agentx.kernels import cpu, cpu_attention_fits
from agentx.kernels.ref import attention as ref_attention
from agentx.kernels.ref.kv_int8 import SCALE_BYTES, dequantize_rows, head_dim_of, quantize_rows

needs_kernels = pytest.mark.skipif(
    not cpu.available(), reason="the compiled CPU kernels need an AVX2 CPU and a C++ compiler"
)
NAN_BYTES = torch.tensor([float("nan")]).view(torch.int8)  # a poisoned scale


def assert_close_to_reference(got, want, cache):
    """The compiled int8 attention against the float reference. Its 15-bit codes (the query's
    and each chunk's weights': a code's rounding is at most 2^-16 of the largest) move a value
    sum by a few such steps of the largest value, so the bound is 2^-13 of the cache's largest
    dequantized value (these cases move by at most 0.9e-3 against values up to ~18: 2^-14.1;
    integer sums and ordered float steps, so the same on every CPU)."""
    largest = dequantize_rows(cache).nan_to_num(0.0).abs().max().item()  # poisoned rows: unread
    torch.testing.assert_close(got, want, rtol=0, atol=largest * 2.0**-13)


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
    # the dispatch sends the cache to the compiled kernel wherever those serve (not under ref)
    assert head_dim_of(cache) == head_dim
    assert cpu_attention_fits(cache) == kernels.cpu_kernels_enabled()
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
    assert_close_to_reference(got, want, cache)


@needs_kernels
def test_int8_mixed_prefill_and_decode_rows():
    gen = torch.Generator().manual_seed(11)
    cache = _int8_cache(40, 16, 3, 64, gen)
    tables = torch.arange(1, 37).reshape(3, 12)
    seq_lens, loc = [40, 150, 7], [0, 1, 6, 7]  # decode, a 5-token chunk, decode
    q = torch.randn(7, 9, 64, generator=gen)
    args = (q, cache, loc, seq_lens, tables, torch.tensor([0, 2]), [1], 0.125, None)
    assert_close_to_reference(
        cpu.paged_attention(*args), ref_attention.paged_attention(*args), cache
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
    assert_close_to_reference(got, ref_attention.paged_attention(*chunk), cache)
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
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size",
    [
        (9, 3, 64, 16),  # groups of 3: SmolLM2's shape
        (12, 2, 128, 8),  # groups of 6 (AVX-512: one pass of 6 heads, 32 dims a value pass)
        (8, 2, 256, 64),  # a group of 4 (a pass of 3, then 1), the widest heads, 64-key blocks
        (2, 2, 64, 32),  # one head a group
    ],
)
def test_int8_tile_rows_equal_rows_alone_every_shape(heads, kv_heads, head_dim, block_size):
    # A 37-row chunk at context 300 (tiles of 16, 16 and 5 rows; each tile's 64-key chunks
    # unpacked once for its rows on AVX-512: paged_attention.cpp, "int8 tiles"; partial
    # 16-key groups and odd counts at every row's last chunk): each row equals the same row
    # decoded alone and the AVX2 loops' row, bit for bit, on every ISA the CPU has.
    gen = torch.Generator().manual_seed(heads * head_dim)
    num_blocks = 2 + -(-300 // block_size)
    cache = _int8_cache(num_blocks, block_size, kv_heads, head_dim, gen)
    table = (torch.randperm(num_blocks - 1, generator=gen)[: num_blocks - 2] + 1).view(1, -1)
    q = torch.randn(37, heads, head_dim, generator=gen)
    no_decodes = torch.tensor([], dtype=torch.long)
    chunk = (q, cache, [0, 37], [300], table, no_decodes, [0], head_dim**-0.5, None)
    outs = {}
    for isa in cpu.isas():
        with cpu.use_isa(isa):
            outs[isa] = cpu.paged_attention(*chunk)
            for r in (0, 15, 16, 17, 31, 32, 36):
                decode = ([0, 1], [264 + r], table, torch.tensor([0]), [], head_dim**-0.5)
                alone = cpu.paged_attention(q[r : r + 1], cache, *decode)
                assert torch.equal(alone[0], outs[isa][r]), (isa, r)
    first = next(iter(outs.values()))
    assert all(torch.equal(out, first) for out in outs.values())
    assert_close_to_reference(first, ref_attention.paged_attention(*chunk), cache)


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
    assert_close_to_reference(outs[1], ref_attention.paged_attention(qs, cache, *rest), cache)


def _rows(codes: torch.Tensor, scale: float) -> torch.Tensor:
    """int8 cache rows (..., D + 4) of the given codes and one scale"""
    scales = torch.full((*codes.shape[:-1], 1), scale, dtype=torch.float32)
    return torch.cat([codes.to(torch.int8), scales.view(torch.int8)], dim=-1)


@needs_kernels
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size,n,winners",
    [
        (9, 3, 64, 8, 37, (0, 5, 17, 36)),  # an odd count: a key pair with the zero row
        (
            12,
            2,
            128,
            16,
            700,
            (3, 511, 512, 699),
        ),  # groups of 6 (AVX-512: 32 dims a pass), 2 splits
        (4, 4, 256, 256, 300, (0, 255, 256, 299)),  # one block a chunk: 256 keys
    ],
)
def test_int8_dominant_key_returns_its_value_row(heads, kv_heads, head_dim, block_size, n, winners):
    # Query heads [30, 0, ...] against keys [+-127, 0, ...] of scale 1: the winner scores
    # +476, every other key -476, whose exps vanish beside it (and whose value rows are zero),
    # so each head's output is the winner's value row through the weights' codes: weight
    # 2^-5 (p = 1 times the row's scale) codes to 32767 exactly, s_w = 2^-5 / 32767, and the
    # output is float(32767 code) * s_w over a denominator of 1. A score lane given to the wrong
    # key, or a value lane to the wrong dim, shows as another row.
    gen = torch.Generator().manual_seed(n)
    num_blocks = 1 + -(-n // block_size)
    table = (torch.randperm(num_blocks - 1, generator=gen) + 1).view(1, -1)  # shuffled
    q = torch.zeros(1, heads, head_dim)
    q[..., 0] = 30.0
    dims = torch.arange(head_dim)
    for winner in winners:
        key_codes = torch.zeros(num_blocks, block_size, kv_heads, head_dim)
        key_codes[..., 0] = -127
        value_codes = torch.zeros(num_blocks, block_size, kv_heads, head_dim)
        block, offset = table[0, winner // block_size], winner % block_size
        key_codes[block, offset, :, 0] = 127
        for h in range(kv_heads):
            value_codes[block, offset, h] = (dims * 37 + 11 * h + winner) % 255 - 127
        cache = torch.stack([_rows(key_codes, 1.0), _rows(value_codes, 2.0**-5)], dim=1)
        s_w = torch.tensor(2.0**-5, dtype=torch.float32) / 32767
        want = (32767 * value_codes[block, offset]).float() * s_w  # (kv_heads, head_dim)
        want = want.repeat_interleave(heads // kv_heads, dim=0).unsqueeze(0)
        for isa in cpu.isas():
            with cpu.use_isa(isa):
                got = cpu.paged_attention(
                    q, cache, [0, 1], [n], table, torch.tensor([0]), [], head_dim**-0.5
                )
            assert torch.equal(got, want), (isa, winner)


@needs_kernels
@pytest.mark.parametrize("sign", [1, -1])
def test_int8_largest_sums_do_not_overflow(sign):
    # Every code at its largest: the query's 256 dims at 32767 against keys' 127 (a score's
    # integer sum 256 x 32767 x 127 = 1,065,320,192, just under 2^31 / 2) and two chunks of one
    # 256-token block each whose 256 weights code to 32767 against values of 127 (the same
    # sum), all scores equal: each chunk adds float(1,065,320,192) * s_w, the output is their
    # sum over 512 exps of 1, exactly. Int32 overflow would turn the sign.
    head_dim, block_size, n = 256, 256, 512
    codes = torch.full((3, block_size, 1, head_dim), 127.0 * sign)
    cache = torch.stack([_rows(codes, 1.0), _rows(codes, 2.0**-5)], dim=1)
    q = torch.full((1, 1, head_dim), float(sign))
    table = torch.tensor([[1, 2]])
    s_w = torch.tensor(2.0**-5, dtype=torch.float32) / 32767
    chunk = torch.tensor(256 * 32767 * 127 * sign, dtype=torch.float32) * s_w
    want = torch.full((1, 1, head_dim), ((chunk + chunk) / 512).item())
    for isa in cpu.isas():
        with cpu.use_isa(isa):
            got = cpu.paged_attention(q, cache, [0, 1], [n], table, torch.tensor([0]), [], 1 / 16)
        assert torch.equal(got, want), isa


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
