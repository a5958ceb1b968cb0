"""The vocab-parallel embedding in one launch (`embedding.Embedding`): a CTA per (token row,
block of columns) reads its id and copies the shard's row, or writes zeros where the id is
another shard's. Under PDL it waits before reading the id (the step's inputs) and releases
its dependents once its loads are issued."""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def embed_kernel(
    ids_ptr,  # [N] int32 / int64, stride stride_i
    table_ptr,  # [V, D] BF16, row stride stride_t: ids start .. start + V - 1
    out_ptr,  # [N, D] BF16 out, rows contiguous
    stride_i, stride_t, start, V, D,
    BD: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    if PDL:
        gdc_wait()
    local = tl.load(ids_ptr + row * stride_i).to(tl.int64) - start
    at = out_ptr + row * D + cols
    if (local >= 0) & (local < V):
        values = tl.load(table_ptr + local * stride_t + cols, mask=cols < D, other=0.0)
        if PDL:
            gdc_launch_dependents()
        tl.store(at, values, mask=cols < D)
    else:
        if PDL:
            gdc_launch_dependents()
        tl.store(at, tl.zeros([BD], dtype=tl.bfloat16), mask=cols < D)
