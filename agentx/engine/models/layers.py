"""Parallel-aware building blocks: linear layers sharded across the tensor-parallel group.

Each layer owns only its shard and knows how to cut its shard out of a full checkpoint tensor
(``load``), so loaders stay ignorant of parallelism:

    ColumnParallelLinear   output features split across ranks (no communication)
    RowParallelLinear      input features split; partial outputs all-reduced
    VocabParallelEmbedding vocabulary rows split; lookups outside the shard give zeros, summed

Linear layers accept float, :class:`QuantizedTensor` or :class:`KQuantTensor` checkpoint
tensors; after loading, ``finalize_weights(mode)`` fixes how the weight is kept (see
``quant.py``): a quantized layer drops its float ``weight`` for packed ``qweight`` / ``qscale``
/ ``qmin`` buffers (``bits`` 4 or 8), or the file's K-quant blocks as ``qweight`` (``bits`` the
GGML type id), or, when its fused parts came in different K-quant types, one ``qweight_<i>``
a run of parts of one type (``bits`` ``MIXED``, ``segment_kinds`` their types).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from agentx import kernels
from agentx.engine.models.quant import KQuantTensor, QuantizedTensor
from agentx.engine.models.spec import RopeScaling
from agentx.engine.parallel import ParallelState
from agentx.kernels.ref import kquant


def _weight(out_features: int, in_features: int, dtype: torch.dtype) -> nn.Parameter:
    """An (out, in) weight; fp32 ones are stored column-major (the contiguous (in, out)).

    On CPU, fp32 ``linear`` over the column-major layout takes a faster GEMV/small-GEMM path:
    ~1.7x at 1-2 rows when the weights stream from DRAM (decode), equal from 4 rows up.
    bf16/fp16 kernels are faster row-major, so those keep it.
    """
    if dtype != torch.float32:
        row_major = torch.empty(out_features, in_features, dtype=dtype)
        return nn.Parameter(row_major, requires_grad=False)
    storage = torch.empty(in_features, out_features, dtype=dtype)
    return nn.Parameter(storage.t(), requires_grad=False)


MIXED = -1  # QuantizableLinear.bits of a layer kept as several K-quant runs
_Quantized = QuantizedTensor | KQuantTensor


def even_shard(size: int, parallel: ParallelState) -> tuple[int, int]:
    """(start, length) of this rank's equal share of ``size`` features."""
    length = size // parallel.tp_size
    return parallel.tp_rank * length, length


class QuantizableLinear(nn.Module):
    """y = x W^T (+ b) with W as float ``weight`` or, once finalized quantized, packed buffers.

    Subclasses fill ``weight`` rows part by part (fused q/k/v or gate/up) through
    :meth:`_load_part`; quantized parts wait in ``_quant_parts`` until :meth:`finalize_weights`.
    """

    weight: nn.Parameter
    bias: nn.Parameter | None
    bits: int = 0  # 0: float weight; 4 / 8: packed; a GGML K-quant type id; MIXED
    segment_kinds: tuple[int, ...] = ()

    def _init_quant(self, num_parts: int) -> None:
        self.num_parts = num_parts
        self._quant_parts: dict[int, _Quantized] = {}

    def _load_part(self, part: int, offset: int, shard: torch.Tensor | _Quantized) -> None:
        if isinstance(shard, _Quantized):
            self._quant_parts[part] = shard
            return
        self.weight.data.narrow(0, offset, shard.shape[0]).copy_(shard)

    def _part_offsets(self) -> list[int]:
        return [0]

    def finalize_weights(self, mode: str, kernels_ready: bool) -> None:
        """Decide once how the weight is kept (module docstring of ``quant.py``)."""
        parts, self._quant_parts = self._quant_parts, {}
        out_features, in_features = self.weight.shape
        whole = len(parts) == self.num_parts
        ordered = [parts[i] for i in range(self.num_parts)] if whole else []
        if mode != "none" and kernels_ready and ordered:
            if all(isinstance(p, KQuantTensor) for p in ordered):
                self._keep_kquant(ordered)
                return
        tiles = out_features % 8 == 0 and in_features % 32 == 0
        same = whole and all(isinstance(p, QuantizedTensor) for p in ordered)
        same = same and len({p.bits for p in ordered}) == 1
        if mode != "none" and tiles and same and (kernels_ready or mode != "auto"):
            self._pack(QuantizedTensor.cat(ordered))
            return
        offsets = self._part_offsets()
        for part, quantized in parts.items():
            self._load_part(part, offsets[part], quantized.dequantize(self.weight.dtype))
        if mode in ("int8", "int4") and tiles:
            self._pack(QuantizedTensor.from_float(self.weight.data, 8 if mode == "int8" else 4))

    def _pack(self, quantized: QuantizedTensor) -> None:
        qweight, scale, mins = kernels.pack_quantized_weight(
            quantized.q, quantized.scale, quantized.mins, quantized.bits
        )
        self.in_features = quantized.shape[1]
        del self.weight
        self.register_buffer("qweight", qweight)
        self.register_buffer("qscale", scale)
        self.register_buffer("qmin", mins)
        self.bits = quantized.bits

    def _keep_kquant(self, parts: list[KQuantTensor]) -> None:
        """The file's blocks as they are: one buffer a run of parts of one type."""
        runs: list[list[KQuantTensor]] = []
        for part in parts:
            if runs and runs[-1][0].kind == part.kind:
                runs[-1].append(part)
            else:
                runs.append([part])
        self.in_features = parts[0].shape[1]
        del self.weight
        empty = torch.empty(0)
        self.register_buffer("qscale", empty)  # unused by K-quant kernels; kept for the fused op
        self.register_buffer("qmin", empty)
        kept = [KQuantTensor.cat(run) for run in runs]
        if len(kept) == 1:
            self.register_buffer("qweight", kept[0].data)
            self.bits = kept[0].kind
            return
        for i, run in enumerate(kept):
            self.register_buffer(f"qweight_{i}", run.data)
        self.segment_kinds = tuple(run.kind for run in kept)
        self.bits = MIXED

    def get_runs(self) -> list[tuple[torch.Tensor, int]]:
        """A quantized weight's (qweight, bits) per run of output columns, in column order:
        one, or one per K-quant type run when ``bits`` is ``MIXED``."""
        if self.bits == MIXED:
            return [(getattr(self, f"qweight_{i}"), k) for i, k in enumerate(self.segment_kinds)]
        return [(self.qweight, self.bits)]

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if not self.bits:
            return nn.functional.linear(x, self.weight, self.bias)
        rows = x.reshape(-1, self.in_features).float()
        bias = None if self.bias is None else self.bias.float()
        if self.bits == MIXED:
            y = torch.cat(
                [
                    kernels.quantized_linear(rows, qweight, self.qscale, self.qmin, None, kind)
                    for qweight, kind in self.get_runs()
                ],
                dim=-1,
            )
            # added after the matmul, as the single-run kernels and the fused layer add it
            y = y if bias is None else y + bias
        else:
            y = kernels.quantized_linear(
                rows, self.qweight, self.qscale, self.qmin, bias, self.bits
            )
        return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])  # also for no rows


class ColumnParallelLinear(QuantizableLinear):
    """y = x W^T (+ b), W split by output rows. ``output_sizes`` names the fused parts
    (e.g. q, k, v), each split on its own so a rank gets its slice of every part: an equal
    share, or the (start, length) rows of each part that ``shards`` gives (attention heads
    that do not divide evenly, see ``ParallelState.head_shard``)."""

    def __init__(
        self,
        in_features: int,
        output_sizes: list[int],
        parallel: ParallelState,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        shards: list[tuple[int, int]] | None = None,
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.shards = shards or [even_shard(s, parallel) for s in output_sizes]
        self.output_sizes = [length for _, length in self.shards]
        out = sum(self.output_sizes)
        self.weight = _weight(out, in_features, dtype)
        self.bias = (
            nn.Parameter(torch.empty(out, dtype=dtype), requires_grad=False) if bias else None
        )
        self._init_quant(len(output_sizes))

    def _part_offsets(self) -> list[int]:
        return [sum(self.output_sizes[:part]) for part in range(len(self.output_sizes))]

    def load(self, name: str, full: torch.Tensor | _Quantized, part: int = 0) -> None:
        offset = self._part_offsets()[part]
        start, length = self.shards[part]
        if name == "weight":
            self._load_part(part, offset, full.narrow(0, start, length))
            return
        self.bias.data.narrow(0, offset, length).copy_(full.narrow(0, start, length))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x)


class RowParallelLinear(QuantizableLinear):
    """y = all_reduce(x_shard W_shard^T): W split by input columns, an equal share or the
    (start, length) columns ``shard`` gives."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        parallel: ParallelState,
        dtype: torch.dtype = torch.float32,
        shard: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.shard = shard or even_shard(in_features, parallel)
        self.weight = _weight(out_features, self.shard[1], dtype)
        self.bias = None
        self._init_quant(1)

    def load(self, name: str, full: torch.Tensor | _Quantized, part: int = 0) -> None:
        try:
            shard = full.narrow(1, *self.shard)
        except ValueError:  # the shard splits a quantized group or block: it keeps floats
            shard = full.dequantize(self.weight.dtype).narrow(1, *self.shard)
        self._load_part(0, 0, shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.parallel.all_reduce(self._matmul(x))


class VocabParallelEmbedding(nn.Module):
    """Token rows of the vocabulary shard of this rank. A K-quant table at one rank stays in
    its blocks (``qweight``, ``kind``): the looked-up rows are dequantized per call, the same
    floats the whole table would give."""

    kind: int = 0  # a GGML K-quant type when the table is kept as blocks

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        parallel: ParallelState,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.dtype = dtype
        self.shard_size = -(-vocab_size // parallel.tp_size)
        self.vocab_start = parallel.tp_rank * self.shard_size
        # not zeroed here: a K-quant table replaces it untouched (zeroing ~vocab x hidden floats
        # only to free them cost Qwen2.5-Coder 0.9 GB of peak memory); load() fills every row
        self.weight = nn.Parameter(
            torch.empty(self.shard_size, hidden_size, dtype=dtype), requires_grad=False
        )

    def load(self, name: str, full: torch.Tensor | _Quantized, part: int = 0) -> None:
        if isinstance(full, KQuantTensor) and self.parallel.tp_size == 1:
            del self.weight
            self.register_buffer("qweight", full.data.clone())  # a copy: never the mmapped file
            self.kind = full.kind
            return
        if isinstance(full, _Quantized):  # an embedding is looked up, never multiplied
            full = full.dequantize(self.weight.dtype)
        rows = full[self.vocab_start : self.vocab_start + self.shard_size]
        self.weight.data[: rows.shape[0]].copy_(rows)
        self.weight.data[rows.shape[0] :].zero_()  # the padded vocabulary rows

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.kind:
            rows = self.qweight[token_ids.reshape(-1)]  # (T, row bytes)
            out = kquant.dequantize(rows, self.kind).to(self.dtype)
            return out.reshape(*token_ids.shape, -1)
        if self.parallel.tp_size == 1:
            return nn.functional.embedding(token_ids, self.weight)
        local = token_ids - self.vocab_start
        outside = (local < 0) | (local >= self.shard_size)
        out = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.parallel.all_reduce(out)


class ParallelLMHead(QuantizableLinear):
    """Logits over the vocabulary shard of this rank, gathered to the full vocabulary."""

    def __init__(self, vocab_size: int, hidden_size: int, parallel: ParallelState, dtype) -> None:
        super().__init__()
        self.parallel = parallel
        self.vocab_size = vocab_size
        self.shard_size = -(-vocab_size // parallel.tp_size)
        self.vocab_start = parallel.tp_rank * self.shard_size
        # not zeroed here: a quantized head never touches these ~vocab x hidden floats
        self.weight = _weight(self.shard_size, hidden_size, dtype)
        self.bias = None
        self._init_quant(1)

    def load(self, name: str, full: torch.Tensor | _Quantized, part: int = 0) -> None:
        rows = full.narrow(
            0, self.vocab_start, min(self.shard_size, full.shape[0] - self.vocab_start)
        )
        if isinstance(rows, _Quantized) and rows.shape[0] < self.shard_size:
            rows = rows.dequantize(self.weight.dtype)  # a padded last shard stays float
        if not isinstance(rows, _Quantized):
            self.weight.data[rows.shape[0] :].zero_()  # the padded vocabulary rows
        self._load_part(0, 0, rows)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self._matmul(hidden)  # (N, shard)
        return self.parallel.all_gather_last_dim(logits)[:, : self.vocab_size]


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE with a precomputed (max_position, head_dim) cos|sin table."""

    def __init__(
        self, head_dim: int, max_position: int, theta: float, scaling: RopeScaling | None
    ) -> None:
        super().__init__()
        # fp32 throughout, as Hugging Face computes it: a table computed in fp64 is more exact,
        # but at position 1,700 its angles differ from those by up to 1e-4 rad, which moves
        # Gemma 3's logits by up to 0.09; this one gives transformers' logits bit for bit.
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
        inv_freq = _scale_inv_freq(inv_freq, scaling)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # (max_position, D/2)
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
        self.register_buffer("cos_sin_cache", cache, persistent=False)
        # Every layer shares this module and the step's positions tensor: look the rows up once.
        self._positions: torch.Tensor | None = None
        self._cos_sin: torch.Tensor | None = None

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if positions is not self._positions:
            self._positions, self._cos_sin = positions, self.cos_sin_cache[positions]
        return kernels.apply_rotary(q, self._cos_sin), kernels.apply_rotary(k, self._cos_sin)


def _scale_inv_freq(inv_freq: torch.Tensor, scaling: RopeScaling | None) -> torch.Tensor:
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind != "llama3":
        raise ValueError(f"unsupported rope scaling {scaling.kind!r}")
    # Llama 3: long wavelengths slowed by ``factor``, short ones kept, a smooth ramp between.
    low_wavelen = scaling.original_max_position / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    mid = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    out = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    return torch.where((wavelen >= high_wavelen) & (wavelen <= low_wavelen), mid, out)
