"""The causal-LM shell every architecture shares, and how it loads a checkpoint.

    token ids -> embed_tokens (-> embed) -> layers -> norm -> lm_head -> float32 logits

An architecture builds its decoder layers (``make_layer``) and says which :class:`NormWeight`
its final norm uses; the shell owns ``forward``, ``compute_logits`` and ``load_weights``.

Checkpoints use Hugging Face names (``model.layers.{i}.self_attn.q_proj.weight``). A name maps
to the module that loads it: q/k/v and gate/up are parts of one fused projection; otherwise the
deepest module with a ``load`` takes the rest of the name (``mlp.experts`` gets
``0.gate_proj.weight``, ``linear_attn`` gets ``A_log``). Every parameter must be covered.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
from torch import nn

from agentx.engine.models.blocks import FusedLayers, NormWeight, RMSNorm
from agentx.engine.models.layers import ParallelLMHead, VocabParallelEmbedding
from agentx.engine.models.spec import ModelSpec
from agentx.engine.parallel import ParallelState
from agentx.errors import ModelLoadError

# checkpoint name suffix -> (module path suffix, fused part index)
FUSED_PARTS = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
    "shared_expert.gate_proj": ("shared_expert.gate_up_proj", 0),
    "shared_expert.up_proj": ("shared_expert.gate_up_proj", 1),
}


class CausalLM(nn.Module):
    """Embedding, decoder layers, final norm and LM head (tied to the embedding when
    ``spec.tie_word_embeddings`` and the checkpoint has no ``lm_head.weight``)."""

    # checkpoint tensors that have no place in the model on purpose (e.g. an MTP head)
    skipped_prefixes: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        spec: ModelSpec,
        parallel: ParallelState,
        dtype: torch.dtype,
        make_layer: Callable[[int], nn.Module],
        norm_weight: NormWeight = NormWeight.PLAIN,
    ) -> None:
        super().__init__()
        self.spec = spec
        self.embed_tokens = VocabParallelEmbedding(
            spec.vocab_size, spec.hidden_size, parallel, dtype
        )
        self.layers = nn.ModuleList(make_layer(i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, norm_weight)
        self.lm_head = ParallelLMHead(spec.vocab_size, spec.hidden_size, parallel, dtype)
        # the layers as one fused op (blocks.FusedLayers), rebuilt when they change: (the
        # layers' weights it was checked against, the op or None)
        self._fused_layers: tuple[tuple, FusedLayers | None] | None = None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(T,) -> (T, hidden): the first layer's input."""
        return self.embed_tokens(input_ids)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor | None = None
    ) -> torch.Tensor:
        """input_ids, positions (T,) -> final hidden states (T, hidden); with ``keep`` (rows,
        ascending, unique) those rows' alone, (len(keep), hidden): the last layer computes no
        more than they need (every row's K and V are still written)."""
        x = self.embed(input_ids)
        fused = self._layers_as_one()
        if fused is not None:
            out = fused.run(positions, x, keep)
            if out is not None:
                return self.norm(out)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = (
                layer(positions, x)
                if keep is None or i < last
                else layer.forward_rows(positions, x, keep)
            )
        return self.norm(x)

    def _layers_as_one(self) -> FusedLayers | None:
        """The layers as one fused op, where they qualify (blocks.FusedLayers)."""
        cached = self._fused_layers
        if cached is not None:
            fused = cached[1]
            if fused is not None and fused.is_current(self.layers):
                return fused
            if fused is None and cached[0] == _weights_key(self.layers):
                return None
        fused = FusedLayers.of(list(self.layers))
        self._fused_layers = (_weights_key(self.layers), fused)
        return fused

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, hidden) -> (N, vocab) float32 logits."""
        return self.lm_head(hidden).float()

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Load Hugging Face-named tensors; every parameter must be covered.

        Raises ModelLoadError for a tensor with no place in the model and for parameters
        the checkpoint lacks.
        """
        modules = dict(self.named_modules())
        loaded: set[str] = set()
        for name, tensor in weights.items():
            if name.startswith(self.skipped_prefixes):
                continue
            target, param, part = _resolve(name, modules)
            module = modules[target]
            module.load(param, tensor, part)
            param_for = getattr(module, "param_for", None)
            loaded.add(f"{target}.{param_for(param) if param_for else param}")
        if "lm_head.weight" not in loaded and self.spec.tie_word_embeddings:
            self.lm_head.load("weight", weights["model.embed_tokens.weight"])
            loaded.add("lm_head.weight")
        missing = {n for n, _ in self.named_parameters()} - loaded
        if missing:
            raise ModelLoadError(f"checkpoint lacks {len(missing)} tensors, e.g. {min(missing)}")


def _resolve(name: str, modules: dict[str, nn.Module]) -> tuple[str, str, int]:
    """Checkpoint name -> (module path, name the module's ``load`` gets, fused part)."""
    path, _, param = name.removeprefix("model.").rpartition(".")
    fused = _fused_part(path)
    if fused is not None:
        path, part = fused
    else:
        part = 0
        while path and not hasattr(modules.get(path), "load"):
            path, _, head = path.rpartition(".")
            param = f"{head}.{param}"
    if not path or not hasattr(modules.get(path), "load"):
        raise ModelLoadError(f"checkpoint tensor {name!r} has no place in the model")
    return path, param, part


def _fused_part(path: str) -> tuple[str, int] | None:
    """The fused projection and part a checkpoint's q/k/v or gate/up module path names."""
    for suffix, (fused, part) in FUSED_PARTS.items():
        if path.endswith(suffix):
            return path[: -len(suffix)] + fused, part
    return None


def _weights_key(layers: nn.ModuleList) -> tuple:
    """Each layer and its fused weights (None where it has none), by identity. Read from the
    instance dict: a layer without ``_fused`` (not a DecoderLayer) would otherwise raise and
    catch an AttributeError in nn.Module's lookup every step."""
    return tuple((id(layer), id(vars(layer).get("_fused"))) for layer in layers)
