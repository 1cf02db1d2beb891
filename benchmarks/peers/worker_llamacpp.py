"""llama.cpp peer (``llama-cpp-python``): the GGUF loaded directly, one request at a time.

    <llamacpp venv>/bin/python benchmarks/peers/worker_llamacpp.py --model GGUF --threads N
        [--slots 4] [--n-ctx 8192] [--n-batch 512] [--kv-type f16|f32] [--no-flash-attn]

KV reuse, "session slots": the worker keeps ``--slots`` llama.cpp contexts (``Llama`` objects;
the weights are mmapped, so the copies share one page cache) and pins each session to one. A turn
truncates its context to the longest common prefix with the new prompt and evaluates only the
rest, which is what llama-cpp-python itself does within one context; ``num_cached`` is that
prefix. A session without a slot takes a free one (a slot whose session ended, longest common
prefix first: a shared system prompt or a parent's context is reused) or the least recently used.
``--slots 1`` is plain llama-cpp-python prefix reuse of a single context. State save/load
(``LlamaRAMCache``, ``save_state``) was not used: it copies the whole KV out and back on every
session switch, where a slot switch copies nothing (README.md has the numbers).
"""

from __future__ import annotations

import argparse
import sys
import time
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
class Slot:
    llm: object  # llama_cpp.Llama
    session: str | None = None  # None: free; its tokens may still serve as a prefix
    token_ids: list[int] = field(default_factory=list)  # what the context's KV holds
    last_used: float = 0.0


class LlamaCppWorker(SerialWorker):
    def __init__(self, channel: Channel, slots: list[Slot], n_ctx: int) -> None:
        super().__init__(channel)
        self.slots = slots
        self.n_ctx = n_ctx

    def generate(self, op: Generate) -> None:
        import numpy as np

        if len(op.prompt) + op.max_tokens > self.n_ctx:
            raise ValueError(f"prompt + max_tokens exceeds n_ctx {self.n_ctx}")
        slot = self._slot_for(op.session, op.prompt)
        llm = slot.llm
        num_cached = min(common_prefix_size(slot.token_ids, op.prompt), len(op.prompt) - 1)
        # eval() drops the KV past n_tokens before it decodes (llama_memory_seq_rm).
        llm.n_tokens = num_cached
        slot.token_ids = list(op.prompt[:num_cached])
        n_vocab = llm.n_vocab()
        output: list[int] = []
        step_ids = op.prompt[num_cached:]
        try:
            while True:
                llm.eval(step_ids)
                slot.token_ids.extend(step_ids)
                logits = np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(n_vocab,))
                token = int(logits.argmax())
                output.append(token)
                self.channel.tokens(op.id, 1)
                if len(output) == op.max_tokens:
                    break
                self.check_stopping()
                step_ids = [token]
        except BaseException:
            slot.token_ids, llm.n_tokens = [], 0  # the context may hold a half-run batch
            raise
        slot.last_used = time.monotonic()
        self.channel.done(op.id, len(output), num_cached, output if op.return_ids else None)

    def _slot_for(self, session: str, prompt: list[int]) -> Slot:
        for slot in self.slots:
            if slot.session == session:
                return slot
        free = [s for s in self.slots if s.session is None]
        if free:
            slot = max(free, key=lambda s: (common_prefix_size(s.token_ids, prompt), -s.last_used))
        else:
            slot = min(self.slots, key=lambda s: s.last_used)
        slot.session = session
        return slot

    def end_session(self, session: str) -> None:
        for slot in self.slots:
            if slot.session == session:
                slot.session = None  # the KV stays: a later session may share its prefix


def load_slots(args) -> list[Slot]:
    import llama_cpp

    kv_type = {"f16": llama_cpp.GGML_TYPE_F16, "f32": llama_cpp.GGML_TYPE_F32}[args.kv_type]
    return [
        Slot(
            llama_cpp.Llama(
                model_path=args.model,
                n_ctx=args.n_ctx,
                n_batch=args.n_batch,
                n_ubatch=args.n_batch,
                n_threads=args.threads,
                n_threads_batch=args.threads,
                type_k=kv_type,
                type_v=kv_type,
                flash_attn=args.flash_attn,
                logits_all=False,
                use_mmap=True,
                verbose=args.verbose,
            )
        )
        for _ in range(args.slots)
    ]


def main() -> None:
    parser = base_parser(__doc__.split("\n\n")[0], omp_wait="spin")
    parser.add_argument("--slots", type=int, default=4, help="contexts, one session each")
    parser.add_argument("--n-ctx", type=int, default=8192)
    parser.add_argument("--n-batch", type=int, default=512)
    parser.add_argument("--kv-type", choices=["f16", "f32"], default="f16")
    parser.add_argument("--flash-attn", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--verbose", action="store_true", help="llama.cpp logs to stderr")
    args = parser.parse_args()
    channel = Channel()
    set_thread_env(args)
    import llama_cpp

    started = time.perf_counter()
    slots = load_slots(args)
    log(f"worker_llamacpp: {args.slots} slot(s) loaded in {time.perf_counter() - started:.1f}s")
    channel.ready(
        "llama.cpp",
        llama_cpp.__version__,
        {
            "threads": args.threads,
            "omp_wait": args.omp_wait,
            "omp_spincount": args.omp_spincount,
            "slots": args.slots,
            "n_ctx": args.n_ctx,
            "n_batch": args.n_batch,
            "kv_type": args.kv_type,
            "flash_attn": args.flash_attn,
            "kv_reuse": "session slots + longest-prefix truncation",
            "system_info": llama_cpp.llama_print_system_info().decode(),
            "model": args.model,
        },
    )
    LlamaCppWorker(channel, slots, args.n_ctx).serve()
    sys.exit(0)


if __name__ == "__main__":
    main()
