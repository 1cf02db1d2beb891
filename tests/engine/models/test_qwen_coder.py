"""The real coding model (Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M) with its K-quant weights
kept quantized: the file's Q4_K / Q6_K tensors come back as their blocks, the kernel equals the
reference on real rows, every layer runs as the fused decoder-layer op, the engine keeps ~the
file's size in weights and writes sensible code, the same tokens alone and batched. Skips when
the model is not pulled (`agentx models pull qwen2.5-coder-1.5b`)."""

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize

from agentx import CacheConfig, Engine, EngineConfig, SamplingParams, kernels, model_store
from agentx.engine.models.blocks import DecoderLayer
from agentx.engine.models.layers import MIXED, QuantizableLinear
from agentx.engine.models.loader import load_checkpoint
from agentx.engine.models.loader.gguf import mostly_file_backed
from agentx.engine.models.loader.gguf_file import GGUFFile
from agentx.engine.models.quant import KQuantTensor
from agentx.kernels import cpu
from agentx.kernels.ref import kquant

NAME = "qwen2.5-coder-1.5b"
ENTRY = model_store.MODELS[NAME]
# looked up at import, before any test points AGENTX_CACHE_DIR elsewhere
PATH = model_store.model_file(ENTRY) if model_store.is_present(ENTRY) else None
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(PATH is None, reason=f"{NAME} not pulled: run agentx models pull {NAME}"),
]


def test_kquant_tensors_read_exactly():
    reader = GGUFFile(PATH)
    tensors = {t.name: t for t in reader.tensors}
    for name in ("blk.0.attn_q.weight", "blk.0.ffn_down.weight", "output.weight"):
        tensor = tensors[name]
        rows = np.asarray(tensor.data)[:8]
        want = gguf_dequantize(rows, tensor.tensor_type).reshape(8, -1)
        got = kquant.dequantize(torch.from_numpy(rows.copy()), int(tensor.tensor_type))
        assert np.array_equal(got.numpy().view(np.int32), want.view(np.int32)), name


def _mapped_file(address: int) -> str | None:
    """The file this process maps at ``address`` (/proc/self/maps), None for anonymous memory."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        lo, hi = (int(v, 16) for v in parts[0].split("-"))
        if lo <= address < hi:
            return parts[5] if len(parts) == 6 else None
    return None


def test_kquant_blocks_are_the_mapped_file_and_not_cached_again(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTX_CACHE_DIR", str(tmp_path))
    checkpoint = load_checkpoint(PATH, keep_quantized=True)
    assert mostly_file_backed(checkpoint)
    # no 1 GB copy of the file under the cache: reading the GGUF again costs the same
    assert not list(tmp_path.glob("checkpoints/*.pt"))
    down = checkpoint.weights["model.layers.0.mlp.down_proj.weight"]
    assert _mapped_file(down.data.data_ptr()) == str(PATH.resolve())
    reader = GGUFFile(PATH)
    raw = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
    assert np.array_equal(down.data.numpy().reshape(-1), np.asarray(raw.data).reshape(-1))


@pytest.mark.skipif(not cpu.available(), reason="the compiled CPU kernels are unavailable")
def test_kernel_equals_reference_on_real_rows():
    checkpoint = load_checkpoint(PATH, keep_quantized=True)
    kinds = {w.kind for w in checkpoint.weights.values() if isinstance(w, KQuantTensor)}
    assert kinds == {kquant.Q4_K, kquant.Q6_K}
    x = torch.randn(3, 8960, generator=torch.Generator().manual_seed(0))
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"):
        weight = checkpoint.weights[name].narrow(0, 0, 40)
        data = weight.data.contiguous()
        rows = x[:, : weight.shape[1]]
        want = kquant.kquant_linear(rows, data, weight.kind)
        assert torch.equal(torch.ops.agentx.kquant_linear(rows, data, weight.kind, None), want)


@pytest.mark.skipif(not cpu.available(), reason="the compiled CPU kernels are unavailable")
def test_engine_keeps_kquants_and_writes_code():
    engine = Engine(
        EngineConfig(model=NAME, num_threads=2, cache=CacheConfig(kv_cache_bytes=64 << 20))
    )
    try:
        model = engine.core.runner.model
        linears = [m for m in model.modules() if isinstance(m, QuantizableLinear)]
        layers = [m for m in model.modules() if isinstance(m, DecoderLayer)]
        assert len(layers) == 28
        if kernels.cpu_kernels_enabled():
            assert {m.bits for m in linears} == {kquant.Q4_K, kquant.Q6_K, MIXED}
            # every layer runs as the fused op: q | k | v with its bias, in one run or two
            assert all(layer._fused is not None for layer in layers)
            assert {layer.self_attn.qkv_proj.bits for layer in layers} == {kquant.Q4_K, MIXED}
            weight_bytes = sum(t.nbytes for t in model.buffers()) + sum(
                t.nbytes for t in model.parameters()
            )
            assert weight_bytes < 1.3 * ENTRY.size_bytes
        else:  # AGENTX_KERNELS=ref: the reference's float32 weights, its layers one op at a time
            assert {m.bits for m in linears} == {0}
            assert all(layer._fused is None for layer in layers)
        tok = engine.tokenizer
        prompts = [tok.encode("def quicksort(arr):\n"), tok.encode("class Stack:\n")]
        greedy = SamplingParams(max_tokens=12, ignore_eos=True)
        alone = engine.generate([prompts[0]], greedy)[0].token_ids
        batched = engine.generate(prompts, greedy)
        assert batched[0].token_ids == alone
        assert "if len(arr) <= 1" in tok.decode(alone)
    finally:
        engine.close()
