"""The token embedding of one vocab-parallel shard: `Embedding`, the contract of `embed_ref`
(`triton_embed`: a CTA per token row and column block). Stock, the masked lookup is about
eight kernels (the id shift, two compares, their and, the clamp, the gather, the mask's
cast and multiply); here it is one launch."""

from __future__ import annotations

import torch
from torch import Tensor

from glm5_kernels.launch import next_pow2, use_pdl

__all__ = ["Embedding", "embed_ref"]

BD = 1024  # columns a CTA copies (a 4096-wide row: four CTAs)


def embed_ref(ids: Tensor, table: Tensor, start: int) -> Tensor:
    """ids [...] integer token ids, table [V, D] (the shard's rows: ids start .. start + V - 1)
    -> [..., D] in the table's dtype: each id's row, zeros for ids outside the shard (its
    partial of the vocab-parallel embedding, summed over the shards by the all-reduce)."""
    local = ids.long() - start
    inside = (local >= 0) & (local < table.shape[0])
    rows = table[local.clamp(0, table.shape[0] - 1)]
    return torch.where(inside[..., None], rows, torch.zeros((), dtype=table.dtype))


class Embedding:
    """A vocab-parallel shard's embedding rows `table` [V, D] (BF16, rows contiguous), holding
    token ids `start` .. `start + V - 1`; steps of up to `max_tokens` ids."""

    def __init__(self, table: Tensor, start: int, *, max_tokens: int = 64):
        problems = []
        if table.dim() != 2 or table.dtype != torch.bfloat16 or table.stride(-1) != 1:
            problems.append(f"table: {tuple(table.shape)} {table.dtype}, expected [V, D] "
                            "bfloat16, rows contiguous")  # fmt: skip
        if not isinstance(start, int) or start < 0:
            problems.append(f"start={start!r}: a non-negative token id expected")
        if problems:
            raise ValueError("Embedding: " + "; ".join(problems))
        self.table, self.start, self.max_tokens = table, start, max_tokens
        self.rows, self.dim = table.shape
        self._pdl = use_pdl(table.device)

    def supports(self, tokens: int) -> bool:
        return 1 <= tokens <= self.max_tokens

    def prepare(self, tokens=None) -> None:
        """Compile the kernel (one specialization) before any CUDA-graph capture."""
        self(torch.zeros(1, dtype=torch.int64, device=self.table.device))

    def __call__(self, ids: Tensor, out: Tensor | None = None) -> Tensor:
        """ids [...] int32 / int64 on the table's device -> [..., D] BF16 (`embed_ref`),
        written into `out` [N, D] (rows contiguous) when given."""
        from glm5_kernels.embed.triton_embed import embed_kernel

        problems = []
        if ids.dtype not in (torch.int32, torch.int64):
            problems.append(f"ids: {ids.dtype}, expected int32 or int64")
        if ids.device != self.table.device:
            problems.append(f"ids on {ids.device}, the table on {self.table.device}")
        n = ids.numel()
        if not self.supports(n):
            problems.append(f"{n} ids: this op takes 1..{self.max_tokens}")
        if out is not None and (out.shape != (n, self.dim) or out.dtype != torch.bfloat16
                                or out.stride(-1) != 1 or out.stride(0) != self.dim):  # fmt: skip
            problems.append(f"out: {tuple(out.shape)} {out.dtype}, expected [{n}, {self.dim}] "
                            "bfloat16, rows contiguous")  # fmt: skip
        if problems:
            raise ValueError("Embedding: " + "; ".join(problems))
        flat = ids.reshape(n)
        if out is None:
            out = torch.empty(n, self.dim, dtype=torch.bfloat16, device=self.table.device)
        bd = min(BD, next_pow2(self.dim))
        embed_kernel[(n, -(-self.dim // bd))](
            flat, self.table, out, flat.stride(0), self.table.stride(0), self.start, self.rows,
            self.dim, BD=bd, PDL=self._pdl, num_warps=4, launch_pdl=self._pdl,
        )  # fmt: skip
        return out.view(*ids.shape, self.dim)
