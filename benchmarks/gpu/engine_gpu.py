"""Engine prefill and decode speed on a GPU, with and without CUDA graphs.

Models are random-weight Hugging Face folders of two Llama shapes, written here (on the GPU
machine) with the SmolLM2 tokenizer from ``.gpu-payload/tokenizer`` (``prepare.sh``):
``smollm2-135m`` (SmolLM2-135M's shape: the real GGUF is over the device tool's transfer limit)
and ``llama-1b`` (Llama-3.2-1B's shape). Speed does not depend on the weights' values; outputs
run to ``max_tokens`` (``ignore_eos``). bfloat16 throughout.

Figures: prefill tok/s of one 4096-token prompt (median of 3 after a warm-up), and decode
tok/s of batches of 1, 16 and 64 requests (prompt 512 tokens, 128 new tokens each, counted
from the first token of the batch to the last).

    python benchmarks/gpu/engine_gpu.py --payload .gpu-payload [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

from agentx import CacheConfig, Engine, EngineConfig, SamplingParams, SchedulerConfig

SHAPES = {
    "smollm2-135m": dict(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0,
    ),
    "llama-1b": dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0,
    ),
}  # fmt: skip
# --smoke: a CPU run of the same code on a tiny shape (checks the folder loads and the loop runs)
SMOKE = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=49152, tie_word_embeddings=True, rope_theta=10000.0,
)  # fmt: skip
FIRST_PLAIN_TOKEN_ID = 100  # SmolLM2's special tokens sit below this


def write_model(folder: Path, shape: dict, tokenizer: Path, device: str) -> Path:
    """A LlamaForCausalLM folder: config.json, random bf16 safetensors, the tokenizer."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    head_dim = hidden // heads
    config = dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
        max_position_embeddings=8192, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
        torch_dtype="bfloat16", head_dim=head_dim, **shape,
    )  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*size):
        w = torch.randn(*size, generator=gen, device=device, dtype=torch.bfloat16)
        return (w * size[-1] ** -0.5).cpu()

    tensors = {"model.embed_tokens.weight": rand(shape["vocab_size"], hidden)}
    tensors["model.norm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        tensors[p + "self_attn.q_proj.weight"] = rand(heads * head_dim, hidden)
        tensors[p + "self_attn.k_proj.weight"] = rand(kv_heads * head_dim, hidden)
        tensors[p + "self_attn.v_proj.weight"] = rand(kv_heads * head_dim, hidden)
        tensors[p + "self_attn.o_proj.weight"] = rand(hidden, heads * head_dim)
        tensors[p + "mlp.gate_proj.weight"] = rand(inter, hidden)
        tensors[p + "mlp.up_proj.weight"] = rand(inter, hidden)
        tensors[p + "mlp.down_proj.weight"] = rand(hidden, inter)
    save_file(tensors, str(folder / "model.safetensors"))
    for f in tokenizer.iterdir():
        shutil.copy(f, folder / f.name)
    return folder


def prompts(rng: random.Random, n: int, size: int) -> list[list[int]]:
    return [[rng.randrange(FIRST_PLAIN_TOKEN_ID, 49152) for _ in range(size)] for _ in range(n)]


def bench_prefill(engine: Engine, size: int) -> float:
    rng, times = random.Random("prefill"), []
    for i, prompt in enumerate(prompts(rng, 4, size)):
        start = time.perf_counter()
        engine.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True)).result(600)
        if i:  # run 0 is the warm-up
            times.append(time.perf_counter() - start)
    return size / statistics.median(times)


def bench_decode(engine: Engine, batch: int, prompt_size: int, new: int) -> float:
    rng = random.Random(f"decode{batch}")
    sampling = SamplingParams(max_tokens=new, ignore_eos=True)
    streams = [engine.add_request(p, sampling) for p in prompts(rng, batch, prompt_size)]
    first = None
    count = 0
    for s in streams:  # prompts prefill first; count from the first streamed token on
        s.get(600)
    first = time.perf_counter()
    for s in streams:
        gen = s.result(600)
        count += len(gen.token_ids) - 1
    return count / (time.perf_counter() - first)


def run_model(name: str, folder: Path, graphs: bool, smoke: bool) -> dict:
    config = EngineConfig(
        model=str(folder), device="cpu" if smoke else "cuda",
        dtype="float32" if smoke else "bfloat16", max_model_len=8192,
        cache=CacheConfig(kv_cache_bytes=(256 << 20) if smoke else (16 << 30)),
        scheduler=SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=128),
        cuda_graph_batch_sizes=(1, 2, 4, 8, 16, 32, 64, 128) if graphs else (),
    )  # fmt: skip
    start = time.perf_counter()
    engine = Engine(config)
    try:
        row = {"model": name, "cuda_graphs": graphs, "start_s": time.perf_counter() - start}
        row["prefill_tok_s"] = bench_prefill(engine, 64 if smoke else 4096)
        for batch in (1, 16, 64):
            prompt_size, new = (8, 4) if smoke else (512, 128)
            row[f"decode_{batch}_tok_s"] = bench_decode(engine, batch, prompt_size, new)
    finally:
        engine.close()
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--payload", type=Path, default=Path(".gpu-payload"))
    parser.add_argument("--models-dir", type=Path, default=Path("/tmp/agentx-gpu-models"))
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU: a code check")
    args = parser.parse_args(argv)
    rows = []
    shapes = {"smoke": SMOKE} if args.smoke else SHAPES
    device = "cpu" if args.smoke else "cuda"
    for name, shape in shapes.items():
        folder = write_model(args.models_dir / name, shape, args.payload / "tokenizer", device)
        for graphs in (False, True):
            try:
                rows.append(run_model(name, folder, graphs, args.smoke))
            except Exception as e:  # one failing configuration still reports the others
                rows.append({"model": name, "cuda_graphs": graphs, "error": repr(e)[:500]})
            print(json.dumps(rows[-1]), flush=True)
    print("| model | CUDA graphs | prefill tok/s | decode 1 | decode 16 | decode 64 |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        if "error" in r:
            print(f"| {r['model']} | {r['cuda_graphs']} | error: {r['error'][:80]} | | | |")
            continue
        print(
            f"| {r['model']} | {r['cuda_graphs']} | {r['prefill_tok_s']:.0f} | "
            f"{r['decode_1_tok_s']:.0f} | {r['decode_16_tok_s']:.0f} | {r['decode_64_tok_s']:.0f} |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
