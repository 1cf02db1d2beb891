"""The blocks every architecture is assembled from: RMSNorm, attention, a gated MLP, a layer.

    RMSNorm       x / rms(x) * scale; how the checkpoint's weight w becomes the scale is a
                  :class:`NormWeight` (w, or 1 + w folded at load, or 1 + w in fp32 per call)
    Attention     qkv_proj -> [q | gate] per head? -> q/k RMSNorm? -> RoPE on the leading
                  rotary dims -> paged attention -> * sigmoid(gate)? -> o_proj
    GatedMLP      down_proj(act(gate) * up), gate and up fused into gate_up_proj; act silu
                  (SwiGLU) or gelu_tanh (GeGLU)
    DecoderLayer  x + mixer(RMSNorm(x)) -> x + mlp(RMSNorm(x)), around any token mixer and MLP

The projections are the parallel-aware layers of ``layers.py``, under the names the
checkpoint-name resolution of ``base.py`` expects (``qkv_proj``, ``o_proj``, ``gate_up_proj``,
``down_proj``). Nothing here knows which architecture it serves.
"""

from __future__ import annotations

from enum import Enum

import torch
from torch import nn

from agentx import kernels
from agentx.engine.models.attention import PagedAttention
from agentx.engine.models.forward_context import get_forward_context
from agentx.engine.models.layers import ColumnParallelLinear, RotaryEmbedding, RowParallelLinear
from agentx.engine.models.spec import ModelSpec
from agentx.engine.parallel import ParallelState
from agentx.errors import ModelLoadError


class NormWeight(Enum):
    """How an RMSNorm's checkpoint weight w scales the normalized x."""

    PLAIN = "w"
    # Gemma: 1 + w, computed in fp32 once at load and stored in the weight dtype; the forward
    # pass is then the plain kernel.
    OFFSET_AT_LOAD = "1 + w, folded at load"
    # Qwen3-Next's zero-centered norm: w stored as is, x and 1 + w taken to fp32 on every call.
    OFFSET_FP32 = "1 + w, in fp32 per call"


class RMSNorm(nn.Module):
    def __init__(
        self,
        dim: int,
        eps: float,
        dtype: torch.dtype = torch.float32,
        weight: NormWeight = NormWeight.PLAIN,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight_kind = weight
        init = torch.zeros if weight is NormWeight.OFFSET_FP32 else torch.ones
        self.weight = nn.Parameter(init(dim, dtype=dtype), requires_grad=False)

    def load(self, name: str, full: torch.Tensor, part: int = 0) -> None:
        if self.weight_kind is NormWeight.OFFSET_AT_LOAD:
            full = 1.0 + full.float()
        self.weight.data.copy_(full)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_kind is NormWeight.OFFSET_FP32:
            scale = 1.0 + self.weight.float()
            return kernels.rms_norm(x.float(), scale, self.eps).to(x.dtype)
        return kernels.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    """Self-attention over the paged KV cache, with the options the architectures differ by.

    scale           score scale (default head_dim ** -0.5)
    qk_norm         per-head RMSNorm of q and k before RoPE, with this weight kind (None: none)
    sliding_window  tokens a query sees, itself included (None: all)
    output_gate     q_proj yields [q | gate] per head, (H, 2D) rows, as one fused part so
                    tensor parallel keeps heads whole; the output is o * sigmoid(gate)

    RoPE rotates the first ``rotary_dim`` dims of each head, the width of ``rotary``'s table
    (partial rotary when that is less than ``head_dim``); the rest passes through.
    """

    def __init__(
        self,
        spec: ModelSpec,
        layer_id: int,
        rotary: RotaryEmbedding,
        parallel: ParallelState,
        dtype: torch.dtype,
        *,
        scale: float | None = None,
        qk_norm: NormWeight | None = None,
        sliding_window: int | None = None,
        output_gate: bool = False,
    ) -> None:
        super().__init__()
        heads = parallel.head_shard(spec.num_heads, spec.num_kv_heads)
        self.num_heads, self.num_kv_heads = heads.num_q, heads.num_kv
        self.head_dim = d = spec.head_dim
        self.output_gate = output_gate
        q_size, kv_size = spec.num_heads * d, spec.num_kv_heads * d
        q_rows = 2 * q_size if output_gate else q_size
        q_width = 2 * d if output_gate else d  # rows per query head in q_proj
        kv_shard = (heads.kv_start * d, heads.num_kv * d)
        self.qkv_proj = ColumnParallelLinear(
            spec.hidden_size,
            [q_rows, kv_size, kv_size],
            parallel,
            spec.attention_bias,
            dtype,
            shards=[(heads.q_start * q_width, heads.num_q * q_width), kv_shard, kv_shard],
        )
        self.q_norm = self.k_norm = None
        if qk_norm is not None:
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, dtype, qk_norm)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, dtype, qk_norm)
        o_shard = (heads.q_start * d, heads.num_q * d)
        self.o_proj = RowParallelLinear(q_size, spec.hidden_size, parallel, dtype, o_shard)
        self.rotary = rotary
        self.rotary_dim = rotary.cos_sin_cache.shape[-1]
        self.attn = PagedAttention(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.head_dim**-0.5 if scale is None else scale,
            layer_id,
            sliding_window=sliding_window,
            parallel=parallel,
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.output_sizes, dim=-1)
        if self.output_gate:
            q_gate = q.view(-1, self.num_heads, 2 * self.head_dim)  # (T, H, 2D)
            q, gate = q_gate.chunk(2, dim=-1)  # (T, H, D) each
        else:
            q = q.view(-1, self.num_heads, self.head_dim)  # (T, H, D)
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # (T, Hkv, D)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self._rotate(positions, q, k)
        o = self.attn(q, k, v)  # (T, H, D)
        if self.output_gate:
            o = o * torch.sigmoid(gate)
        return self.o_proj(o.flatten(1))

    def _rotate(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.rotary_dim
        if r == self.head_dim:
            return self.rotary(positions, q, k)
        q_rot, k_rot = self.rotary(positions, q[..., :r], k[..., :r])
        return torch.cat((q_rot, q[..., r:]), dim=-1), torch.cat((k_rot, k[..., r:]), dim=-1)


# activation -> the kernel computing act(gate) * up from [gate | up]
_ACT_AND_MUL = {"silu": "silu_and_mul", "gelu_tanh": "gelu_tanh_and_mul"}


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up fused into one projection."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        parallel: ParallelState,
        dtype: torch.dtype,
        activation: str = "silu",
    ) -> None:
        super().__init__()
        if activation not in _ACT_AND_MUL:
            known = ", ".join(_ACT_AND_MUL)
            raise ModelLoadError(f"unknown MLP activation {activation!r} (known: {known})")
        self.act_and_mul = getattr(kernels, _ACT_AND_MUL[activation])
        sizes = [intermediate_size, intermediate_size]
        self.gate_up_proj = ColumnParallelLinear(hidden_size, sizes, parallel, False, dtype)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, parallel, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """A pre-norm block: x + mixer(input_layernorm(x)), then + mlp(post_attention_layernorm(x)).

    The token mixer keeps its checkpoint name (``self_attn``, ``linear_attn``). Once weights
    are final, :meth:`fuse` lets the plainest shape (attention without q/k norm or gate, full
    RoPE, a SwiGLU MLP, plain norms, every projection quantized, one rank, fp32; q | k | v may
    have a bias and come as up to three K-quant runs, as Qwen2 in a Q4_K_M file) run as one
    compiled op, prefill and decode alike, so a token's numbers never depend on which path ran.
    """

    def __init__(
        self,
        spec: ModelSpec,
        dtype: torch.dtype,
        mixer_name: str,
        mixer: nn.Module,
        mlp: nn.Module,
        norm_weight: NormWeight = NormWeight.PLAIN,
    ) -> None:
        super().__init__()
        hidden, eps = spec.hidden_size, spec.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps, dtype, norm_weight)
        self.mixer_name = mixer_name
        self.add_module(mixer_name, mixer)
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype, norm_weight)
        self.mlp = mlp
        self._fused: kernels.FusedLayerWeights | None = None

    def fuse(self) -> bool:
        """Use the fused layer op from now on when this layer's shape allows it (its KV cache
        may then be float32 or bfloat16). Under tensor parallelism a layer never fuses (its
        projections all-reduce in between), but :meth:`fusable` still says it would at tp=1."""
        if not self.fusable():
            return False
        attn, mlp = getattr(self, self.mixer_name), self.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if any(lin.parallel.tp_size != 1 for lin in linears) or attn.attn.parallel.dcp_size != 1:
            return False
        qkv_runs, o, gate_up, down = (
            [
                kernels.FusedLinear(qweight.data, lin.qscale.data, lin.qmin.data, bits)
                for qweight, bits in lin.get_runs()
            ]
            for lin in linears
        )
        bias = attn.qkv_proj.bias
        self._fused = kernels.FusedLayerWeights.with_qkv_runs(
            qkv_runs,
            None if bias is None else bias.data,
            input_norm=self.input_layernorm.weight.data,
            o_proj=o[0],
            post_attention_norm=self.post_attention_layernorm.weight.data,
            gate_up_proj=gate_up[0],
            down_proj=down[0],
        )
        return True

    def fusable(self) -> bool:
        """Whether this layer's shape runs as the fused op at one rank."""
        attn, mlp = getattr(self, self.mixer_name), self.mlp
        norms = (self.input_layernorm, self.post_attention_layernorm)
        if not (
            isinstance(attn, Attention)
            and isinstance(mlp, GatedMLP)
            and mlp.act_and_mul is kernels.silu_and_mul
            and attn.q_norm is None
            and not attn.output_gate
            and attn.rotary_dim == attn.head_dim
            and attn.attn.head_dim in (64, 128, 256)
            and all(n.weight_kind is NormWeight.PLAIN for n in norms)
            and all(n.weight.dtype == torch.float32 for n in norms)
        ):
            return False
        qkv, others = attn.qkv_proj, (attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if any(lin.bits <= 0 or lin.bias is not None for lin in others):  # float or MIXED
            return False
        # q | k | v may come as K-quant runs (MIXED) and with a bias (Qwen2)
        if not qkv.bits or len(qkv.get_runs()) > kernels.FusedLayerWeights.max_qkv_runs:
            return False
        if qkv.bias is not None and qkv.bias.dtype != torch.float32:
            return False
        return kernels.cpu_kernels_enabled()

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self._fused is not None:
            return self._forward_fused(positions, x, self._fused)
        mixer = getattr(self, self.mixer_name)
        x = x + mixer(positions, self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_rows(
        self, positions: torch.Tensor, x: torch.Tensor, keep: torch.Tensor
    ) -> torch.Tensor:
        """``forward(positions, x)[keep]`` (``keep`` ascending, unique): the fused layer writes
        every row's K and V and runs attention and the MLP for the kept rows alone (a row's
        result is its own: the same bits); other shapes run every row and select."""
        if self._fused is None:
            return self(positions, x)[keep.to(x.device)]
        return self._forward_fused(positions, x, self._fused, keep)

    def _forward_fused(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        weights: kernels.FusedLayerWeights,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        attn = getattr(self, self.mixer_name)
        paged = attn.attn
        ctx = get_forward_context()
        meta = ctx.attn_for(paged.layer_id)
        token_req, token_len = meta.token_req, meta.token_len
        if token_req is None or token_len is None:
            token_req, token_len = kernels.token_layout(meta.query_start_loc, meta.seq_lens)
        return kernels.fused_decoder_layer(
            x,
            positions,
            attn.rotary.cos_sin_cache,
            weights,
            ctx.kv_caches[paged.layer_id],
            meta.slot_mapping,
            meta.block_tables,
            token_req,
            token_len,
            paged.num_heads,
            self.input_layernorm.eps,
            paged.scale,
            paged.sliding_window,
            keep,
        )


class FusedLayers:
    """A model's decoder layers run as one op (``kernels.fused_decoder_layers``): where every
    layer is a fused :class:`DecoderLayer` (its own forward, not a subclass's) and all share
    their attention's heads, scale and window, their norms' eps and their RoPE table, and a
    step's context puts them in one KV group. Layer by layer the same ops run with the same
    arguments, so the same bits; what goes is the Python and the dispatch between the layers
    (0.7-3 ms a step of SmolLM2's 30 layers, ~3% of a saturated run's engine thread)."""

    def __init__(self, layers: list[DecoderLayer]) -> None:
        self._layers = tuple(layers)
        self._weights = tuple(layer._fused for layer in layers)  # what the stack was built of
        self.stack = kernels.FusedLayerStack(self._weights)
        self.layer_ids = tuple(_mixer(layer).attn.layer_id for layer in layers)
        paged = _mixer(layers[0]).attn
        self.num_heads, self.scale, self.window = paged.num_heads, paged.scale, paged.sliding_window
        self.eps = layers[0].input_layernorm.eps

    @classmethod
    def of(cls, layers: list[nn.Module]) -> FusedLayers | None:
        """The layers as one op, or None where they do not all qualify (above)."""
        if not layers:
            return None
        for layer in layers:
            if (
                not isinstance(layer, DecoderLayer)
                or layer._fused is None
                or any(
                    getattr(type(layer), name) is not getattr(DecoderLayer, name)
                    for name in ("forward", "forward_rows", "_forward_fused")
                )
            ):
                return None
        first = _shape(layers[0])
        if any(_shape(layer) != first for layer in layers[1:]):
            return None
        table = _mixer(layers[0]).rotary.cos_sin_cache
        for layer in layers[1:]:
            other = _mixer(layer).rotary.cos_sin_cache
            if other is not table and not (
                other.shape == table.shape and torch.equal(other, table)
            ):
                return None
        return cls(layers)

    def is_current(self, layers: nn.ModuleList) -> bool:
        """Whether ``layers`` are still the layers, with the weights, this was built of."""
        return len(layers) == len(self._layers) and all(
            layer is mine and layer._fused is weights
            for layer, mine, weights in zip(layers, self._layers, self._weights, strict=True)
        )

    def run(
        self, positions: torch.Tensor, x: torch.Tensor, keep: torch.Tensor | None
    ) -> torch.Tensor | None:
        """Every layer's forward (the last's ``forward_rows`` with ``keep``), or None when this
        step's context splits the layers over KV groups (the caller then loops)."""
        ctx = get_forward_context()
        groups = ctx.layer_groups
        group = groups[self.layer_ids[0]]
        if any(groups[i] != group for i in self.layer_ids) or ctx.attn[group] is None:
            return None
        meta = ctx.attn[group]
        token_req, token_len = meta.token_req, meta.token_len
        if token_req is None or token_len is None:
            token_req, token_len = kernels.token_layout(meta.query_start_loc, meta.seq_lens)
        return kernels.fused_decoder_layers(
            x,
            positions,
            _mixer(self._layers[0]).rotary.cos_sin_cache,
            self.stack,
            [ctx.kv_caches[i] for i in self.layer_ids],
            meta.slot_mapping,
            meta.block_tables,
            token_req,
            token_len,
            self.num_heads,
            self.eps,
            self.scale,
            self.window,
            keep,
        )


def _mixer(layer: DecoderLayer) -> nn.Module:
    return getattr(layer, layer.mixer_name)


def _shape(layer: DecoderLayer) -> tuple:
    paged = _mixer(layer).attn
    return (paged.num_heads, paged.scale, paged.sliding_window, layer.input_layernorm.eps)
