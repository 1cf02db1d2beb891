"""Drafting from context (engine/draft.py) and its verification: the n-gram index, adaptive k,
rollback of rejected drafts with exact block ids and ref counts (fake runner, no model), and
greedy / seeded output identical with drafting on and off on the real model, in both weight
modes, under batching, chunking, preemption, forks and stop strings."""

import json

import pytest
import torch

from agentx import (
    CacheConfig,
    EngineConfig,
    SamplingParams,
    SchedulerConfig,
    SpeculativeConfig,
)
from agentx.engine.core import EngineCore
from agentx.engine.draft import Drafter, DraftSource, TokenIndex
from agentx.engine.outputs import ModelRunnerOutput
from agentx.engine.request import RequestOptions
from agentx.engine.scheduler import Scheduler
from agentx.engine.structured import StructuredOutput, apply_bitmask, compact_json
from tests.helpers.kv import make_manager, make_request

# ---- the index and the drafter --------------------------------------------------------------


def test_index_finds_latest_occurrence_with_a_continuation():
    tokens = [1, 2, 3, 4, 9, 1, 2, 3, 4, 7, 1, 2, 3, 4]
    drafter = Drafter(max_k=3)
    # the latest earlier "1 2 3 4" continues with 7 (not 9); the final one has no continuation
    assert drafter.propose(tokens, 8) == [7, 1, 2]
    tokens += [7]
    assert drafter.propose(tokens, 8) == [1, 2, 3]  # "3 4 7" was seen: it continues "1 2 3"


def test_bulk_and_incremental_indexing_agree():
    tokens = [(i * 7) % 50 for i in range(300)]
    bulk = TokenIndex(tokens)
    bulk.update()  # one vectorized pass
    step = TokenIndex([])
    for t in tokens:
        step.token_ids.append(t)
        step.update()  # one token at a time
    assert bulk.maps == step.maps
    assert bulk.num_indexed == step.num_indexed == 299


def test_nothing_matches_drafts_nothing():
    drafter = Drafter(max_k=8)
    assert drafter.propose(list(range(40)), 8) == []
    assert drafter.propose([5], 8) == []
    assert drafter.propose([1, 2, 1, 2], 0) == []


def test_source_match_wins_when_longer_than_own():
    source = DraftSource(max_entries=2)
    source.add([10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21])
    source.add([30, 31])  # newer, matches nothing
    drafter = Drafter(max_k=4, sources=[source])
    # own tokens hold "13 14" only as a 2-gram followed by 99; the source has "12 13 14 15"
    tokens = [13, 14, 99, 5, 11, 12, 13, 14]
    assert drafter.propose(tokens, 8) == [15, 16, 17, 18]
    assert len(source) == 2
    source.add([1, 2, 3])  # the oldest falls out
    assert len(source) == 2


def test_k_adapts_to_acceptance_and_backs_off_on_misses():
    drafter = Drafter(max_k=8)
    drafter.k = 2
    drafter.observe(2, 2)
    assert drafter.k == 4  # all accepted: doubled
    drafter.observe(4, 1)
    assert drafter.k == 2  # one past what was accepted
    drafter.observe(2, 0)
    assert drafter.k == 1
    tokens = [1, 2, 3, 1, 2, 3, 1, 2]
    assert drafter.propose(tokens, 8) == []  # cooling down one step after a whole miss
    assert drafter.propose(tokens, 8) == [3]
    drafter.observe(1, 0)  # a second miss in a row: two steps
    assert [drafter.propose(tokens, 8) for _ in range(3)] == [[], [], [3]]
    assert (drafter.num_draft_tokens, drafter.num_accepted_tokens) == (9, 3)


def test_k_starts_at_start_k_and_doubles_while_every_draft_is_kept():
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 1, 2]
    drafter = Drafter(max_k=8, start_k=2)
    assert drafter.propose(tokens, 8) == [3, 4]
    drafter.observe(2, 2)
    assert drafter.propose(tokens, 8) == [3, 4, 5, 6]
    drafter.observe(4, 4)
    assert drafter.propose(tokens, 8) == [3, 4, 5, 6, 7, 8, 9, 10]
    drafter.observe(8, 8)
    assert drafter.k == 8  # never past max_k
    assert Drafter(max_k=4, start_k=6).k == 4 and Drafter(max_k=4).k == 4


def test_an_engine_request_starts_at_the_configured_first_draft_tokens(default_engine):
    core = default_engine.core
    assert core.config.speculative.num_first_draft_tokens == 2
    drafter = core._drafting(RequestOptions())["drafter"]
    assert (drafter.k, drafter.max_k) == (2, core.config.speculative.num_speculative_tokens)


# ---- verification and rollback in the scheduler (fake runner) ------------------------------


def make_scheduler(num_blocks=16, **cfg):
    return Scheduler(SchedulerConfig(**cfg), make_manager(num_blocks), max_model_len=256)


def run_step(s, sampled):
    """One step; ``sampled`` maps request id -> every token the runner kept."""
    out = s.schedule()
    runner_out = ModelRunnerOutput(
        {rid: t[0] for rid, t in sampled.items()},
        {rid: t[1:] for rid, t in sampled.items() if len(t) > 1},
    )
    deltas = s.update_from_output(out, runner_out)
    s.check_integrity()
    return out, deltas


def test_rejected_drafts_give_back_their_slots_and_blocks():
    s = make_scheduler()
    # block size 4: the prompt repeats "5 6 7 8", so the request drafts what followed "7 8"
    req = make_request("a", [5, 6, 7, 8, 1, 2, 3, 5, 6, 7, 8], max_tokens=20)
    s.add_request(req)
    out, _ = run_step(s, {"a": [1]})  # the prefill samples "1"
    req.drafter = Drafter(max_k=4)  # from its first decode on
    assert s.kv.get_block_ids("a") == ([1, 2, 3],)
    assert req.num_computed_tokens == 11 and req.num_tokens == 12
    # it drafts "2 3 5 6", what followed "6 7 8 1" (k=4: 11 + 1 + 4 = 16 slots, blocks 1-4)
    out, deltas = s.schedule(), None
    [item] = out.scheduled
    assert item.token_ids == [1, 2, 3, 5, 6] and item.num_draft_tokens == 4
    assert s.kv.get_block_ids("a") == ([1, 2, 3, 4],)
    assert req.num_computed_tokens == 16  # optimistic, until verified
    # the runner keeps "2" (matches d0), then samples 9 where d1 was "3": one draft accepted
    deltas = s.update_from_output(out, ModelRunnerOutput({"a": 2}, {"a": [9]}))
    s.check_integrity()
    assert deltas[0].new_token_ids == [2, 9]
    assert req.all_token_ids[11:] == [1, 2, 9]
    assert req.num_computed_tokens == 13 and req.num_tokens == 14
    # 13 computed tokens need blocks 1-4 still: nothing to trim yet
    assert s.kv.get_block_ids("a") == ([1, 2, 3, 4],)
    assert (deltas[0].num_draft_tokens, deltas[0].num_accepted_tokens) == (4, 1)
    assert (s.num_draft_tokens, s.num_accepted_tokens) == (4, 1)
    assert req.drafter.k == 2


def test_rollback_trims_blocks_and_tells_the_runner():
    s = make_scheduler()
    req = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3], max_tokens=20)
    s.add_request(req)
    run_step(s, {"a": [4]})  # 12 computed, blocks 1-3 full; tokens "... 1 2 3 4"
    req.drafter = Drafter(max_k=8)  # from its first decode on
    assert s.kv.get_block_ids("a") == ([1, 2, 3],)
    pool = s.kv.pool
    assert [pool.blocks[i].block_hash is not None for i in (1, 2, 3)] == [True, True, True]
    out = s.schedule()
    [item] = out.scheduled
    # k=8 drafts, what followed "1 2 3 4": 12 + 1 + 8 = 21 slots, blocks 4-6 new
    assert item.token_ids[1:] == [5, 6, 7, 8, 9, 1, 2, 3]
    assert s.kv.get_block_ids("a") == ([1, 2, 3, 4, 5, 6],)
    # every draft rejected: 13 computed tokens need 4 blocks, blocks 6 and 5 go back
    free_before = pool.num_free_blocks
    s.update_from_output(out, ModelRunnerOutput({"a": 42}))
    s.check_integrity()
    assert req.num_computed_tokens == 13 and req.all_token_ids[-2:] == [4, 42]
    assert s.kv.get_block_ids("a") == ([1, 2, 3, 4],)
    assert pool.num_free_blocks == free_before + 2
    for i in (5, 6):
        assert pool.blocks[i].ref_cnt == 0 and pool.blocks[i].block_hash is None
    assert pool.blocks[4].ref_cnt == 1 and pool.blocks[4].block_hash is None
    # the cooling request decodes plainly next; the runner hears its table is 4 blocks now
    out = s.schedule()
    [item] = out.scheduled
    assert item.num_draft_tokens == 0 and item.num_kept_blocks == 4
    assert item.token_ids == [42] and item.new_block_ids == ([],)
    s.update_from_output(out, ModelRunnerOutput({"a": 43}))
    s.check_integrity()
    # 14 tokens computed: block 4 holds positions 12-15 and is not full, so not published
    assert pool.blocks[4].block_hash is None and req.num_computed_tokens == 14


def test_accepted_drafts_publish_only_real_tokens():
    s = make_scheduler()
    req = make_request("a", [1, 2, 3, 4, 5, 6, 1, 2, 3], max_tokens=20)
    s.add_request(req)
    run_step(s, {"a": [4]})  # tokens 1 2 3 4 5 6 1 2 3 4: drafts follow "3 4" -> "5 6 1 2"
    req.drafter = Drafter(max_k=8)  # from its first decode on
    out = s.schedule()
    [item] = out.scheduled
    drafts = item.token_ids[1:]
    assert drafts == [5, 6, 1, 2, 3, 4][: len(drafts)] and len(drafts) == 6
    # 9 computed + 1 + 6 = 16 tokens: blocks 1-4; only the 2 full blocks of the 10 real
    # tokens are published while the drafts are unverified
    pool = s.kv.pool
    assert s.kv.get_block_ids("a") == ([1, 2, 3, 4],)
    assert [pool.blocks[i].block_hash is not None for i in (1, 2, 3, 4)] == [1, 1, 0, 0]
    # all six accepted, plus the token after them: 17 tokens, 16 computed
    s.update_from_output(out, ModelRunnerOutput({"a": 5}, {"a": [6, 1, 2, 3, 4, 77]}))
    s.check_integrity()
    assert req.all_token_ids[9:] == [4, 5, 6, 1, 2, 3, 4, 77]
    assert req.num_computed_tokens == 16 and len(req.block_hashes) == 4
    run_step(s, {"a": [78]})  # the next allocation publishes blocks 3 and 4 under real hashes
    assert [pool.blocks[i].block_hash for i in (1, 2, 3, 4)] == req.block_hashes


def test_drafts_never_preempt_and_stop_inside_them():
    s = make_scheduler(num_blocks=5)  # 4 usable blocks of 4 tokens
    req = make_request("a", [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2], max_tokens=3)
    s.add_request(req)
    run_step(s, {"a": [3]})
    req.drafter = Drafter(max_k=8)  # from its first decode on
    out = s.schedule()
    [item] = out.scheduled
    assert item.num_draft_tokens == 1  # max_tokens 3: one sampled, at most 1 + 1 more
    # eos-free stop by length inside the accepted drafts: "1" accepted, then "2" ends it
    deltas = s.update_from_output(out, ModelRunnerOutput({"a": 1}, {"a": [2]}))
    s.check_integrity()
    assert deltas[0].new_token_ids == [1, 2] and deltas[0].finish_reason == "length"
    assert s.kv.get_num_used_blocks() == 0
    # a pool without room for the drafts: they are dropped, nothing is preempted
    s = make_scheduler(num_blocks=7)  # 6 usable blocks of 4 tokens
    req = make_request("b", [1, 2, 1, 2, 1, 2, 1, 2, 1, 2, 1], max_tokens=8)
    s.add_request(req)
    s.add_request(make_request("c", list(range(50, 58)), max_tokens=4))
    run_step(s, {"b": [2], "c": [9]})  # b holds 3 blocks, c 2: one is free
    req.drafter = Drafter(max_k=8)
    out = s.schedule()
    # b's 6 drafts would need 2 more blocks: b decodes plainly, c takes the free block
    assert [(i.request_id, i.num_draft_tokens) for i in out.scheduled] == [("b", 0), ("c", 0)]
    assert s.kv.get_block_ids("b") == ([1, 2, 3],) and s.kv.get_block_ids("c") == ([4, 5, 6],)
    assert s.num_preemptions == 0 and s.kv.num_free_blocks == 0


# ---- the real model: output identical with drafting on and off -----------------------------

SPEC = SpeculativeConfig(enabled=True)
OFF = SpeculativeConfig(enabled=False)
NUM_TOKENS = 48
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", params=["none", "auto"])
def quantization(request):
    return request.param


@pytest.fixture(scope="module")
def copy_prompts(default_engine, greedy_prompts):
    """Prompts whose continuation copies: a list counted twice, code quoted back."""
    tok = default_engine.tokenizer
    texts = [
        "1, 2, 3, 4, 5, 6, 7, 8, 9, 10\n1, 2, 3, 4, 5, 6, 7, 8, 9, 10\n1, 2, 3,",
        "def area(r):\n    return 3.14 * r * r\n\ndef area(r):\n    return",
    ]
    return [tok.encode(t) for t in texts] + greedy_prompts[:2]


def run_core(prompts, sampling, quantization, spec, **kw):
    """Every request's tokens, driven step by step on an EngineCore, and the core."""
    core = EngineCore(EngineConfig(quantization=quantization, speculative=spec, **kw))
    tokens = {}
    for i, p in enumerate(prompts):
        core.add_request(core.make_request(f"r{i}", p, sampling))
        tokens[f"r{i}"] = []
    while core.has_unfinished_requests():
        for delta in core.step():
            tokens[delta.request_id] += delta.new_token_ids
        core.check_integrity()
    assert core.kv.get_num_used_blocks() == 0
    return [tokens[f"r{i}"] for i in range(len(prompts))], core


@pytest.mark.slow
def test_greedy_identical_batched_chunked_preempted(quantization, copy_prompts):
    cache = CacheConfig(num_blocks=12)  # 11 blocks of 16 for 4 requests: preemption
    chunked = SchedulerConfig(long_prefill_token_threshold=16, max_num_batched_tokens=40)
    kw = {"cache": cache, "scheduler": chunked}
    ref, ref_core = run_core(copy_prompts, GREEDY, quantization, OFF, **kw)
    got, core = run_core(copy_prompts, GREEDY, quantization, SPEC, **kw)
    assert got == ref
    stats = core.get_stats()
    assert stats.num_preemptions > 0
    assert stats.num_accepted_tokens > 0
    assert stats.num_steps < ref_core.get_stats().num_steps
    # alone, too: each prompt in its own engine run matches the batched reference
    alone, _ = run_core(copy_prompts[:1], GREEDY, quantization, SPEC)
    assert alone[0] == ref[0]


@pytest.mark.slow
def test_seeded_sampling_identical(copy_prompts):
    sampling = SamplingParams(max_tokens=32, temperature=0.8, top_p=0.95, seed=7, ignore_eos=True)
    ref, _ = run_core(copy_prompts[:2], sampling, "auto", OFF)
    got, core = run_core(copy_prompts[:2], sampling, "auto", SPEC)
    assert got == ref
    assert core.get_stats().num_draft_tokens > 0


def run_forks(make_engine, quantization, spec, prompt, suffix):
    """A held turn forked twice; each fork continues it in turn, drafting from the tree's
    source (the parent's and the earlier sibling's outputs). Returns every turn's tokens."""
    engine = make_engine(quantization=quantization, speculative=spec)
    source = DraftSource()
    parent = engine.add_request(prompt, GREEDY, hold_kv=True, draft_source=source).result()
    handles = engine.fork_held(parent.request_id, 2)
    turn2 = prompt + parent.token_ids + suffix
    gens = [parent]
    for handle in handles:
        stream = engine.add_request(turn2, GREEDY, held_kv=handle, draft_source=source)
        gens.append(stream.result())
    engine.release_held(parent.request_id)
    engine.check_integrity()
    assert engine.stats().kv_num_used_blocks == 0
    assert len(source) == (3 if spec.enabled else 0)
    return [g.token_ids for g in gens], gens


@pytest.mark.slow
def test_greedy_identical_with_forks(quantization, make_engine, copy_prompts, default_engine):
    suffix = default_engine.tokenizer.encode("\nAgain:\n")
    ref, _ = run_forks(make_engine, quantization, OFF, copy_prompts[1], suffix)
    got, gens = run_forks(make_engine, quantization, SPEC, copy_prompts[1], suffix)
    assert got == ref
    assert all(g.usage.cached_tokens > 0 for g in gens[1:])  # the forks continued held KV
    assert gens[2].usage.accepted_draft_tokens > 0
    assert all(g.usage.draft_tokens >= g.usage.accepted_draft_tokens for g in gens)


@pytest.mark.slow
def test_stop_string_inside_accepted_drafts(make_engine, copy_prompts):
    """A stop string the accepted drafts run past ends the output where it would without."""
    sampling = SamplingParams(max_tokens=NUM_TOKENS, stop=("6,",))
    outs = []
    for spec in (OFF, SPEC):
        engine = make_engine(speculative=spec)
        outs.append(engine.generate([copy_prompts[0]], sampling)[0])
        engine.check_integrity()
    off, on = outs
    assert (on.token_ids, on.text, on.finish_reason) == (off.token_ids, off.text, "stop")
    assert on.usage.output_tokens == off.usage.output_tokens


# ---- grammar-constrained requests draft what their grammar accepts ---------------------------

CALL = (
    '<tool_call>[{"name": "write_file", "arguments": {"path": "src/agentx/engine/draft.py", '
    '"content": "def area(r):\\n    return 3.14 * r * r\\n"}}]</tool_call>'
)
WRITE_FILE = {
    "type": "object",
    "properties": {
        "name": {"const": "write_file"},
        "arguments": {
            "type": "object",
            "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
            "required": ["path", "content"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
CALL_GRAMMAR = 'start: "<tool_call>[" call "]</tool_call>"\ncall: %json ' + json.dumps(
    compact_json(WRITE_FILE)
)


@pytest.fixture(scope="module")
def call_prompt(default_engine):
    """A chat turn that asks for a tool call the context already holds word for word."""
    tok = default_engine.tokenizer
    messages = [
        {"role": "user", "content": f"Here is a tool call:\n{CALL}\nWrite it again, exactly."}
    ]
    return tok.encode(tok.apply_chat_template(messages))


def test_grammar_drafts_only_what_it_accepts_and_masks_every_drafted_row(default_engine):
    backend = default_engine.core._grammar_backend()
    grammar = backend.new_matcher(StructuredOutput(regex=r"(ab)+c"))
    tok = default_engine.tokenizer
    a, b, c = (tok.encode(s, add_special_tokens=False)[0] for s in "abc")
    assert grammar.draftable([a, b, a, b, c, a]) == [a, b, a, b, c]  # nothing after "c"
    assert grammar.draftable([b, a]) == []
    bitmask = backend.allocate_bitmask(3)
    grammar.fill_draft_bitmasks(bitmask, 0, [a, b])
    allowed = []
    for row in range(3):
        logits = torch.zeros(1, default_engine.core.spec.vocab_size)
        apply_bitmask(logits, bitmask[row : row + 1])
        allowed.append(set(torch.nonzero(logits[0] == 0).flatten().tolist()))
    assert a in allowed[0] and b not in allowed[0] and c not in allowed[0]  # before "a"
    assert b in allowed[1] and a not in allowed[1]  # after "a": "b" only
    assert {a, c} <= allowed[2] and b not in allowed[2]  # after "ab": "a" again or "c"
    assert grammar.draftable([a, b]) == [a, b]  # the state was put back
    assert grammar.commit(a) == a and grammar.draftable([a]) == []
    # drafts that run past the grammar's end: a stopped matcher takes no EOS (nor counts it
    # for rollback), the rows after the end allow EOS alone, and the state is put back
    eos = min(default_engine.core.eos_token_ids)
    bitmask = backend.allocate_bitmask(4)
    grammar.fill_draft_bitmasks(bitmask, 0, [b, c, eos])
    assert bitmask[3].nonzero().flatten().tolist() == [eos >> 5]
    assert grammar.draftable([b, c]) == [b, c] and not grammar.is_terminated


def test_a_drafted_position_the_budget_forces_is_sampled_again(default_engine):
    """The verify rows after drafts carry the grammar's own mask; where the budget would have
    forced its plan instead (no slack left), the step keeps nothing from that row on."""
    backend = default_engine.core._grammar_backend()
    tok = default_engine.tokenizer
    a, c = (tok.encode(x, add_special_tokens=False)[0] for x in "ac")
    s = make_scheduler(prefill_drafts_min_kept=0)  # drafts beside its own prefill
    # "a"s, then "c": the shortest output is "c", and 2 tokens leave slack for one "a"
    grammar = backend.new_matcher(StructuredOutput(regex="a{0,10}c"), max_tokens=2)
    req = make_request("g", [a] * 6, max_tokens=2, grammar=grammar)  # its context: "a"s
    req.drafter = Drafter(max_k=4)
    s.add_request(req)
    out = s.schedule()
    [item] = out.scheduled
    assert item.draft_token_ids == [a]  # max_tokens 2: one draft at most
    # the draft matched and the row after it sampled "a" under the grammar's own mask; but
    # there the budget has no slack (1 token left, the plan "c"): that row is not kept
    deltas = s.update_from_output(out, ModelRunnerOutput({"g": a}, {"g": [a]}))
    s.check_integrity()
    assert deltas[0].new_token_ids == [a] and not deltas[0].finished
    assert grammar.is_forced and grammar.budget.plan == (c,)
    assert req.num_computed_tokens == req.num_tokens - 1
    assert (deltas[0].num_draft_tokens, deltas[0].num_accepted_tokens) == (1, 0)
    assert s.schedule().scheduled[0].num_draft_tokens == 0  # nothing drafts into forced ones


@pytest.mark.slow
@pytest.mark.parametrize("max_tokens", [120, 0])  # 0: the grammar's shortest output + 4
def test_constrained_greedy_identical_with_drafts(make_engine, call_prompt, max_tokens):
    spec = StructuredOutput(grammar=CALL_GRAMMAR)
    outs = []
    for speculative in (OFF, SPEC):
        engine = make_engine(speculative=speculative)
        budget = max_tokens or engine.core._grammar_backend().min_tokens(spec) + 4
        sampling = SamplingParams(max_tokens=budget, structured=spec)
        seeded = SamplingParams(max_tokens=budget, structured=spec, temperature=0.7, seed=5)
        streams = [engine.add_request(call_prompt, s) for s in (sampling, seeded)]
        outs.append([s.result() for s in streams])
        engine.check_integrity()
        assert engine.stats().kv_num_used_blocks == 0
    off, on = outs
    for a, b in zip(off, on, strict=True):
        assert (b.token_ids, b.finish_reason, b.stop_reason) == (
            a.token_ids,
            a.finish_reason,
            a.stop_reason,
        )
        assert a.usage.draft_tokens == 0
    if max_tokens:  # room to copy: the call is drafted from the prompt and accepted
        assert on[0].text == CALL
        assert on[0].usage.accepted_draft_tokens > len(on[0].token_ids) // 2
    else:  # the budget forces its plan at the end: nothing is drafted into forced positions
        assert on[0].stop_reason == "grammar_budget"


@pytest.mark.parametrize("min_kept", [0.9, 0.0])
def test_drafts_yield_while_a_prefill_is_chunked(min_kept):
    # the fixed prior (45 ms + 1.9 ms a token + 5 ms a request) at the 200 ms target leaves
    # floor((200 - 45 - 1.9 - 10) / 1.9) = 75 tokens for "b" beside "a"'s decode; nothing
    # verified yet, "a" keeps 0 of its drafts as far as the engine knows, so at 0.9 it drafts
    # only once no step computes "b"'s prompt ("b", 100 tokens, is clipped to the share as any
    # turn with short_turn_tokens=0); at 0 it drafts beside it
    yield_ = min_kept > 0
    s = make_scheduler(
        num_blocks=60,
        prefill_drafts_min_kept=min_kept,
        step_cost_model="fixed",
        short_turn_tokens=0,
    )
    req = make_request("a", [5, 6, 7, 8, 1, 2, 3, 5, 6, 7, 8], max_tokens=20)
    s.add_request(req)
    run_step(s, {"a": [1]})
    req.drafter = Drafter(max_k=4)
    s.add_request(make_request("b", list(range(100, 200)), max_tokens=4))

    def shape(out):
        return {x.request_id: (len(x.token_ids), x.num_draft_tokens) for x in out.scheduled}

    out = s.schedule()
    # "a" drafts "2 3 5 6" (what followed "7 8 1") unless it yields to "b"'s chunk
    assert shape(out) == {"a": (1, 0) if yield_ else (5, 4), "b": (75, 0)}
    if yield_:
        s.update_from_output(out, ModelRunnerOutput({"a": 2}))
        # "b"'s last 25 tokens fit: nothing is left wanting, but the step computes them
        out = s.schedule()
        assert shape(out) == {"a": (1, 0), "b": (25, 0)}
        s.update_from_output(out, ModelRunnerOutput({"a": 3, "b": 7}))
        s.check_integrity()
        # both decode: "a" drafts "5 6 7 8" (what followed "2 3")
        out = s.schedule()
        assert shape(out) == {"a": (5, 4), "b": (1, 0)}
        assert out.scheduled[0].token_ids == [3, 5, 6, 7, 8]


def test_a_request_whose_drafts_are_kept_drafts_beside_a_prefill():
    # the default weighs the kept fraction: before a request has drafted 8 tokens the
    # engine's recent one, then its own (prefill_drafts_min_kept 0.9)
    s = make_scheduler(
        num_blocks=60, step_cost_model="fixed", short_turn_tokens=0, long_prefill_token_threshold=64
    )
    req = make_request("a", [5, 6, 7, 8, 1, 2, 3, 5, 6, 7, 8], max_tokens=40)
    s.add_request(req)
    run_step(s, {"a": [1]})
    req.drafter = Drafter(max_k=4)
    assert s.get_kept_fraction(req) == 0.0  # nothing verified yet: it would yield
    out, _ = run_step(s, {"a": [2, 3, 5, 6, 7]})  # all 4 drafts kept, "7" after them
    assert out.scheduled[0].draft_token_ids == [2, 3, 5, 6]
    assert s.get_kept_fraction(req) == 1.0  # 4 drafted: still the engine's (4 of 4)
    s.add_request(make_request("b", list(range(100, 200)), max_tokens=4))

    def shape(out):
        return {x.request_id: (len(x.token_ids), x.num_draft_tokens) for x in out.scheduled}

    # kept 1.0 >= 0.9: "a" drafts "8 1 2 3" beside "b"'s first chunk (64 tokens, the cap)
    out = s.schedule()
    assert shape(out) == {"a": (5, 4), "b": (64, 0)}
    assert out.scheduled[0].draft_token_ids == [8, 1, 2, 3]
    s.update_from_output(out, ModelRunnerOutput({"a": 8}, {"a": [9]}))  # "8" kept, then "9"
    s.check_integrity()
    # its own now: 5 of 8 kept; the engine's 4 * 0.98 + 1 of 4 * 0.98 + 4
    assert s.get_kept_fraction(req) == 5 / 8
    out = s.schedule()
    assert shape(out) == {"a": (1, 0), "b": (36, 0)}  # it yields to "b"'s last chunk
    s.update_from_output(out, ModelRunnerOutput({"a": 4, "b": 7}))
    s.check_integrity()
    fresh = make_request("c", [1, 2, 3], max_tokens=4)
    fresh.drafter = Drafter(max_k=4)
    assert s.get_kept_fraction(fresh) == pytest.approx((4 * 0.98 + 1) / (4 * 0.98 + 4))
    fresh.drafter.observe(8, 8)  # 8 drafted: its own fraction counts, not the engine's
    assert s.get_kept_fraction(fresh) == 1.0
