"""The text corpus of text-backed prompts: the same on every machine, and its blocks."""

import statistics

import pytest

from agentx.bench.corpus import CORPUS_SHA256, KIND_WEIGHTS, Corpus, corpus_sha256
from agentx.bench.prompts import TextPromptBuilder


def test_the_corpus_is_the_committed_one():
    # the same text on every machine, whatever its Python (benchmarks/make_corpus.py wrote it)
    assert corpus_sha256() == CORPUS_SHA256
    corpus = Corpus.load()
    assert set(corpus.texts) == set(KIND_WEIGHTS)
    sizes = {kind: len(text) for kind, text in corpus.texts.items()}
    assert 300_000 < sum(sizes.values()) < 600_000  # a few hundred KB
    assert min(sizes.values()) > 50_000
    for text in corpus.texts.values():
        assert "<|" not in text and "\x1e" not in text  # no chat-template specials


def test_blocks_are_fixed_prefix_closed_and_of_every_kind():
    corpus = Corpus.load()
    block = corpus.text(b"\x001", 64)
    assert block == Corpus.load().text(b"\x001", 64)
    assert corpus.text(b"\x001", 20) == block[: len(corpus.text(b"\x001", 20))]
    assert block.startswith(block[:10]) and len(block) > 100
    kinds = [corpus.kind_of(f"\x00{i}".encode()) for i in range(3000)]
    for kind, weight in KIND_WEIGHTS.items():
        assert abs(kinds.count(kind) / len(kinds) - weight) < 0.03
    assert len({corpus.text(f"\x00{i}".encode(), 64) for i in range(500)}) >= 495


def test_text_prompts_overlap_where_hash_ids_do():
    b = TextPromptBuilder(64)
    p1 = b.segment("", (1, 2, 3), 150)
    p2 = b.segment("", (1, 2, 4, 5), 200)
    two = len(b.block_text("\x001", 64)) + len(b.block_text("\x002", 64))
    assert p1[:two] == p2[:two] and p1[two:] != p2[two : len(p1)]
    assert b.segment("a", (1,), 64) != b.segment("b", (1,), 64)
    assert b.segment("", (1,), 100, "r1")[:two] != b.segment("", (1,), 100, "r2")
    assert b.segment("", (1, 2, 3), 70) == b.segment("", (1, 2), 70)


@pytest.mark.slow
def test_text_lengths_under_the_smollm2_tokenizer():
    """``num_tokens`` of text tokenizes to about that many SmolLM2 tokens."""
    from agentx.bench.engines import model_encode, resolve_model

    encode = model_encode(resolve_model(None))
    b = TextPromptBuilder(64)
    for num_tokens, tolerance in ((1_000, 0.25), (4_000, 0.1), (16_000, 0.05)):
        ratios = []
        for i in range(12):
            ids = tuple(range(i * 1000, i * 1000 + num_tokens // 64 + 1))
            ratios.append(len(encode(b.segment("", ids, num_tokens, "f"))) / num_tokens)
        assert all(abs(r - 1) <= tolerance for r in ratios), (num_tokens, ratios)
        assert abs(statistics.mean(ratios) - 1) <= 0.04, (num_tokens, ratios)
