"""Start-up: ``import agentx`` loads only what every program needs; the grammar mask helper that
replaced ``llguidance.torch`` (which pulls in ``torch._dynamo`` and compiles) is exact; the CPU KV
pool costs nothing until written; the engine's warm-up and background preparation finish and
leave no trace in the KV pool, the runner or the stats."""

import json
import mmap
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from agentx import CacheConfig, SamplingParams
from agentx.engine.models.chat_template import compile_chat_template
from agentx.engine.runner.kv_layout import allocate_zeroed
from agentx.engine.structured import apply_bitmask
from agentx.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]

# Libraries only some paths use: structured output, the safetensors / Hugging Face reference,
# the Mooncake tier, benchmark plots, chat templates, GGUF metadata, torch.compile.
LAZY_MODULES = (
    "llguidance",
    "transformers",
    "mooncake",
    "matplotlib",
    "jinja2",
    "gguf",
    "tokenizers",
    "safetensors",
    "torch._dynamo",
    "agentx.bench",
)


def test_import_agentx_leaves_optional_libraries_unloaded():
    code = (
        "import json, sys\n"
        "import agentx\n"
        f"print(json.dumps([m for m in {list(LAZY_MODULES)!r} if m in sys.modules]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        cwd=ROOT,  # imports this checkout's agentx
    )
    assert json.loads(proc.stdout.splitlines()[-1]) == []


def _reference_mask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Token t allowed iff bit t % 32 of word t // 32 is set; tokens past 32 * W never are."""
    out = logits.clone()
    num_words = bitmask.shape[1]
    for row in range(logits.shape[0]):
        for token in range(logits.shape[1]):
            word, bit = divmod(token, 32)
            allowed = word < num_words and (int(bitmask[row, word]) >> bit) & 1
            if not allowed:
                out[row, token] = float("-inf")
    return out


@pytest.mark.parametrize(
    "num_rows, vocab_size, num_words", [(1, 1, 1), (2, 15, 1), (3, 63, 2), (1, 300, 10), (2, 70, 2)]
)
def test_apply_bitmask_matches_the_bit_layout(num_rows, vocab_size, num_words):
    gen = torch.Generator().manual_seed(vocab_size)
    logits = torch.randn(num_rows, vocab_size, generator=gen)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (num_rows, num_words), generator=gen)
    bitmask = bitmask.to(torch.int32)
    bitmask[0, 0] = -1  # every bit of a word set, sign bit included
    expected = _reference_mask(logits, bitmask)
    apply_bitmask(logits, bitmask)
    assert torch.equal(logits, expected)


def test_apply_bitmask_all_allowed_and_none_allowed():
    logits = torch.arange(64, dtype=torch.float32).view(1, 64)
    apply_bitmask(logits, torch.full((1, 2), -1, dtype=torch.int32))
    assert torch.equal(logits, torch.arange(64, dtype=torch.float32).view(1, 64))
    apply_bitmask(logits, torch.zeros((1, 2), dtype=torch.int32))
    assert torch.isneginf(logits).all()


def _resident_bytes() -> int:
    with open("/proc/self/statm") as file:
        return int(file.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
def test_cpu_kv_slots_read_zero_and_are_backed_only_when_written():
    before = _resident_bytes()
    slot = allocate_zeroed(1024, 1 << 20, torch.device("cpu"))  # 1 GiB
    assert slot.shape == (1024, 1 << 20) and slot.dtype == torch.uint8
    assert _resident_bytes() - before < 64 << 20  # not written, so not resident
    slot[3, :5] = 7
    assert slot[3, :6].tolist() == [7, 7, 7, 7, 7, 0]
    assert int(slot[1000].sum()) == 0 and int(slot[3].sum()) == 35
    other = allocate_zeroed(2, 8, torch.device("cpu"))
    assert other.tolist() == [[0] * 8, [0] * 8]  # a fresh map, not the slot's memory


def _advised_huge(tensor: torch.Tensor) -> bool:
    """Whether the mapping holding ``tensor``'s first byte was madvised MADV_HUGEPAGE (its
    VmFlags in /proc/self/smaps carry "hg")."""
    address, inside = tensor.data_ptr(), False
    with open("/proc/self/smaps") as file:
        for line in file:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(x, 16) for x in head.split("-"))
                inside = low <= address < high
            elif inside and head == "VmFlags:":
                return "hg" in line.split()[1:]
    raise AssertionError("no mapping holds the tensor")


_THP = "/sys/kernel/mm/transparent_hugepage"


@pytest.mark.skipif(
    not os.path.exists(_THP), reason="this kernel has no transparent huge pages to ask for"
)
def test_cpu_kv_slots_ask_for_huge_pages_when_told_to(make_engine):
    cpu = torch.device("cpu")
    huge = allocate_zeroed(8, 1 << 20, cpu, huge_pages=True)
    plain = allocate_zeroed(8, 1 << 20, cpu, huge_pages=False)
    assert _advised_huge(huge) and not _advised_huge(plain)
    huge[7, -1] = 9  # still zeroed, still written in place
    assert int(huge.sum()) == 9 and int(plain.sum()) == 0
    # the engine's pool: huge pages with CacheConfig(huge_pages=True), 4 KiB ones without
    for flag in (True, False):
        engine = make_engine(cache=CacheConfig(num_blocks=64, huge_pages=flag))
        slots = engine.core.runner.kv_slots
        assert slots and all(_advised_huge(slot) == flag for slot in slots)
        engine.check_integrity()


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux /proc")
def test_huge_pages_are_opt_in_and_a_refusal_is_said(monkeypatch):
    assert CacheConfig().huge_pages is False
    with pytest.raises(ConfigError, match="huge_pages must be True or False"):
        CacheConfig(huge_pages="yes")
    # a kernel that refuses the advice (EINVAL, as one built without THP does): the pool still
    # comes back zeroed and writable, on 4 KiB pages, and the refusal is a warning, not silence
    monkeypatch.setattr(mmap, "MADV_HUGEPAGE", 0x7FFF)  # no such advice: EINVAL
    with pytest.warns(RuntimeWarning, match="refused MADV_HUGEPAGE"):
        slot = allocate_zeroed(4, 1 << 20, torch.device("cpu"), huge_pages=True)
    assert not _advised_huge(slot) and int(slot.sum()) == 0
    slot[3, -1] = 5
    assert int(slot.sum()) == 5


@pytest.mark.slow
def test_engine_start_up_work_leaves_no_trace(make_engine):
    """Warm-up forward and background preparation finish, and the KV pool, the runner's input
    batch and the stats look exactly as if nothing had run."""
    engine = make_engine()
    assert engine.wait_ready(timeout=300)
    runner = engine.core.runner
    for slot in runner.kv_slots:
        assert int(slot[0].count_nonzero()) == 0  # the null block the warm-up wrote is zeroed
    assert runner.input_batch.row_of == {}
    assert len(runner.input_batch.free_rows) == engine.config.scheduler.max_num_seqs
    stats = engine.stats()
    assert (stats.num_steps, stats.num_computed_tokens, stats.prefix_cache_queries) == (0, 0, 0)
    assert stats.kv_num_used_blocks == 0 and stats.kv_num_cached_blocks == 0
    assert engine.core.kv.pool.num_free_blocks == stats.kv_num_blocks
    engine.check_integrity()
    assert engine.core._grammar is not None  # built at start, not by the first request
    template = engine.tokenizer.chat_template
    assert compile_chat_template.cache_info().currsize >= 1
    hits = compile_chat_template.cache_info().hits
    engine.tokenizer.get_compiled_chat_template()
    assert compile_chat_template.cache_info().hits == hits + 1 and template is not None


@pytest.mark.slow
def test_warmed_up_engine_generates_what_a_fresh_runner_does(make_engine, greedy_prompts):
    """Greedy output right after start equals output after another request ran: the warm-up
    left nothing behind that a request could read."""
    engine = make_engine()
    sampling = SamplingParams(max_tokens=8)

    def run(salt: str) -> list[list[int]]:  # a new salt: no prefix hit, everything recomputed
        streams = [engine.add_request(p, sampling, cache_salt=salt) for p in greedy_prompts[:2]]
        return [stream.result(timeout=300).token_ids for stream in streams]

    first = run("first")
    engine.generate([greedy_prompts[3]], sampling)
    assert run("again") == first
    assert engine.stats().num_cached_tokens == 0
