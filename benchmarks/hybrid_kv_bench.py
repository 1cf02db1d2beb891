"""Hybrid KV cache numbers (issue 5), no model compute: the real KV manager and layout planner.

1. Gemma 3 270M (5 sliding-window layers per global one, window 512): KV bytes per token of an
   8K-token session and how many such sessions fit at once in a fixed pool, hybrid manager vs
   full allocation for every layer.
2. A Qwen3-Next-style hybrid (3 gated-DeltaNet layers per full-attention layer): prefix hit rate
   of each retention policy (and of none) replaying a synthesized AgentX-shaped trace through
   the KV manager, against the trace's theoretical hit rate.

    python benchmarks/hybrid_kv_bench.py [--pool-gib 1] [--sessions 16] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from agentx.config import CacheConfig
from agentx.engine.kv_cache import KVCacheManager
from agentx.engine.kv_cache.retention import make_retention
from agentx.engine.models.loader import gemma3_270m_path, load_checkpoint
from agentx.engine.models.spec import ModelSpec
from agentx.engine.request import Request
from agentx.engine.runner.kv_layout import get_layer_specs, plan_kv_layout
from agentx.engine.sampling import SamplingParams

CONTEXT = 8192
CHUNK = 2048  # tokens per prefill step (the default token budget)


def gemma3_capacity(spec: ModelSpec, pool_bytes: int, block_size: int = 16) -> dict:
    rows = {}
    for name, layer_types in (("hybrid", spec.layer_types), ("full for all layers", ())):
        s = dataclasses.replace(spec, layer_types=layer_types)
        specs = get_layer_specs(s, None, block_size, torch.float32)
        layout = plan_kv_layout(
            specs, CacheConfig(block_size=block_size, kv_cache_bytes=pool_bytes)
        )
        kv = KVCacheManager(layout)
        block_bytes = layout.page_size_bytes * layout.num_slots
        num_fit, per_session = 0, []
        while True:
            request = _request(
                f"s{num_fit}", list(range(num_fit * CONTEXT, (num_fit + 1) * CONTEXT))
            )
            before = kv.get_num_used_blocks()
            ok = True
            while request.num_computed_tokens < CONTEXT:
                if kv.allocate_slots(request, CHUNK) is None:
                    ok = False
                    break
                request.num_computed_tokens += CHUNK
            if not ok:
                break
            kv.allocate_slots(request, 1)  # the first decode: out-of-window blocks go back
            per_session.append((kv.get_num_used_blocks() - before) * block_bytes)
            num_fit += 1
        rows[name] = {
            "groups": len(layout.groups),
            "kv_bytes_per_token": per_session[0] / CONTEXT if per_session else None,
            "sessions_of_8k_that_fit": num_fit,
        }
    return rows


def qwen3_next_like_spec() -> ModelSpec:
    """Qwen3-Next-80B's attention layout (48 layers: 3 gated DeltaNet per full attention), state
    sizes from its config; only the KV layout matters here."""
    return ModelSpec(
        architecture="qwen3_next",
        vocab_size=151_936,
        hidden_size=2048,
        intermediate_size=5120,
        num_layers=48,
        num_heads=16,
        num_kv_heads=2,
        head_dim=256,
        rms_norm_eps=1e-6,
        rope_theta=1e7,
        max_position=262_144,
        tie_word_embeddings=False,
        layer_types=tuple(
            "full_attention" if i % 4 == 3 else "linear_attention" for i in range(48)
        ),
    )


class _LinearShapes:
    """The linear layer's state (conv, recurrent), for the layout planner: Qwen3-Next-80B's by
    default (2.2 MB: the block size rises to 2,048 tokens), or a small one that fits a 16-token
    block (to see the policies apart at a fine checkpoint granularity)."""

    linear_state_dtype = torch.float32

    def __init__(self, shapes: tuple[tuple[int, ...], ...] = ((8192, 3), (32, 128, 128))):
        self.shapes = shapes

    def get_linear_state_shapes(self) -> tuple[tuple[int, ...], ...]:
        return self.shapes


def retention_hit_rates(trace, pool_bytes: int, interval: int, shapes=None) -> dict:
    from agentx.bench.prompts import PromptBuilder
    from agentx.bench.trace_stats import trace_stats

    spec = qwen3_next_like_spec()
    model = _LinearShapes(shapes) if shapes else _LinearShapes()
    specs = get_layer_specs(spec, model, 16, torch.bfloat16)
    block_size = specs[0].block_size  # raised until an attention page holds a state
    layout = plan_kv_layout(specs, CacheConfig(block_size=16, kv_cache_bytes=pool_bytes))
    builder = PromptBuilder(trace.block_size)
    stats = trace_stats(trace)
    rows = {"block_size": block_size, "num_blocks": layout.num_blocks}
    rows["theoretical"] = stats.theoretical_hit_rate
    for name, every in (("none", 0), ("interval", 0), ("interval", interval), ("marconi", 0)):
        kv = KVCacheManager(layout, retention=make_retention(name, every))
        num_prompt = num_hit = 0
        for i, (session, req) in enumerate(trace.iter_requests()):
            prompt = builder.prompt(session.scope, req.hash_ids, req.num_input_tokens, f"r{i}")
            request = Request(
                f"r{i}",
                prompt,
                SamplingParams(max_tokens=1, ignore_eos=True),
                block_size=block_size,
            )
            num_prompt += len(prompt)
            num_hit += _replay_one(kv, request, req.num_output_tokens, 10_000_000 + i * 100_000)
        rows[f"{name}({every})" if name == "interval" else name] = num_hit / num_prompt
    return rows


def _replay_one(kv: KVCacheManager, request: Request, num_output: int, fresh: int) -> int:
    """Prefill in chunks and decode (outputs differ from the trace's next prompt, as a real
    model's would); returns the prefix-hit tokens."""
    hit, num_hit = kv.get_computed_blocks(request)
    first = min(CHUNK, request.num_tokens - num_hit)
    if kv.allocate_slots(request, first, num_hit, hit) is None:
        raise RuntimeError("the pool is too small for one request")
    request.num_computed_tokens = num_hit + first
    while request.num_computed_tokens < request.num_tokens:
        n = min(CHUNK, request.num_tokens - request.num_computed_tokens)
        if kv.allocate_slots(request, n) is None:
            raise RuntimeError("the pool is too small for one request")
        request.num_computed_tokens += n
    for j in range(num_output - 1):
        request.append_output_token(fresh + j)
        if kv.allocate_slots(request, 1) is None:
            raise RuntimeError("the pool is too small for one request")
        request.num_computed_tokens += 1
    kv.free(request)
    return num_hit


def _request(rid: str, token_ids: list[int]) -> Request:
    return Request(rid, token_ids, SamplingParams(max_tokens=1, ignore_eos=True), block_size=16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pool-gib", type=float, default=1.0)
    parser.add_argument("--json", default=None)
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--scale", type=float, default=0.25)
    parser.add_argument("--interval", type=int, default=1024)
    parser.add_argument("--hybrid-pool-gib", type=float, default=8.0)
    args = parser.parse_args()
    from agentx.bench.synth import SynthConfig, synthesize

    spec = load_checkpoint(gemma3_270m_path(), torch.float32).spec
    pool = int(args.pool_gib * (1 << 30))
    trace = synthesize(
        SynthConfig(num_sessions=args.sessions, scale=args.scale, max_context_tokens=60_000)
    )
    hybrid_pool = int(args.hybrid_pool_gib * (1 << 30))
    result = {
        "gemma3_270m": gemma3_capacity(spec, pool),
        "pool_bytes": pool,
        "qwen3_next_retention": retention_hit_rates(trace, hybrid_pool, args.interval),
        "small_state_retention": retention_hit_rates(
            trace, pool, args.interval, shapes=((64, 3), (4, 16, 16))
        ),
        "trace": {"sessions": args.sessions, "scale": args.scale},
    }
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
