"""The compiled CPU kernels against the reference backend, on awkward shapes.

Quantized linear: the packed layout round-trips, the kernel equals ``ref/quant.py`` up to float
summation order, every row's result is independent of the other rows (bit for bit), and the
int8-activation math stays close to the dequantized float matmul. Paged decode attention: the
kernel equals the reference on partial blocks, one long context among short ones, GQA ratios,
sliding windows, fp32 and bf16 caches and padded pages. GGUF Q4_1 / Q8_0 tensors are read
exactly (their dequantization equals the gguf package's, bit for bit).
"""

import pytest
import torch

from agentx.kernels import cpu
from agentx.kernels.ref import attention as ref_attention
from agentx.kernels.ref import quant

needs_kernels = pytest.mark.skipif(
    not cpu.available(), reason="the compiled CPU kernels need an AVX2 CPU and a C++ compiler"
)


def _packed(n, k, bits, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen)
    q, scale, mins = quant.quantize_weight(w, bits)
    return (q, scale, mins), quant.pack_weight(q, scale, mins, bits)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n,k", [(8, 32), (40, 96), (192, 576)])
def test_pack_round_trips(bits, n, k):
    plain, packed = _packed(n, k, bits)
    for got, want in zip(quant.unpack_weight(*packed, bits), plain, strict=True):
        assert torch.equal(got, want)


@needs_kernels
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m", [1, 3, 4, 5, 15, 63, 300])
@pytest.mark.parametrize("n,k", [(8, 32), (40, 96), (576, 576)])
def test_quantized_linear_matches_reference(bits, m, n, k):
    _, packed = _packed(n, k, bits, seed=m)
    gen = torch.Generator().manual_seed(100 + m)
    x = torch.randn(m, k, generator=gen) * 3
    bias = torch.randn(n, generator=gen)
    want = quant.quantized_linear(x, *packed, bias, bits)
    got = cpu.quantized_linear(x, *packed, bias, bits)
    # the same products in another float order: error relative to the outputs' scale
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@needs_kernels
@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_linear_rows_are_independent(bits):
    _, packed = _packed(96, 160, bits)
    x = torch.randn(37, 160, generator=torch.Generator().manual_seed(7))
    batch = cpu.quantized_linear(x, *packed, None, bits)
    for r in (0, 3, 4, 36):
        alone = cpu.quantized_linear(x[r : r + 1], *packed, None, bits)
        assert torch.equal(alone[0], batch[r])  # bit for bit, whatever the batch
    assert torch.equal(cpu.quantized_linear(x[5:9], *packed, None, bits), batch[5:9])
    # AVX2's int4 tiles take rows six at a time (11 rows: a pass of 6 and one of 5); AVX-512's
    # tile pairs up to six, split evenly (37 rows: 6, 6, 5, 5, 5, 5, 5; 8 rows: 4 and 4)
    assert torch.equal(cpu.quantized_linear(x[:11], *packed, None, bits), batch[:11])
    assert torch.equal(cpu.quantized_linear(x[3:11], *packed, None, bits), batch[3:11])


@needs_kernels
@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_linear_blocks_of_tiles_keep_every_row_alone(bits):
    # 8,200 columns over K = 576: a thread's share (1.8-5.3 MB on 1 or 2 threads) is more than
    # AVX-512 keeps as one block (3/4 of a core's L2: 1.5 MB at most on these machines' 2 MB),
    # so its row passes run over 128 KB blocks of tile pairs (36 int4 or 24 int8 tiles a block,
    # ending partway through the share, the 1,025th tile alone; AVX2's over the whole share):
    # 13 rows take every pass over every block, and each row equals itself computed alone
    _, packed = _packed(8200, 576, bits, seed=11)
    x = torch.randn(13, 576, generator=torch.Generator().manual_seed(12)) * 2
    isas = ("avx2", "avx512") if cpu.has_avx512() else ("avx2",)
    outs = []
    for isa in isas:
        with cpu.use_isa(isa):
            batch = cpu.quantized_linear(x, *packed, None, bits)
            for r in (0, 5, 12):
                assert torch.equal(
                    cpu.quantized_linear(x[r : r + 1], *packed, None, bits)[0], batch[r]
                )
            assert torch.equal(cpu.quantized_linear(x[6:13], *packed, None, bits), batch[6:13])
            outs.append(batch)
    assert all(torch.equal(out, outs[0]) for out in outs)
    want = quant.quantized_linear(x, *packed, None, bits)
    torch.testing.assert_close(outs[0], want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


needs_avx512 = pytest.mark.skipif(
    not (cpu.available() and cpu.has_avx512()), reason="this CPU has no AVX-512 VNNI"
)


@needs_avx512
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m", [1, 2, 5, 8, 33])  # 8, 33: sub-blocks of two and six passes
@pytest.mark.parametrize("n", [8, 24, 40, 64, 112, 968])  # odd tile counts take the AVX2 tile
def test_quantized_linear_avx512_equals_avx2(bits, m, n):
    _, packed = _packed(n, 96, bits, seed=n)
    x = torch.randn(m, 96, generator=torch.Generator().manual_seed(m)) * 2
    outs, before = [], cpu.get_isa()
    for isa in ("avx2", "avx512"):
        with cpu.use_isa(isa):
            outs.append(cpu.quantized_linear(x, *packed, None, bits))
    assert cpu.get_isa() == before  # restored
    assert torch.equal(outs[0], outs[1])  # exact integer dots, the same float steps


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_math_close_to_dequantized_matmul(bits):
    plain, packed = _packed(64, 256, bits)
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(3))
    exact = x @ quant.dequantize_weight(*plain).t()
    got = quant.quantized_linear(x, *packed, None, bits)
    # int8 activations: each group's rounding error is at most half a step of amax / 127
    assert (got - exact).abs().max() <= 0.02 * exact.abs().max()


def test_activation_quantization_exact_values():
    x = torch.tensor([[0.0] * 31 + [2.54], [-1.27] + [0.005] * 31])
    xq, dx, sx = quant.quantize_activations(x)
    assert xq[0].tolist() == [0] * 31 + [127]
    assert xq[1, 0].item() == -127 and xq[1, 1:].tolist() == [0] * 31  # 0.5 rounds to even
    assert dx[0, 0].item() == pytest.approx(0.02) and sx[0, 0].item() == pytest.approx(2.54)


@needs_kernels
@pytest.mark.parametrize("m", [1, 7, 8, 9, 17, 40])
def test_kernel_quantizes_activations_exactly(m):
    # int8 weights of 127 times the identity: y[r, c] = (127 xq[r, c]) * dx[r, c / 32], one
    # rounding in the kernel and in the reference, so the kernel's xq and dx show bit for bit
    k = 96
    eye = torch.eye(k) * 127
    packed = quant.pack_weight(*quant.quantize_weight(eye, 8), 8)
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen) * 3
    x[0, 32:64] = 0.0  # an all-zero group: dx 0, xq 0
    x[-1, :32] = torch.arange(32) - 16.5  # ties: amax 127 (x * 127 / amax = x), halves to even
    x[-1, 0] = 127.0
    x[-1, 64:] = torch.randn(32, generator=gen) * 1e-30  # tiny scales
    xq, dx, _ = quant.quantize_activations(x)
    want = 127.0 * xq.float() * dx.repeat_interleave(32, dim=1)
    for isa in ("avx2", "avx512") if cpu.get_isa() != "avx2" else ("avx2",):
        with cpu.use_isa(isa):
            assert torch.equal(cpu.quantized_linear(x, *packed, None, 8), want)


def _random_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, pad, gen):
    page = 2 * block_size * num_kv_heads * head_dim
    pages = torch.randn(num_blocks, page + pad, generator=gen).to(dtype)
    return pages[:, :page].view(num_blocks, 2, block_size, num_kv_heads, head_dim)


def _decode_case(dtype, heads, kv_heads, head_dim, block_size, window):
    gen = torch.Generator().manual_seed(heads * head_dim)
    seq_lens = [1, 15, 1300, 33, 16]  # a partial block, one long context among short ones
    num_blocks = 2 + sum(-(-n // block_size) for n in seq_lens)
    cache = _random_cache(num_blocks, block_size, kv_heads, head_dim, dtype, 24, gen)
    max_blocks = max(-(-n // block_size) for n in seq_lens)
    ids = torch.randperm(num_blocks - 1, generator=gen) + 1  # shuffled, never the null block 0
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


def _want(q, cache, *args):
    """The reference's attention for the kernel's arithmetic: a bf16 cache's kernel rounds the
    query to bf16 (bf16 products), so the reference gets that query and the cache's values,
    exactly."""
    if cache.dtype == torch.bfloat16:
        q = q.bfloat16().float()
    return ref_attention.paged_attention(q, cache.float(), *args)


def _assert_matches_reference(got, q, cache, *args):
    """fp32 caches: the reference to float rounding. bf16 caches weigh each value row by its
    probability rounded to bf16 (relative error <= 2^-8), so an output element is off by at
    most 2^-8 sum(p |v|) / sum(p): the attention of the same queries over |V|, which the
    reference gives too."""
    want = _want(q, cache, *args)
    if cache.dtype != torch.bfloat16:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5)
        return
    magnitude = cache.float()
    magnitude[:, 1] = magnitude[:, 1].abs()
    bound = 2**-8 * _want(q, magnitude.bfloat16(), *args) + 1e-5 * want.abs() + 2e-5
    excess = (got - want).abs() - bound
    assert excess.max() <= 0, f"off the reference by {excess.max().item()} beyond the bound"


DECODE_CASES = [
    (9, 3, 64, 16, None),
    (4, 4, 128, 32, None),
    (8, 2, 256, 16, 100),  # groups of 4: AVX-512 passes of 3 + 1 heads
    (9, 3, 64, 16, 5),
    (12, 2, 128, 16, None),  # Qwen2.5's groups of 6: one AVX-512 pass, two AVX2 passes
    (16, 2, 64, 32, None),  # groups of 8: 6 + 2 heads on AVX-512, 3 + 3 + 2 on AVX2
]


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,window", DECODE_CASES)
def test_paged_decode_matches_reference(dtype, heads, kv_heads, head_dim, block_size, window):
    q, cache, args = _decode_case(dtype, heads, kv_heads, head_dim, block_size, window)
    seq_lens, tables = args[1], args[2]
    unpoisoned = cache.clone()  # the reference's
    if window is not None:  # blocks wholly out of the window may already be freed: poison them
        for i, n in enumerate(seq_lens):
            for b in range(max(0, n - window) // block_size):
                cache[tables[i, b]] = float("nan")
    got = cpu.paged_attention(q, cache, *args)
    assert not got.isnan().any()
    _assert_matches_reference(got, q, unpoisoned, *args)


@needs_kernels
def test_paged_attention_mixed_prefill_and_decode_rows():
    gen = torch.Generator().manual_seed(11)
    cache = _random_cache(40, 16, 3, 64, torch.float32, 0, gen)
    tables = torch.arange(1, 37).reshape(3, 12)
    seq_lens, loc = [40, 150, 7], [0, 1, 6, 7]  # decode, a 5-token chunk, decode
    q = torch.randn(7, 9, 64, generator=gen)
    args = (q, cache, loc, seq_lens, tables, torch.tensor([0, 2]), [1], 0.125, None)
    torch.testing.assert_close(
        cpu.paged_attention(*args), ref_attention.paged_attention(*args), rtol=1e-5, atol=2e-5
    )


@needs_avx512
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", DECODE_CASES)
def test_paged_attention_avx512_equals_avx2(dtype, case):
    q, cache, args = _decode_case(dtype, *case)
    # a prefill chunk too: rows 1..4 of one request (tiles of rows), then a decode row
    qs = torch.cat([q, q[:3] * 0.5])
    loc, seq_lens, tables = (
        [0, 1, 2, 3, 4, 5, 8],
        [*args[1], 40],
        torch.cat([args[2], args[2][2:3]]),
    )
    rest = (loc, seq_lens, tables, torch.arange(5), [5], *args[5:])
    outs = []
    for isa in ("avx2", "avx512"):
        with cpu.use_isa(isa):
            outs.append(cpu.paged_attention(qs, cache, *rest))
    assert torch.equal(outs[0], outs[1])  # every lane runs the AVX2 lane's arithmetic


@needs_avx512
def test_bf16_denormals_flush_alike_on_every_isa():
    # VDPBF16PS treats denormal inputs as zero and flushes denormal sums; the AVX2 loops get
    # the same from MXCSR's DAZ and FTZ. Keys of tiny and denormal values and queries near the
    # float maximum (so the denormals' products would weigh in the scores), a decode row and a
    # tile of prefill rows: the same bits on both ISAs.
    gen = torch.Generator().manual_seed(9)
    cache = _random_cache(12, 16, 3, 64, torch.float32, 0, gen)
    cache[:, 0] *= torch.where(torch.rand(cache[:, 0].shape, generator=gen) < 0.5, 1e-38, 1e-36)
    cache = cache.to(torch.bfloat16)
    keys = cache[:, 0].float()
    assert ((keys != 0) & (keys.abs() < 1.1754944e-38)).sum() > 1000  # denormals
    q = torch.randn(9, 9, 64, generator=gen) * 1e33
    tables = torch.arange(1, 11).reshape(2, 5)
    args = (q, cache, [0, 1, 9], [70, 77], tables, torch.tensor([0]), [1], 0.125, None)
    outs = []
    for isa in ("avx2", "avx512"):
        with cpu.use_isa(isa):
            outs.append(cpu.paged_attention(*args))
    assert not outs[0].isnan().any()
    assert torch.equal(outs[0], outs[1])


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_rows_equal_the_same_rows_alone(dtype):
    # a 20-row chunk (tiles of rows share each K/V chunk, bf16 read in paired order)
    gen = torch.Generator().manual_seed(5)
    cache = _random_cache(40, 16, 3, 64, dtype, 0, gen)
    tables = torch.arange(1, 37).reshape(3, 12)
    q = torch.randn(20, 9, 64, generator=gen)
    chunk = (q, cache, [0, 20], [150], tables[1:2], torch.tensor([], dtype=torch.long), [0])
    got = cpu.paged_attention(*chunk, 0.125, None)
    _assert_matches_reference(got, q, cache, *chunk[2:], 0.125, None)
    for r in (0, 7, 8, 19):  # the same row decoded alone: bit for bit
        alone = cpu.paged_attention(
            q[r : r + 1], cache, [0, 1], [131 + r], tables[1:2], torch.tensor([0]), [], 0.125
        )
        assert torch.equal(alone[0], got[r])


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 256), (12, 2, 128)])
def test_tile_rows_in_pairs_equal_rows_alone(dtype, heads, kv_heads, head_dim):
    # AVX2 takes a bf16 tile's rows two at a time (three heads a pass: groups of 3, 4 = 3 + 1
    # and 6 = 3 + 3), AVX-512 with BF16 too where the group is 3 (their value sums together),
    # a row with one key more than its partner finishing alone; a 21-row chunk
    # makes tiles of 16 and 5 rows (the last row without a partner) and ends mid-chunk, so the
    # rows of a pair differ in keys. Every row equals the same row decoded alone, bit for bit
    # (AVX-512 with BF16 scores a tile's rows from each chunk's K transposed, a row alone from
    # K as stored: the same arithmetic).
    gen = torch.Generator().manual_seed(head_dim)
    cache = _random_cache(14, 16, kv_heads, head_dim, dtype, 0, gen)
    table = (torch.randperm(13, generator=gen)[:12] + 1).view(1, -1)
    q = torch.randn(21, heads, head_dim, generator=gen)
    no_decodes = torch.tensor([], dtype=torch.long)
    chunk = (q, cache, [0, 21], [185], table, no_decodes, [0], head_dim**-0.5, None)
    got = cpu.paged_attention(*chunk)
    _assert_matches_reference(got, q, cache, *chunk[2:])
    for r in range(21):
        alone = cpu.paged_attention(
            q[r : r + 1], cache, [0, 1], [165 + r], table, torch.tensor([0]), [], head_dim**-0.5
        )
        assert torch.equal(alone[0], got[r])


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size,window", [(8, None), (32, None), (128, None), (8, 37)])
def test_chunks_across_blocks_equal_rows_alone(dtype, block_size, window):
    # The softmax folds 64-key chunks: with 8-token blocks a chunk is 8 segments in shuffled
    # blocks, with 128-token blocks a chunk is a block; a window starts a row's keys mid-chunk.
    # A 70-row chunk at context 700 (two 512-key splits, tiles of 16 rows) equals the reference,
    # and each row equals the same row alone, bit for bit, whatever the thread count.
    gen = torch.Generator().manual_seed(block_size)
    num_blocks = 2 + -(-700 // block_size)
    cache = _random_cache(num_blocks, block_size, 3, 64, dtype, 0, gen)
    table = (torch.randperm(num_blocks - 1, generator=gen)[: num_blocks - 2] + 1).view(1, -1)
    q = torch.randn(70, 9, 64, generator=gen)
    no_decodes = torch.tensor([], dtype=torch.long)
    chunk = (q, cache, [0, 70], [700], table, no_decodes, [0], 0.125, window)
    got = cpu.paged_attention(*chunk)
    _assert_matches_reference(got, q, cache, *chunk[2:])
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


@pytest.mark.slow
def test_gguf_quantized_tensors_are_exact():
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize

    from agentx.engine.models.loader import default_model_path
    from agentx.engine.models.loader.gguf import _read_quantized

    reader = GGUFReader(default_model_path())
    seen = set()
    for tensor in reader.tensors:
        kind = tensor.tensor_type
        if kind not in (GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0) or kind in seen:
            continue
        seen.add(kind)
        got = _read_quantized(tensor)
        want = dequantize(tensor.data, kind).reshape(got.shape)
        assert got.bits == (4 if kind == GGMLQuantizationType.Q4_1 else 8)
        assert torch.equal(got.dequantize(), torch.from_numpy(want))
    assert len(seen) == 2


def test_build_ignores_the_lock_file_a_killed_build_left(tmp_path, monkeypatch):
    """torch's builder waits forever on its `lock` file; a build killed mid-way (Ctrl-C on the
    first import) leaves one. Holding agentx's own lock, the builder removes it and builds."""
    from torch.utils import cpp_extension

    from agentx.kernels.cpu import build

    folder = tmp_path / "kernels"
    folder.mkdir()
    (folder / "lock").write_text("")  # what the killed build left
    calls = []

    def fake_load(**kwargs):
        assert not (folder / "lock").exists()
        calls.append(kwargs["build_directory"])
        return str(folder / "agentx_cpu_kernels.so")

    monkeypatch.setattr(build, "_build_dir", lambda: folder)
    monkeypatch.setattr(cpp_extension, "load", fake_load)
    monkeypatch.setattr(torch.ops, "load_library", lambda path: calls.append(path))
    assert build._build_and_load(verbose=False)
    # built once; then loaded, since the fake builder loaded nothing
    assert calls == [str(folder), str(folder / "agentx_cpu_kernels.so")]


@needs_kernels
def test_argmax_rows_gives_torchs_argmax():
    # the first maximum of each row (ties, -0 beside +0, all -inf), the first NaN where a row
    # has one, rows shorter and longer than a register, at any thread count
    gen = torch.Generator().manual_seed(11)
    for vocab in (1, 7, 8, 9, 49152, 151936):
        logits = torch.randn(37, vocab, generator=gen)
        if vocab > 8:
            logits[1, 3] = logits[1, vocab - 2] = logits[1].max() + 1  # a tie: the first
            logits[2] = 0.0
            logits[2, 5] = -0.0  # -0 equals +0: index 0
            logits[3] = float("-inf")
            logits[4, vocab - 1] = float("nan")
            logits[5, 6] = float("nan")
            logits[5, 2] = float("nan")
            logits[6, vocab - 1] = float("inf")
        want = logits.argmax(dim=-1)
        assert torch.equal(cpu.argmax_rows(logits), want), vocab
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            assert torch.equal(cpu.argmax_rows(logits), want), vocab
        finally:
            torch.set_num_threads(threads)
    assert cpu.argmax_rows(torch.empty(0, 5)).shape == (0,)
    with pytest.raises(RuntimeError, match="float32"):
        cpu.argmax_rows(torch.zeros(2, 3, dtype=torch.float64))
