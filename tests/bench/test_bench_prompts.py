"""Prompts from hash ids: deterministic blocks, exact overlap, valid ids."""

from agentx.bench.prompts import PromptBuilder, TokenSpace


def test_block_tokens_are_fixed_and_distinct():
    b = PromptBuilder(64)
    block = b.block_tokens("", 1)
    assert len(block) == 64
    # a pure function of (scope, id): the same values on every machine and in every process
    assert block[:8] == (7814, 35221, 48467, 39201, 13360, 3064, 7859, 9804)
    assert PromptBuilder(64).block_tokens("", 1) == block
    assert b.block_tokens("s", 1)[:4] == (41434, 42013, 47471, 42166)  # scopes differ
    blocks = {b.block_tokens("", i) for i in range(2000)}
    assert len(blocks) == 2000
    firsts = {b.block_tokens("", i)[:4] for i in range(2000)}
    assert len(firsts) == 2000


def test_prompts_overlap_exactly_where_hash_ids_do():
    b = PromptBuilder(64)
    p1 = b.prompt("", (1, 2, 3), 150)
    p2 = b.prompt("", (1, 2, 4, 5), 200)
    assert len(p1) == 150 and len(p2) == 200
    assert p1[:128] == p2[:128]
    assert p1[128:150] == list(b.block_tokens("", 3)[:22])  # partial last block: a prefix
    assert p2[128:192] == list(b.block_tokens("", 4))
    assert p1[128] != p2[128]
    # local scopes: the same ids in two sessions are different text
    assert b.prompt("a", (1,), 64) != b.prompt("b", (1,), 64)


def test_filler_past_the_last_id():
    b = PromptBuilder(64)
    p = b.prompt("", (1,), 100, filler_key="r1")
    assert p[:64] == list(b.block_tokens("", 1))
    assert len(p) == 100
    assert p[64:] != b.prompt("", (1,), 100, filler_key="r2")[64:]
    assert b.prompt("", (1, 2, 3), 70) == b.prompt("", (1, 2), 70)  # ids past the prompt: unused


def test_token_space_avoids_special_tokens():
    space = TokenSpace.for_vocab(100, special_ids=[0, 1, 2, 50, 98, 99])
    assert (space.low, space.high, space.excluded) == (3, 98, frozenset({50}))
    b = PromptBuilder(16, space)
    ids = [t for i in range(300) for t in b.block_tokens("", i)]
    assert min(ids) == 3 and max(ids) == 97 and 50 not in ids
    assert space.token(47) == 51  # 3 + 47 = 50 is special: the next allowed id
    default = TokenSpace.default()
    assert (default.low, default.high) == (17, 49152)
    assert min(t for i in range(300) for t in PromptBuilder(64).block_tokens("", i)) >= 17
