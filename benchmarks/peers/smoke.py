"""Smoke test of the peer workers (stdlib only): multi-turn sessions that share prefixes.

    python benchmarks/peers/smoke.py --peers hf,llamacpp,vllm [--threads 2] [--max-tokens 32]
        [--context 512] [--<peer>-args "..."]

For each peer: launch ``worker_<peer>.py`` with the peer's venv python (made by setup_<peer>.sh),
send two sessions' turns (turn 1 of both at once, then turn 2 of both at once, then turn 3 of
one), each later turn = previous prompt + that turn's output + a new user message, and print per
request the TTFT, decode tokens/s and num_cached. With several peers it then compares greedy
token ids request by request (a later turn is comparable only if the earlier ones agreed, since
its prompt carries the earlier output). Worker stderr goes to ``<log-dir>/smoke_<peer>.log``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
PEERS_DIR = Path(os.environ.get("AGENTX_PEERS_DIR", Path.home() / ".cache/agentx/peers"))
HF_FOLDER = PEERS_DIR / "models" / "SmolLM2-135M-Instruct.Q4_1-hf"
F32_GGUF = PEERS_DIR / "models" / "SmolLM2-135M-Instruct.f32.gguf"

# SmolLM2 chat-format ids (from agentx's GGUF tokenizer): a system turn and three user turns,
# each user turn ending with the assistant header.
SYSTEM = [
    1,
    9690,
    198,
    2683,
    359,
    253,
    5649,
    8598,
    11173,
    30,
    1206,
    2988,
    13099,
    284,
    346,
    13383,
    260,
    4577,
    346,
    1012,
    30,
    2,
    198,
]
USER = [
    [1, 4093, 198, 6106, 260, 1296, 3995, 9244, 282, 260, 3693, 817, 30, 2, 198, 1, 520, 9531, 198],
    [
        1,
        4093,
        198,
        2696,
        2965,
        253,
        5905,
        1517,
        338,
        11695,
        253,
        1398,
        282,
        23313,
        30,
        2,
        198,
        1,
        520,
        9531,
        198,
    ],
    [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198],
]
END_OF_TURN = [2, 198]  # <|im_end|>\n after the assistant's output


@dataclass
class Result:
    id: str
    num_prompt: int
    sent: float
    first: float | None = None
    end: float | None = None
    num_output: int = 0
    num_cached: int | None = None
    token_ids: list[int] | None = None
    error: str | None = None
    finished: threading.Event = field(default_factory=threading.Event)


class Worker:
    """One worker subprocess and a thread that reads its events."""

    def __init__(self, argv: list[str], log_file: Path, ready_timeout: float) -> None:
        self.log_file = log_file
        self._log = open(log_file, "w")
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            cwd=HERE.parent.parent,
        )
        self.results: dict[str, Result] = {}
        self.ready: dict | None = None
        self.stray: list[str] = []
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(ready_timeout) or self.ready is None:
            self.close()
            raise RuntimeError(f"worker not ready; see {log_file}:\n{self.tail()}")

    def _read(self) -> None:
        for line in self.proc.stdout:
            now = time.perf_counter()
            try:
                ev = json.loads(line)
            except json.JSONDecodeError:
                self.stray.append(line.rstrip())  # a library print leaked to stdout
                continue
            kind, result = ev.get("ev"), self.results.get(ev.get("id"))
            if kind == "ready":
                self.ready = ev
                self._ready.set()
            elif kind == "tokens" and result:
                result.first = result.first or now
                result.num_output += ev["n"]
            elif kind == "done" and result:
                result.end, result.num_cached = now, ev["num_cached"]
                result.token_ids = ev.get("token_ids")
                if ev["num_output"] != result.num_output:
                    result.error = f"done says {ev['num_output']}, streamed {result.num_output}"
                result.finished.set()
            elif kind == "error":
                target = result or Result(str(ev.get("id")), 0, now)
                target.error = ev["message"]
                target.finished.set()
                if not result:
                    print(f"  worker error: {ev['message']}")
        self._ready.set()  # EOF: unblock a waiter

    def send(self, obj: dict) -> None:
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def generate(self, request_id: str, session: str, prompt: list[int], max_tokens: int) -> Result:
        result = Result(request_id, len(prompt), time.perf_counter())
        self.results[request_id] = result
        self.send(
            {
                "op": "generate",
                "id": request_id,
                "session": session,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "return_ids": True,
            }
        )
        return result

    def close(self) -> int:
        try:
            self.send({"op": "shutdown"})
            self.proc.stdin.close()
            return self.proc.wait(60)
        except (BrokenPipeError, subprocess.TimeoutExpired, ValueError):
            self.proc.kill()
            return self.proc.wait()
        finally:
            self._log.close()

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-n:])


def default_model(peer: str) -> str:
    if peer == "llamacpp":
        return str(F32_GGUF)
    return str(HF_FOLDER)


def run_peer(peer: str, args: argparse.Namespace) -> dict[str, Result]:
    python = PEERS_DIR / peer / "bin" / "python"
    model = getattr(args, f"{peer}_model") or default_model(peer)
    argv = [
        str(python),
        str(HERE / f"worker_{peer}.py"),
        "--model",
        model,
        "--threads",
        str(args.threads),
        *shlex.split(getattr(args, f"{peer}_args") or ""),
    ]
    log_file = Path(args.log_dir) / f"smoke_{peer}.log"
    print(f"== {peer}: {shlex.join(argv)}")
    started = time.perf_counter()
    worker = Worker(argv, log_file, args.ready_timeout)
    print(
        f"  ready in {time.perf_counter() - started:.1f}s: {worker.ready['engine']} "
        f"{worker.ready['version']} {json.dumps(worker.ready['config'])}"
    )
    context = (SYSTEM[1:-2] * (args.context // 20 + 1))[: args.context]
    system = SYSTEM[:1] + context + SYSTEM[-2:]
    prompts = {"a": system + USER[0], "b": system + USER[2]}
    plan = [[("a", 1), ("b", 1)], [("a", 2), ("b", 2)], [("a", 3)]]
    results: dict[str, Result] = {}
    try:
        for wave in plan:
            sent = []
            for session, turn in wave:
                sent.append(
                    worker.generate(f"{session}{turn}", session, prompts[session], args.max_tokens)
                )
            for result in sent:
                if not result.finished.wait(args.request_timeout):
                    result.error = "timed out"
                results[result.id] = result
                session = result.id[0]
                next_user = USER[int(result.id[1:]) % len(USER)]
                prompts[session] = (
                    prompts[session] + (result.token_ids or []) + END_OF_TURN + next_user
                )
        worker.send({"op": "end_session", "session": "a"})
        worker.send({"op": "end_session", "session": "b"})
    finally:
        code = worker.close()
    for result in results.values():
        print("  " + describe(result))
    saved = {r.id: r.token_ids for r in results.values()}
    (Path(args.log_dir) / f"smoke_{peer}.json").write_text(json.dumps(saved))
    if worker.stray:
        print(f"  !! {len(worker.stray)} non-JSON stdout lines, first: {worker.stray[0][:120]}")
    if code != 0:
        print(f"  !! worker exit code {code}; log tail:\n{worker.tail()}")
    return results


def describe(r: Result) -> str:
    if r.error:
        return f"{r.id}: ERROR {r.error}"
    ttft = (r.first - r.sent) * 1e3
    decode = (r.num_output - 1) / (r.end - r.first) if r.num_output > 1 and r.end > r.first else 0
    return (
        f"{r.id}: prompt {r.num_prompt:5d}  cached {str(r.num_cached):>5}  out {r.num_output:3d}"
        f"  ttft {ttft:8.1f} ms  decode {decode:7.1f} tok/s  e2e {r.end - r.sent:6.2f} s"
    )


def load_saved(path: Path) -> dict[str, Result]:
    """Token ids a previous run saved (``smoke_<peer>.json``), as results to compare."""
    saved = json.loads(path.read_text())
    return {rid: Result(rid, 0, 0.0, token_ids=ids) for rid, ids in saved.items()}


def compare(all_results: dict[str, dict[str, Result]]) -> None:
    peers = list(all_results)
    print(f"== greedy agreement (leading equal tokens vs {peers[0]})")
    base = all_results[peers[0]]
    for request_id in sorted(base):
        ref = base[request_id].token_ids or []
        cells = []
        for peer in peers[1:]:
            other = all_results[peer].get(request_id)
            ids = other.token_ids if other and other.token_ids else []
            same = next(
                (i for i, (x, y) in enumerate(zip(ref, ids, strict=False)) if x != y),
                min(len(ref), len(ids)),
            )
            cells.append(f"{peer} {same}/{len(ref)}")
        print(f"  {request_id}: " + "  ".join(cells))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", default="hf")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--context", type=int, default=512, help="filler tokens in the system turn")
    parser.add_argument("--ready-timeout", type=float, default=900)
    parser.add_argument("--request-timeout", type=float, default=600)
    parser.add_argument("--log-dir", default="/tmp")
    parser.add_argument("--compare-saved", default="", help="peers whose saved ids to compare")
    for peer in ("hf", "vllm", "llamacpp"):
        parser.add_argument(f"--{peer}-model", default=None)
        parser.add_argument(f"--{peer}-args", default="", help=f"extra worker_{peer}.py flags")
    args = parser.parse_args()
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    all_results, failed = {}, False
    for peer in [p for p in args.peers.split(",") if p]:
        try:
            all_results[peer] = run_peer(peer, args)
            failed |= any(r.error for r in all_results[peer].values())
        except Exception as exc:
            print(f"  !! {peer} failed: {exc}")
            failed = True
    for peer in args.compare_saved.split(",") if args.compare_saved else []:
        all_results.setdefault(peer, load_saved(Path(args.log_dir) / f"smoke_{peer}.json"))
    if len(all_results) > 1:
        compare(all_results)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
