"""Hugging Face transformers peer: CPU, fp32, greedy, one request at a time.

    <hf venv>/bin/python benchmarks/peers/worker_hf.py --model HF_FOLDER --threads N
        [--max-cached-tokens T] [--prefill-chunk 2048] [--attn sdpa|eager] [--compile]

``--model`` is a Hugging Face folder (benchmarks/peers/export_hf.py writes one from the GGUF).
Each session keeps a ``DynamicCache`` and the token ids it holds. A prompt that extends them
(the agent loop: last prompt + last output + new turn) crops the cache to the common prefix and
runs only the rest; ``num_cached`` is that prefix. Caches of least recently used sessions are
dropped when all of them together hold more than ``--max-cached-tokens``.
"""

from __future__ import annotations

import os
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from _protocol import (
    Channel,
    Generate,
    SerialWorker,
    base_parser,
    common_prefix_size,
    log,
    set_thread_env,
)


@dataclass(slots=True)
class SessionCache:
    cache: object  # transformers DynamicCache
    token_ids: list[int] = field(default_factory=list)  # what ``cache`` holds, in order


class HfWorker(SerialWorker):
    def __init__(self, channel: Channel, model, max_cached_tokens: int, prefill_chunk: int) -> None:
        super().__init__(channel)
        self.model = model
        self.prefill_chunk = prefill_chunk
        self.max_cached_tokens = max_cached_tokens
        self.sessions: OrderedDict[str, SessionCache] = OrderedDict()

    def generate(self, op: Generate) -> None:
        import torch
        from transformers import DynamicCache

        entry = self.sessions.pop(op.session, None)
        if entry is None:
            entry = SessionCache(DynamicCache(config=self.model.config))
        # At least the last prompt token runs: its logits pick the first output token.
        num_cached = min(common_prefix_size(entry.token_ids, op.prompt), len(op.prompt) - 1)
        if num_cached < len(entry.token_ids):
            # transformers 5 crops by a negative count of tokens to drop (a positive value,
            # the old "keep this many" form, raises).
            entry.cache.crop(num_cached - len(entry.token_ids))
        entry.token_ids = list(op.prompt[:num_cached])
        self.sessions[op.session] = entry  # most recently used last
        output: list[int] = []
        step_ids = op.prompt[num_cached:]
        try:
            with torch.inference_mode():
                while True:
                    logits = self._forward(step_ids, entry)
                    token = int(logits.argmax())
                    output.append(token)
                    self.channel.tokens(op.id, 1)
                    if len(output) == op.max_tokens:
                        break
                    self.check_stopping()
                    step_ids = [token]
        except BaseException:
            del self.sessions[op.session]  # the cache may hold a half-run step
            raise
        self._evict(keep=op.session)
        self.channel.done(op.id, len(output), num_cached, output if op.return_ids else None)

    def _forward(self, ids: list[int], entry: SessionCache):
        """Run ``ids`` after what ``entry`` holds, in chunks of at most ``prefill_chunk`` tokens
        (bounds attention memory on long prompts); the logits of the last one."""
        import torch

        for start in range(0, len(ids), self.prefill_chunk):
            chunk = ids[start : start + self.prefill_chunk]
            input_ids = torch.tensor([chunk], dtype=torch.long)  # (1, T)
            out = self.model(
                input_ids=input_ids, past_key_values=entry.cache, use_cache=True, logits_to_keep=1
            )
            entry.token_ids.extend(chunk)
        return out.logits[0, -1]  # (V,)

    def end_session(self, session: str) -> None:
        self.sessions.pop(session, None)

    def _evict(self, keep: str) -> None:
        total = sum(len(e.token_ids) for e in self.sessions.values())
        while total > self.max_cached_tokens and len(self.sessions) > 1:
            oldest = next(iter(self.sessions))
            if oldest == keep:
                break
            total -= len(self.sessions.pop(oldest).token_ids)


def main() -> None:
    parser = base_parser(__doc__.split("\n\n")[0], omp_wait="passive")
    parser.add_argument("--max-cached-tokens", type=int, default=262_144)
    parser.add_argument("--prefill-chunk", type=int, default=2048)
    parser.add_argument("--attn", choices=["sdpa", "eager"], default="sdpa")
    parser.add_argument("--compile", action="store_true", help="torch.compile the forward")
    args = parser.parse_args()
    channel = Channel()
    set_thread_env(args)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    import transformers

    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        args.model, dtype=torch.float32, attn_implementation=args.attn
    ).eval()
    if args.compile:
        model.forward = torch.compile(model.forward, dynamic=True)
    worker = HfWorker(channel, model, args.max_cached_tokens, args.prefill_chunk)
    log(f"worker_hf: loaded {args.model} in {time.perf_counter() - started:.1f}s")
    channel.ready(
        "transformers",
        transformers.__version__,
        {
            "threads": args.threads,
            "omp_wait": args.omp_wait,
            "omp_spincount": args.omp_spincount,
            "dtype": "float32",
            "attn": args.attn,
            "compile": args.compile,
            "torch": torch.__version__,
            "max_cached_tokens": args.max_cached_tokens,
            "prefill_chunk": args.prefill_chunk,
            "model": args.model,
        },
    )
    worker.serve()
    sys.exit(0)


if __name__ == "__main__":
    main()
