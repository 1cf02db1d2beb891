"""Start-up: ``import agentx`` loads only what every program needs, and the grammar mask helper
that replaced ``llguidance.torch`` (which pulls in ``torch._dynamo`` and compiles) is exact."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from agentx.engine.structured import apply_bitmask

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
