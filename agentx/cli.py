"""The ``agentx`` console script (also ``python -m agentx``): serve, chat, bench, models.

Each command's module is imported only when it runs, so ``agentx bench`` needs no server
packages and ``agentx serve`` (the ``serve`` extra) loads no benchmark code.
"""

from __future__ import annotations

import sys

USAGE = """usage: agentx [--help] [--version] {serve,chat,bench,models} ...

  serve   the OpenAI API over HTTP (chat, completions, responses)   agentx serve --help
  chat    chat with the model in the terminal, on one warm session  agentx chat --help
  bench   agent-trace benchmarks                                    agentx bench --help
  models  list / pull the models agentx knows by name               agentx models --help
"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command, rest = (argv[0], argv[1:]) if argv else ("", [])
    if command in ("-h", "--help", "help"):
        print(USAGE, end="")
        return 0
    if command in ("-V", "--version"):
        print(f"agentx {_version()}")
        return 0
    if command == "bench":
        from agentx.bench.cli import bench_main

        return bench_main(rest)
    if command == "serve":
        from agentx.openai.serve_command import serve_main

        return serve_main(rest)
    if command == "chat":
        from agentx.chat_command import chat_main

        return chat_main(rest)
    if command == "models":
        from agentx.model_store import models_main

        return models_main(rest)
    print(USAGE, end="", file=sys.stderr)
    return 2


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("agentx")
    except PackageNotFoundError:
        from agentx import __version__

        return __version__


if __name__ == "__main__":
    sys.exit(main())
