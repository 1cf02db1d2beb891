"""The ``agentx`` console script: ``agentx bench ...``, ``agentx serve ...`` and
``agentx models {list,pull}``.

Each command's module is imported only when it runs, so ``agentx bench`` needs no server
packages and ``agentx serve`` (the ``serve`` extra) loads no benchmark code.
"""

from __future__ import annotations

import sys

USAGE = (
    "usage: agentx {bench,serve,models} ...  "
    "(agentx bench --help, agentx serve --help, agentx models --help)"
)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command, rest = (argv[0], argv[1:]) if argv else ("", [])
    if command == "bench":
        from agentx.bench.cli import bench_main

        return bench_main(rest)
    if command == "serve":
        from agentx.openai.server import serve_main

        return serve_main(rest)
    if command == "models":
        from agentx.model_store import models_main

        return models_main(rest)
    print(USAGE, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
