"""A plain streaming read: each program sums its contiguous share of a flat tensor. It moves
the tensor's bytes once with no reuse and nothing else, which makes it the yardstick of what
HBM delivers to a kernel on this GPU (`timing.hbm_bandwidth`'s "stream",
`benchmarks/read_ceiling.py`). Reference: the tensor's FP32 sum
(`torch.sum(x, dtype=torch.float32)`), to FP32 accumulation error.

Under programmatic dependent launch (`pdl`), each call releases its successor at entry;
1 ("dependent") waits for its predecessor before reading, as a GEMM must; 2 ("independent")
waits only before its store, as a kernel whose reads need nothing from its predecessor (a
weight prefetch) could."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

__all__ = ["stream_sum"]


@triton.jit
def _stream_sum_kernel(x_ptr, out_ptr, n, per_program, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
    if PDL == 1:
        gdc_wait()
    start = tl.program_id(0).to(tl.int64) * per_program
    acc = tl.zeros((BLOCK,), tl.float32)
    for off in range(0, per_program, BLOCK):
        idx = start + off + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + idx, mask=idx < n, other=0.0).to(tl.float32)
    if PDL == 2:
        gdc_wait()
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc))


def stream_sum(
    x: torch.Tensor,
    programs: int,
    block: int = 2048,
    out: torch.Tensor | None = None,
    pdl: int = 0,
) -> torch.Tensor:
    """x (contiguous) -> FP32 partial sums [P], P <= `programs`, each of a contiguous slice of
    whole `block`s; their sum is x's. `out`: a buffer of at least P (so a captured call
    allocates nothing). `pdl`: 0 off, 1 dependent, 2 independent (the module docstring)."""
    if not x.is_contiguous():
        raise ValueError("stream_sum reads a contiguous tensor")
    per = triton.cdiv(triton.cdiv(x.numel(), programs), block) * block
    grid = triton.cdiv(x.numel(), per)
    out = torch.empty(grid, dtype=torch.float32, device=x.device) if out is None else out[:grid]
    _stream_sum_kernel[(grid,)](
        x, out, x.numel(), per, BLOCK=block, PDL=pdl, num_warps=8, launch_pdl=pdl > 0
    )
    return out
