"""The agentx side of the worker protocol (:mod:`agentx.bench.protocol`)::

    python -m agentx.bench.worker --model PATH --threads N [--dtype D] [--quantization Q]
        [--kv-cache-gib G] [--kv-cache-dtype auto|float32|bfloat16|int8]
        [--block-size N] [--huge-pages]
        [--backend agentx|vllm] [--tp N --dcp N --pcp N --ep N --dp N]

``--tp/--dcp/--pcp/--ep/--dp`` are agentx's ``ParallelConfig`` degrees (``dp > 1``: a
``ReplicaRouter`` of ``dp`` engines), so ``bench saturate`` and sweeps can vary the strategy.
``--backend vllm`` serves the same protocol from agentx's vLLM backend (``agentx-vllm``).

Loads the engine, says ``ready``, then serves ``generate`` lines concurrently (the engine batches
them) until ``shutdown`` or end of input. Protocol lines are the only thing written to stdout:
file descriptor 1 is pointed at stderr so that stray prints cannot corrupt the stream.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import threading

from agentx.bench import protocol
from agentx.bench.adapter import Done, EngineAdapter, GenerateRequest, Tokens
from agentx.bench.agentx_adapter import AgentxAdapter, AgentxOptions
from agentx.bench.engines import PARALLEL_DEGREES


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m agentx.bench.worker", description=__doc__)
    p.add_argument(
        "--model",
        default=None,
        help="GGUF file or HF folder; 'default' or omitted: the embedded SmolLM2-135M-Instruct",
    )
    p.add_argument("--threads", type=int, default=None)
    p.add_argument(
        "--small-step-tokens",
        type=int,
        default=None,
        help="steps of at most this many tokens run on one thread (default: EngineConfig's)",
    )
    p.add_argument("--backend", default="agentx", choices=("agentx", "vllm"))
    p.add_argument(
        "--vllm-compile",
        choices=("on", "off"),
        default="on",
        help="--backend vllm: torch.compile'd graphs (on, as the vllm peer) or eager (off)",
    )
    p.add_argument("--dtype", default="float32")
    p.add_argument("--quantization", default="auto", choices=("none", "auto", "int8", "int4"))
    p.add_argument("--kv-cache-gib", type=float, default=2.0)
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16", "int8"),
        help="CacheConfig.kv_cache_dtype (the agentx backend)",
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="CacheConfig.block_size, tokens a KV block (the agentx backend; default: its own)",
    )
    p.add_argument(
        "--huge-pages",
        action="store_true",
        help="CacheConfig.huge_pages: the KV pool on transparent huge pages (the agentx backend)",
    )
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument(
        "--decode-step-target-ms",
        type=float,
        default=None,
        help="the scheduler's step-time target while requests decode (default: the config's)",
    )
    p.add_argument(
        "--scheduler",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a SchedulerConfig field (int, float, true/false), e.g. short_turn_tokens=256",
    )
    p.add_argument(
        "--speculative",
        choices=("on", "off"),
        default=None,
        help="drafting from context (default: SpeculativeConfig's)",
    )
    for degree in PARALLEL_DEGREES:
        p.add_argument(f"--{degree}", type=int, default=1, help=f"ParallelConfig.{degree}")
    return p.parse_args(argv)


def parallel_options(args: argparse.Namespace) -> dict[str, int]:
    """The ParallelConfig degrees given (those that are not 1)."""
    return {d: getattr(args, d) for d in PARALLEL_DEGREES if getattr(args, d) != 1}


class _Worker:
    def __init__(self, engine: EngineAdapter, out) -> None:
        self.engine, self.out = engine, out
        self.tasks: set[asyncio.Task] = set()

    def send(self, line: bytes) -> None:
        self.out.write(line)
        self.out.flush()

    async def generate(self, op: dict) -> None:
        rid = op["id"]
        request = GenerateRequest(
            rid,
            op["session"],
            list(op["prompt"]),
            int(op["max_tokens"]),
            bool(op.get("return_ids", False)),
        )
        try:
            async for event in self.engine.generate(request):
                if isinstance(event, Tokens):
                    self.send(protocol.tokens_ev(rid, event.n))
                elif isinstance(event, Done):
                    self.send(
                        protocol.done_ev(rid, event.num_output, event.num_cached, event.token_ids)
                    )
        except Exception as exc:  # noqa: BLE001 - reported to the driver, the worker goes on
            self.send(protocol.error_ev(rid, f"{type(exc).__name__}: {exc}"))

    async def serve(self, lines: asyncio.Queue) -> None:
        while (line := await lines.get()) is not None:
            if not line.strip():
                continue
            try:
                op = protocol.decode(line, "op")
            except protocol.ProtocolError as exc:
                self.send(protocol.error_ev(None, str(exc)))
                continue
            if op["op"] == "shutdown":
                break
            if op["op"] == "end_session":
                await self.engine.end_session(op["session"])
                continue
            if op["op"] == "stats":
                self.send(protocol.stats_ev(await self.engine.final_stats()))
                continue
            task = asyncio.create_task(self.generate(op))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


def _read_stdin(loop: asyncio.AbstractEventLoop, lines: asyncio.Queue) -> None:
    try:
        for line in sys.stdin.buffer:
            loop.call_soon_threadsafe(lines.put_nowait, line)
        loop.call_soon_threadsafe(lines.put_nowait, None)
    except RuntimeError:
        pass  # the loop is closed: the worker is exiting


async def serve(engine: EngineAdapter, out) -> None:
    """Start ``engine``, say ``ready`` on ``out`` and serve stdin until shutdown or EOF."""
    worker = _Worker(engine, out)
    try:
        info = await engine.start()
        worker.send(protocol.ready_ev(info.engine, info.version, info.config))
        lines: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        threading.Thread(target=_read_stdin, args=(loop, lines), daemon=True).start()
        await worker.serve(lines)
    except Exception as exc:  # noqa: BLE001 - e.g. the model cannot be loaded
        worker.send(protocol.error_ev(None, f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        await engine.close()


def protocol_stdout():
    """The real stdout for protocol lines; fd 1 (print, C libraries) goes to stderr after."""
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


def agentx_options(args: argparse.Namespace) -> AgentxOptions:
    model = None if args.model in (None, "", "default") else args.model
    return AgentxOptions(
        model=model,
        threads=args.threads,
        dtype=args.dtype,
        quantization=args.quantization,
        kv_cache_bytes=int(args.kv_cache_gib * (1 << 30)),
        kv_cache_dtype=args.kv_cache_dtype,
        block_size=args.block_size,
        huge_pages=args.huge_pages,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        decode_step_target_ms=args.decode_step_target_ms,
        scheduler_options=_scheduler_options(args.scheduler),
        speculative=None if args.speculative is None else args.speculative == "on",
        small_step_tokens=args.small_step_tokens,
        parallel=parallel_options(args),
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = protocol_stdout()
    model = None if args.model in (None, "", "default") else args.model
    if args.backend == "vllm":
        from agentx.bench.agentx_vllm_adapter import AgentxVLLMAdapter, AgentxVLLMOptions

        vllm_options = AgentxVLLMOptions(
            model=model if model is None or os.path.isdir(model) else None,
            threads=args.threads,
            dtype=args.dtype,
            kv_cache_gib=max(1, round(args.kv_cache_gib)),
            max_num_seqs=min(args.max_num_seqs, 16),
            max_num_batched_tokens=args.max_num_batched_tokens,
            compile=args.vllm_compile == "on",
        )
        asyncio.run(serve(AgentxVLLMAdapter(vllm_options), out))
        return
    asyncio.run(serve(AgentxAdapter(agentx_options(args)), out))


def _scheduler_options(items: list[str]) -> dict:
    """``NAME=VALUE`` pairs as SchedulerConfig keyword arguments (ints stay ints, true /
    false are booleans)."""
    options = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--scheduler takes NAME=VALUE, got {item!r}")
        if value.lower() in ("true", "false"):
            options[name] = value.lower() == "true"
        else:
            options[name] = float(value) if "." in value else int(value)
    return options


if __name__ == "__main__":
    main()
