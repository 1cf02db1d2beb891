"""The fake engine behind the worker protocol, for testing drivers without a model::

python -m agentx.bench.fake_worker --model ANY --threads N [--decode-s 0.001]
"""

from __future__ import annotations

import argparse
import asyncio

from agentx.bench.fake_adapter import FakeAdapter
from agentx.bench.worker import protocol_stdout, serve


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m agentx.bench.fake_worker")
    p.add_argument("--model", default="")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--decode-s", type=float, default=0.001, help="seconds per output token")
    args = p.parse_args(argv)
    out = protocol_stdout()
    asyncio.run(serve(FakeAdapter(decode_s_per_token=args.decode_s), out))


if __name__ == "__main__":
    main()
