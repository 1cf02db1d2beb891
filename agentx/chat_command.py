"""``agentx chat``: a terminal chat with the model, streamed, on one warm Session.

Every line read is a user turn of one :class:`Session`, so the conversation's KV stays held
across turns and a turn computes only its new tokens (``--stats`` prints how many were cached).
Reads stdin line by line, so it also runs piped (``printf 'Hi\\nMore\\n' | agentx chat``).
``/exit`` or end of input ends it; ``/reset`` starts a new conversation.
"""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

__all__ = ["build_parser", "chat_main"]

PROMPT = ">>> "


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="agentx chat", description="Chat with a model in the terminal."
    )
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default SmolLM2-135M)")
    p.add_argument("--system", default=None, help="a system prompt")
    p.add_argument("--max-tokens", type=int, default=512, help="reply cap (default 512)")
    p.add_argument("--temperature", type=float, default=0.7, help="0 for greedy (default 0.7)")
    p.add_argument("--kv-cache-gib", type=float, default=1.0, help="KV cache size (default 1)")
    p.add_argument(
        "--quantization",
        default="auto",
        choices=("none", "auto", "int8", "int4"),
        help="weights kept quantized (default auto)",
    )
    p.add_argument(
        "--stats", action="store_true", help="after each reply: prompt, cached and output tokens"
    )
    return p


def chat_main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import anyio

    from agentx.config import CacheConfig, EngineConfig
    from agentx.engine.client import Engine
    from agentx.errors import AgentXError

    config = EngineConfig(
        model=args.model,
        quantization=args.quantization,
        cache=CacheConfig(kv_cache_bytes=int(args.kv_cache_gib * (1 << 30))),
    )
    try:
        engine = Engine(config)
    except AgentXError as exc:
        print(f"agentx chat: error: {exc}", file=sys.stderr)
        return 2
    try:
        anyio.run(_repl, engine, args, sys.stdin, sys.stdout)
    except KeyboardInterrupt:
        pass
    finally:
        engine.close()
    return 0


async def _repl(engine, args: argparse.Namespace, stdin: TextIO, out: TextIO) -> None:
    import anyio

    from agentx.engine.sampling import SamplingParams
    from agentx.session.events import TextDelta, TurnDone
    from agentx.session.session import Session

    sampling = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    interactive = stdin.isatty()
    session = Session(engine, system=args.system, sampling=sampling)
    try:
        while True:
            if interactive:
                out.write(PROMPT)
                out.flush()
            line = await anyio.to_thread.run_sync(stdin.readline)
            if not line or line.strip() in ("/exit", "/quit"):
                break
            text = line.strip()
            if not text:
                continue
            if text == "/reset":
                await session.close()
                session = Session(engine, system=args.system, sampling=sampling)
                continue
            async with session.stream(text) as turn:
                async for event in turn:
                    if isinstance(event, TextDelta):
                        out.write(event.text)
                        out.flush()
                    elif isinstance(event, TurnDone) and args.stats:
                        u = event.usage
                        out.write(
                            f"\n[prompt {u.prompt_tokens}, cached {u.cached_tokens},"
                            f" output {u.output_tokens}]"
                        )
            out.write("\n")
            out.flush()
    finally:
        await session.close()
