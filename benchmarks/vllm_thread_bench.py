"""Which thread builds and steps vLLM's in-process engine, and what it costs on CPU.

Decode tok/s after a 2,048-token prompt (128 greedy tokens, 4 runs after a warm-up), fp32,
2 threads, torch.compile'd graphs, in one of four ways:

    main         LLMEngine built and stepped on the main thread (the vllm peer's way)
    thread       built on the main thread, stepped from another one
    same-thread  built and stepped on one thread that is not the main one
    backend      agentx's VLLMEngine (builds and steps on its loop thread)

Runs in the vLLM venv:  .venv-vllm/bin/python benchmarks/vllm_thread_bench.py main|thread|...
"""

# ruff: noqa: E402 - the OpenMP wait policy must be set before torch is imported

from __future__ import annotations

import os
import sys
import threading
import time

os.environ.pop("OMP_WAIT_POLICY", None)
os.environ["GOMP_SPINCOUNT"] = "10000"  # the vllm peer's default wait policy (spin briefly)

PROMPT = list(range(1000, 3048))


def raw_engine():
    os.environ.update(
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_CPU_KVCACHE_SPACE="4",
        VLLM_CPU_OMP_THREADS_BIND="nobind",
    )
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    from agentx.engine.models.hf_export import export_default

    args = EngineArgs(
        model=str(export_default()), dtype="float32", enable_prefix_caching=True,
        skip_tokenizer_init=True, enforce_eager=False, max_model_len=8192, max_num_seqs=16,
        max_num_batched_tokens=2048, block_size=64, seed=0,
    )  # fmt: skip
    return LLMEngine.from_engine_args(args)


def raw_run(engine, prompt: list[int], num: int, rid: str) -> float:
    from vllm import SamplingParams, TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    sampling = SamplingParams(
        temperature=0, max_tokens=num, ignore_eos=True, detokenize=False,
        output_kind=RequestOutputKind.DELTA,
    )  # fmt: skip
    engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), sampling)
    first = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if first is None and out.outputs and out.outputs[0].token_ids:
                first = time.perf_counter()
    return (num - 1) / (time.perf_counter() - first)


def backend_run(engine, prompt: list[int], num: int, rid: str) -> float:
    from agentx import SamplingParams

    stream = engine.add_request(prompt, SamplingParams(max_tokens=num, ignore_eos=True))
    first = None
    while True:
        out = stream.get()
        if first is None and out.new_token_ids:
            first = time.perf_counter()
        if out.finished:
            return (num - 1) / (time.perf_counter() - first)


def measure(engine, run) -> None:
    import torch

    torch.set_num_threads(2)
    run(engine, PROMPT[:64], 4, "warm")
    rates = [run(engine, [i, *PROMPT], 128, f"r{i}") for i in range(4)]
    print(f"{sys.argv[1]}: decode tok/s " + " ".join(f"{r:.1f}" for r in rates), flush=True)


def in_thread(target) -> None:
    thread = threading.Thread(target=target)
    thread.start()
    thread.join()


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "main"
    if mode == "main":
        measure(raw_engine(), raw_run)
    elif mode == "thread":
        engine = raw_engine()
        in_thread(lambda: measure(engine, raw_run))
    elif mode == "same-thread":
        in_thread(lambda: measure(raw_engine(), raw_run))
    elif mode == "backend":
        from agentx.engine.vllm import VLLMConfig, VLLMEngine

        config = VLLMConfig(num_threads=2, cpu_kv_cache_gib=4, block_size=64, enforce_eager=False)
        with VLLMEngine(config) as engine:
            measure(engine, backend_run)
    else:
        raise SystemExit(f"unknown mode {mode!r}: main, thread, same-thread or backend")


if __name__ == "__main__":
    main()
