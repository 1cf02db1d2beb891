"""Start-up as a new user meets it: ``import agentx``, ``Engine()``, ready, first turn, memory.

Each measurement runs in a fresh Python process. With a new ``AGENTX_CACHE_DIR`` the first
process reads the GGUF file (and writes the engine's cached checkpoint); the next ones start from
the cache, as every later run on a machine does. The compiled CPU kernels are built at install
(``make``), so the new cache shares the real one's ``kernels/`` (built first if missing), and
its ``models/`` (a pulled model such as ``qwen2.5-coder-1.5b``: the download and assembly are
not start-up). Prints one Markdown row per process.

    python benchmarks/startup_bench.py [--runs 3] [--quantization none|auto] [--model NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from agentx import env as agentx_env

_CHILD = r"""
import json, resource, sys, time
t0 = time.perf_counter()
import agentx
t1 = time.perf_counter()
from agentx import CacheConfig, Engine, EngineConfig, SamplingParams
model = {"model": sys.argv[2]} if sys.argv[2] else {}
engine = Engine(EngineConfig(quantization=sys.argv[1], **model))
t2 = time.perf_counter()
engine.wait_ready()
t3 = time.perf_counter()
tok = engine.tokenizer
prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Say hi."}]))
engine.generate([prompt], SamplingParams(max_tokens=1))
t4 = time.perf_counter()
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"import_s": t1 - t0, "engine_s": t2 - t1, "ready_s": t3 - t1,
                  "first_turn_s": t4 - t3, "max_rss_mib": rss}))
engine.close()
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--quantization", default="none")
    parser.add_argument("--model", default="", help="EngineConfig.model (default: embedded)")
    args = parser.parse_args()
    cache = Path(tempfile.mkdtemp(prefix="agentx-startup-"))
    shared_kernels = agentx_env.cache_dir() / "kernels"
    shared_kernels.mkdir(parents=True, exist_ok=True)
    (cache / "kernels").symlink_to(shared_kernels, target_is_directory=True)
    shared_models = agentx_env.cache_dir() / "models"
    if shared_models.is_dir():
        (cache / "models").symlink_to(shared_models, target_is_directory=True)
    env = dict(os.environ, AGENTX_CACHE_DIR=str(cache))
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    subprocess.run([sys.executable, "-m", "agentx.kernels.cpu"], env=env, check=True)
    print(
        f"model={args.model or 'embedded'}, quantization={args.quantization}, "
        f"cache {env['AGENTX_CACHE_DIR']}"
    )
    print("| process | import agentx s | Engine() s | ready s | first turn (chat, 1 token) s "
          "| max RSS MiB |\n|---|---|---|---|---|---|")  # fmt: skip
    for run in range(args.runs):
        out = subprocess.run(
            [sys.executable, "-c", _CHILD, args.quantization, args.model],
            env=env, check=True, capture_output=True, text=True,
        )  # fmt: skip
        r = json.loads(out.stdout.strip().splitlines()[-1])
        label = "first (reads the GGUF)" if run == 0 else f"later ({run})"
        print(f"| {label} | {r['import_s']:.2f} | {r['engine_s']:.2f} | {r['ready_s']:.2f} "
              f"| {r['first_turn_s']:.2f} | {r['max_rss_mib']:.0f} |")  # fmt: skip


if __name__ == "__main__":
    main()
