"""The tokenizer built from GGUF metadata: ids equal to transformers', chat templates rendered
as transformers renders them, streaming detokenization, and the on-disk cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import tokenizers
import transformers  # a dev dependency: the reference

from agentx.engine.models import tokenizer_gguf as tokenizer_module
from agentx.engine.models.detokenizer import IncrementalDetokenizer
from agentx.engine.models.tokenizer import Tokenizer
from agentx.engine.models.tokenizer_gguf import clear_tokenizer_cache
from agentx.errors import InvalidRequestError
from tests.helpers.models import TOKENIZER_CORPUS

CHAT_TEXT = (
    "<|im_start|>system\nYou are helpful.<|im_end|>\n"
    "<|im_start|>user\nHi there, 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
)
CORPUS = [
    *TOKENIZER_CORPUS,
    "",
    CHAT_TEXT,
    "text<|im_end|>more<|endoftext|><repo_name>x",
]
CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "You are a pirate."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Arr!"},
        {"role": "user", "content": "Say 😀 in 中文"},
    ],
    [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "second\n  indented"},
    ],
]


@pytest.fixture(scope="module")
def ours(model_path: Path, cache_dir: Path) -> Tokenizer:
    clear_tokenizer_cache()
    return Tokenizer.from_gguf(model_path)


@pytest.fixture(scope="module")
def reference(model_path: Path):
    return transformers.AutoTokenizer.from_pretrained(model_path.parent, gguf_file=model_path.name)


# --- ids and text -------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("text", CORPUS)
def test_ids_equal_transformers(ours: Tokenizer, reference, text: str) -> None:
    ids = ours.encode(text)
    assert ids == reference.encode(text, add_special_tokens=False)
    assert ours.decode(ids) == text
    assert ours.decode(ids) == reference.decode(ids)


@pytest.mark.slow
def test_special_tokens_and_metadata(ours: Tokenizer) -> None:
    assert ours.encode("<|im_start|>user<|im_end|>") == [1, 4093, 2]
    assert ours.decode([1, 4093, 2], skip_special_tokens=True) == "user"
    assert (ours.vocab_size, ours.bos_token_id, ours.eos_token_ids) == (49152, 1, {2})
    assert not ours.add_bos
    assert ours.encode("hi", add_special_tokens=True) == ours.encode("hi")  # add_bos_token False
    assert ours.token_to_text(4093) == "user"
    assert ours.token_to_text(2) == "<|im_end|>"


@pytest.mark.slow
def test_smollm_isolates_digits_before_bpe(ours: Tokenizer) -> None:
    # llama.cpp's "smollm" pre-tokenizer (and the original tokenizer.json: Digits, then ByteLevel)
    # cuts digits out first, so a run of spaces before a digit stays one piece. transformers'
    # GGUF tokenizer applies only the GPT-2 regex here and gives Ġ Ġ 1 instead.
    def pieces(text: str) -> list[str]:
        return [ours.backend.id_to_token(i) for i in ours.encode(text)]

    assert pieces("  1") == ["ĠĠ", "1"]
    assert pieces("x = [\n    1,") == ["x", "Ġ=", "Ġ[", "ĊĠĠĠĠ", "1", ","]
    assert pieces("abc123") == ["abc", "1", "2", "3"]


# --- chat templates -----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_equals_transformers(
    ours: Tokenizer, reference, messages: list[dict], add_generation_prompt: bool
) -> None:
    text = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    expected = reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert text == expected
    assert ours.encode_chat(messages, add_generation_prompt=add_generation_prompt) == (
        reference.encode(expected, add_special_tokens=False)
    )


@pytest.mark.slow
def test_template_helpers_equal_transformers(ours: Tokenizer, reference) -> None:
    # tojson (plain JSON, not Jinja's HTML-escaping one), loop controls, tools, extra variables
    template = (
        "{% for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}"
        "{{ m | tojson }}\n{% endfor %}"
        "{% if tools %}{{ tools | tojson(indent=2) }}{% endif %}"
        "{{ bos_token }}|{{ eos_token }}|{{ flavour }}"
    )
    messages = [
        {"role": "user", "content": "<b>&'x'</b> 😀"},
        {"role": "skip", "content": "hidden"},
    ]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    custom = Tokenizer(
        ours.backend, bos_token_id=1, eos_token_id=2, chat_template=template
    ).apply_chat_template(messages, tools=tools, flavour="mint")
    expected = reference.apply_chat_template(
        messages, tools=tools, chat_template=template, tokenize=False, flavour="mint"
    )
    assert custom == expected


def test_chat_template_errors_are_invalid_requests() -> None:
    backend = tokenizers.Tokenizer(tokenizers.models.BPE())
    with pytest.raises(InvalidRequestError, match="no chat template"):
        Tokenizer(backend).apply_chat_template([{"role": "user", "content": "x"}])
    strict = Tokenizer(backend, chat_template="{{ raise_exception('roles must alternate') }}")
    with pytest.raises(InvalidRequestError, match="roles must alternate"):
        strict.apply_chat_template([])
    with pytest.raises(InvalidRequestError):
        Tokenizer(backend, chat_template="{{ messages[0].content + 1 }}").apply_chat_template(
            [{"role": "user", "content": "x"}]
        )


# --- streaming ----------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("skip_special_tokens", [False, True])
def test_incremental_detokenizer_one_token_at_a_time(
    ours: Tokenizer, skip_special_tokens: bool
) -> None:
    text = "Emoji 😀👍🏽🇺🇸, CJK 你好世界 and 日本語<|im_end|> done ❤️"
    ids = ours.encode(text)
    detokenizer = IncrementalDetokenizer(ours, skip_special_tokens=skip_special_tokens)
    pieces = [detokenizer.push([token_id]) for token_id in ids]
    assert all(not piece.endswith("\ufffd") for piece in pieces)
    assert "" in pieces  # some token ended inside a multi-byte character and was held back
    assert "".join(pieces) == detokenizer.text
    assert detokenizer.text == ours.decode(ids, skip_special_tokens=skip_special_tokens)
    assert detokenizer.flush() == ""


@pytest.mark.slow
def test_incremental_detokenizer_prompt_tail_and_flush(ours: Tokenizer) -> None:
    prompt = ours.encode("<|im_start|>assistant\n")
    ids = ours.encode("Sure: 😀")
    detokenizer = IncrementalDetokenizer(ours, prompt_ids_tail=prompt[-3:])
    assert "".join(detokenizer.push([i]) for i in ids) == "Sure: 😀"
    # Several ids at once ending inside a character: the whole characters go out now, the rest
    # with the next push, or with flush() when the stream stops there.
    detokenizer = IncrementalDetokenizer(ours)
    assert (detokenizer.push(ids[:-1]), detokenizer.push(ids[-1:])) == ("Sure: ", "😀")
    partial = IncrementalDetokenizer(ours)
    assert (partial.push(ids[:-1]), partial.flush()) == ("Sure: ", "\ufffd")
    assert partial.text == ours.decode(ids[:-1])


# --- the cache ----------------------------------------------------------------------------------


def _same(a: Tokenizer, b: Tokenizer) -> bool:
    fields = ("bos_token_id", "eos_token_id", "eos_token_ids", "add_bos", "chat_template")
    same_fields = all(getattr(a, f) == getattr(b, f) for f in fields)
    return same_fields and a.backend.to_str() == b.backend.to_str()


@pytest.mark.slow
def test_disk_cache_is_read_and_corrupt_files_rebuilt(
    model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AGENTX_CACHE_DIR", str(tmp_path))
    clear_tokenizer_cache()
    built = Tokenizer.from_gguf(model_path)
    assert Tokenizer.from_gguf(model_path) is built  # in-process cache
    (cached,) = (tmp_path / "tokenizers").glob("*.json")

    def no_build(reader):
        raise AssertionError("rebuilt instead of reading the cache")

    with monkeypatch.context() as patch:
        patch.setattr(tokenizer_module, "_build_from_gguf", no_build)
        clear_tokenizer_cache()
        from_disk = Tokenizer.from_gguf(model_path)
    assert from_disk is not built and _same(from_disk, built)
    assert from_disk.encode(CHAT_TEXT) == built.encode(CHAT_TEXT)

    cached.write_text('{"format": 1, "tokenizer": "{not json')
    clear_tokenizer_cache()
    rebuilt = Tokenizer.from_gguf(model_path)
    assert _same(rebuilt, built)
    assert _same(Tokenizer.from_cache_json(cached.read_text()), built)  # the file was rewritten
    assert list((tmp_path / "tokenizers").iterdir()) == [cached]  # no temporary files left
