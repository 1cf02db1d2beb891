"""Quantized weights against the dequantized fp32 reference: logit error and agreement.

Both engines load the same GGUF: ``quantization="none"`` dequantizes every matrix to fp32 (the
reference, equal to transformers), ``"auto"`` keeps Q4_1 / Q8_0 and runs the int4 / int8
kernels with int8 activations. Over teacher-forced texts (every position of each prompt and
of the fp32 model's 64-token greedy continuation) it reports the max and mean absolute logit
error, the top-1 agreement, and, for free-running greedy decoding, how many leading tokens of
each prompt's 64 agree; for the quantized mode with a float32 and with a bfloat16 KV cache.

    python benchmarks/quant_quality.py
"""

# ruff: noqa: E402

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

from agentx import CacheConfig, Engine, EngineConfig, SamplingParams
from agentx.engine.models.forward_context import AttentionMetadata, ForwardContext, forward_context

TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village by the sea,",
    "List three primary colors:\n1.",
    "<|im_start|>user\nWhat is 2+2? Answer in one short sentence.<|im_end|>\n"
    "<|im_start|>assistant\n",
]


def teacher_forced_logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    """(len(ids), vocab) logits of one prompt in one step, KV in blocks 1, 2, ..."""
    runner = engine.core.runner  # a measurement reaches in; the API does not give logits
    block = runner.layout.block_size
    n = len(ids)
    blocks = torch.arange(1, 1 + -(-n // block))
    slots = torch.tensor([int(blocks[p // block]) * block + p % block for p in range(n)])
    meta = AttentionMetadata(
        slots, [0, n], [n], blocks.unsqueeze(0), torch.empty(0, dtype=torch.long), [0]
    )
    ctx = ForwardContext((meta,) * len(runner.layout.groups), runner.layer_groups, runner.kv_caches)
    with torch.inference_mode(), forward_context(ctx):
        hidden = runner.model(torch.tensor(ids), torch.arange(n))
        return runner.model.compute_logits(hidden)


def main() -> None:
    ref = Engine(EngineConfig(quantization="none", cache=CacheConfig(kv_cache_bytes=128 << 20)))
    for kv_dtype in ("float32", "bfloat16"):
        cache = CacheConfig(kv_cache_bytes=128 << 20, kv_cache_dtype=kv_dtype)
        with Engine(EngineConfig(quantization="auto", cache=cache)) as quant:
            compare(ref, quant, f"auto, {kv_dtype} KV")
    ref.close()


def compare(ref: Engine, quant: Engine, label: str) -> None:
    greedy = SamplingParams(max_tokens=64, ignore_eos=True)
    errors, agree, total, leading = [], 0, 0, []
    for text in TEXTS:
        prompt = ref.tokenizer.encode(text)
        ref_out = ref.generate([prompt], greedy)[0].token_ids
        quant_out = quant.generate([prompt], greedy)[0].token_ids
        same = next(
            (i for i, (a, b) in enumerate(zip(ref_out, quant_out, strict=True)) if a != b), 64
        )
        leading.append(same)
        ids = prompt + ref_out
        a, b = teacher_forced_logits(ref, ids), teacher_forced_logits(quant, ids)
        errors.append((a - b).abs())
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        total += len(ids)
    err = torch.cat([e.flatten() for e in errors])
    print(f"{label}: positions {total}: top-1 agreement {agree / total:.1%}, logit error max "
          f"{err.max():.3f} mean {err.mean():.4f}; greedy leading agreement per prompt "
          f"(of 64): {leading}")  # fmt: skip


if __name__ == "__main__":
    main()
