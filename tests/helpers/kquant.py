"""Random GGUF K-quant weights for tests: any bytes, with finite small fp16 block scales."""

import torch

from agentx.kernels.ref import kquant


def random_blocks(n: int, k: int, kind: int, seed: int = 0, scale: float = 0.02) -> torch.Tensor:
    """Random K-quant rows (N, K/256 * block bytes) with finite, small fp16 scales."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = k // kquant.BLOCK
    raw = torch.randint(0, 256, (n, num_blocks, kquant.block_bytes(kind)), generator=gen)
    raw = raw.to(torch.uint8)

    def scales() -> torch.Tensor:
        d = (torch.rand(n, num_blocks, 1, generator=gen) * scale).half()
        return d.view(torch.uint8)  # (N, B, 2)

    if kind == kquant.Q4_K:
        raw[..., 0:2], raw[..., 2:4] = scales(), scales()
    else:
        raw[..., 208:210] = scales()
    return raw.reshape(n, -1)
