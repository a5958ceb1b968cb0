"""Input checks the DSA ops share: vLLM's pool pages, the index tensors of a paged step, and
their ranges against the table and cache (host syncs: only outside CUDA-graph capture)."""

from __future__ import annotations

import torch
from torch import Tensor

INTS = (torch.int32, torch.int64)


def paged(pages: Tensor, hd: int) -> bool:
    """vLLM's pool pages [blocks, S, hd + 4] uint8: each block's S * (hd + 4) bytes together
    (S keys, then S FP32 scales), blocks at any 4-byte aligned stride."""
    return (pages.dim() == 3 and pages.dtype == torch.uint8 and pages.shape[2] == hd + 4
            and pages.stride(2) == 1 and pages.stride(1) == hd + 4
            and pages.stride(0) % 4 == 0 and pages.storage_offset() % 4 == 0)  # fmt: skip


def index_problems(**tensors: tuple[Tensor, int]) -> list[str]:
    """name=(tensor, dims): each an int32 / int64 tensor of `dims` dimensions, its last one
    contiguous."""
    return [
        f"{name}: {tuple(x.shape)} {x.dtype}, expected {dims}-D int"
        for name, (x, dims) in tensors.items()
        if x.dim() != dims or x.dtype not in INTS or x.stride(-1) != 1
    ]


def table_problems(request: Tensor, block_table: Tensor, blocks: int) -> list[str]:
    """Each row's request a row of the block table, every block one of the cache's `blocks`
    (reads the values: call outside capture)."""
    problems = []
    if request.numel() and (request.min() < 0 or request.max() >= block_table.shape[0]):
        problems.append(f"request: outside 0..{block_table.shape[0] - 1}")
    if block_table.numel() and (block_table.min() < 0 or block_table.max() >= blocks):
        problems.append(f"block_table: a block outside 0..{blocks - 1}")
    return problems
