"""vLLM in the caller's process (``LLMEngine``, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) vs
``AsyncLLM`` (engine core in a child process): start-up, TTFT and decode speed, one mode per
run (vLLM reads the variable at import). Indicative only; run it on an idle machine for numbers.

    .venv-vllm/bin/python benchmarks/vllm_process_modes.py --mode inproc|async [--threads 2]

Prints one JSON line: mode, start_s, ttft_s (median of --requests sequential requests of a
--prompt-tokens prompt), decode_tok_s (output tokens after the first / their time), and the
number of processes vLLM started.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("inproc", "async"), required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--requests", type=int, default=5)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=32)
    args = p.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if args.mode == "inproc" else "1"
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from agentx.engine.models.hf_export import export_default

    folder = str(export_default())
    import psutil
    from vllm import SamplingParams, TokensPrompt
    from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
    from vllm.sampling_params import RequestOutputKind

    kwargs = dict(model=folder, dtype="float32", enforce_eager=True, max_model_len=4096,
                  enable_prefix_caching=False, block_size=32, skip_tokenizer_init=True)  # fmt: skip
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True,
                              detokenize=False, output_kind=RequestOutputKind.DELTA)  # fmt: skip
    n = args.prompt_tokens
    prompts = [TokensPrompt(prompt_token_ids=[(i * 7 + j) % 4000 + 100 for j in range(n)])
               for i in range(args.requests)]  # fmt: skip
    t0 = time.perf_counter()
    ttfts, rates = [], []
    if args.mode == "inproc":
        from vllm.v1.engine.llm_engine import LLMEngine

        engine = LLMEngine.from_engine_args(EngineArgs(**kwargs))
        start_s = time.perf_counter() - t0
        for i, prompt in enumerate(prompts):
            t = time.perf_counter()
            engine.add_request(f"r{i}", prompt, sampling)
            first = None
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.outputs and out.outputs[0].token_ids and first is None:
                        first = time.perf_counter()
            ttfts.append(first - t)
            rates.append((args.max_tokens - 1) / (time.perf_counter() - first))
    else:
        from vllm.v1.engine.async_llm import AsyncLLM

        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
        start_s = time.perf_counter() - t0

        async def run() -> None:
            for i, prompt in enumerate(prompts):
                t, first = time.perf_counter(), None
                async for out in engine.generate(prompt, sampling, f"r{i}"):
                    if out.outputs and out.outputs[0].token_ids and first is None:
                        first = time.perf_counter()
                ttfts.append(first - t)
                rates.append((args.max_tokens - 1) / (time.perf_counter() - first))

        asyncio.run(run())
    children = len(psutil.Process().children(recursive=True))
    if args.mode == "async":
        engine.shutdown()  # the engine core child process goes with it
    print(json.dumps({"mode": args.mode, "start_s": round(start_s, 1),
                      "ttft_s": round(statistics.median(ttfts), 3),
                      "decode_tok_s": round(statistics.median(rates), 1),
                      "child_processes": children}), flush=True)  # fmt: skip
    os._exit(0)


if __name__ == "__main__":
    main()
