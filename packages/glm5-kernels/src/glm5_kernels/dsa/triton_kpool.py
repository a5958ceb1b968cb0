"""Triton kernel of the indexer's pool write (`kpool_ref.kpool_write_ref`'s contract).

`kpool_write_kernel`: a CTA per token row. It rotates the row's indexer queries (every head
times the Hadamard matrix on the tensor cores, FP32 sums rounded to BF16 as the reference's
matmul output) and casts them to FP8 with one power-of-two scale a head. If the token
completes a pool, it gathers the pool's members — this step's rows for tokens of this step,
the request's ring for earlier ones — forms the gated softmax pool over them (channel by
channel, plus the learned per-slot bias), rotates and casts it the same way into the pool's
slot of vLLM's pages.
Last, its own key and gate score go to the ring (no row of the step reads that slot: the
ring holds kpool + drafts tokens). A request whose ring row is -1 (vLLM's padding and dummy
requests) writes neither.

RAW: the step's keys and gate scores arrive as a projection's FP32 sums (the indexer's one
projection over wk | gate | weights_proj): each is rounded to BF16 as a BF16 GEMM's output,
and the key then LayerNormed in FP32 (affine) and rounded, as vLLM's key norm does, wherever
the kernel reads a row of the step (its own, or a pool member's).
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from glm5_kernels.dsa.triton_attn import _dot
from glm5_kernels.triton_primitives import round_bf16, round_nearest

FP8_MAX = tl.constexpr(448.0)


@triton.jit
def _rotate_quant(x, sign, had_scale, INTERPRETER: tl.constexpr):
    """x [M, HD] BF16 values -> (e4m3 codes of bf16(x @ had) / scale, the power-of-two scales
    [M]: 2^ceil(log2(max(amax, 1e-4) / 448)), from the bits, exact).

    had = sign * had_scale: the ±1 matrix makes every product exact, so the BF16 tensor cores
    sum them in FP32 and one multiply scales (an FP32 `tl.dot` of the [HD, HD] matrix took
    ~160 µs a call on the H200, 20x this); this differs from the reference's FP32 matmul only
    in FP32 rounding, below the BF16 rounding that follows."""
    y = round_bf16(_dot(x.to(tl.bfloat16), sign, INTERPRETER) * had_scale, INTERPRETER)
    amax = tl.maximum(tl.max(tl.abs(y), axis=1), 1e-4)
    if INTERPRETER:  # noqa: SIM108 (a constexpr branch: only one side is compiled)
        v = amax / FP8_MAX
    else:
        v = tl.math.div_rn(amax, FP8_MAX)  # IEEE, as the reference divides
    bits = v.to(tl.int32, bitcast=True)
    scale = ((bits + 0x7FFFFF) & 0x7F800000).to(tl.float32, bitcast=True)
    xq = tl.minimum(tl.maximum(y / scale[:, None], -FP8_MAX), FP8_MAX)  # a power of two: exact
    if INTERPRETER:
        xq = round_nearest(xq, 3, -6)  # e4m3: subnormals below 2^-6
    return xq.to(tl.float8e4nv), scale


@triton.jit
def _key(x, w, b, eps, HD: tl.constexpr, RAW: tl.constexpr, INTERPRETER: tl.constexpr):
    """Rows x [M, HD] of the step's keys -> BF16 values in FP32: as they are, or (RAW) the
    FP32 sums rounded to BF16, then LayerNormed in FP32 with weight w / bias b and rounded."""
    if RAW:
        x = round_bf16(x, INTERPRETER)
        mean = tl.sum(x, axis=1) / HD
        c = x - mean[:, None]
        rstd = tl.math.div_rn(1.0, tl.sqrt_rn(tl.sum(c * c, axis=1) / HD + eps))
        x = round_bf16(c * rstd[:, None] * w[None, :] + b[None, :], INTERPRETER)
    return x.to(tl.float32)


@triton.jit
def kpool_write_kernel(
    k_ptr, g_ptr, q_ptr, tail_ptr, page_ptr, pscale_ptr, ape_ptr, sign_ptr, nw_ptr, nb_ptr,
    bt_ptr, pos_ptr, trow_ptr, q8_ptr, qs_ptr,
    T, ring, S, stride_pb, block_size, had_scale, eps,
    stride_k, stride_g, stride_qn, stride_qh, stride_tr, stride_tc, stride_bt,
    IH: tl.constexpr, H: tl.constexpr, HD: tl.constexpr, KP: tl.constexpr,
    RAW: tl.constexpr, INTERPRETER: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0)
    r = n // T
    d = tl.arange(0, HD)
    # The weights first: they do not depend on the previous kernel.
    sign = tl.load(sign_ptr + d[:, None] * HD + d[None, :])  # the Hadamard matrix's signs
    nw, nb = d * 0.0, d * 0.0  # the key norm (RAW)
    if RAW:
        nw, nb = tl.load(nw_ptr + d).to(tl.float32), tl.load(nb_ptr + d).to(tl.float32)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    pos = tl.load(pos_ptr + n).to(tl.int64)
    start = tl.load(pos_ptr + r * T).to(tl.int64)  # the request's first token this step
    trow = tl.load(trow_ptr + r).to(tl.int64)
    h = tl.arange(0, IH)
    hm = h < H  # IH: the heads padded to the MMA's 16 rows
    q = tl.load(q_ptr + n * stride_qn + h[:, None] * stride_qh + d[None, :], mask=hm[:, None],
                other=0.0)  # fmt: skip
    q8, qs = _rotate_quant(q, sign, had_scale, INTERPRETER)
    tl.store(q8_ptr + (n * H + h[:, None]) * HD + d[None, :], q8, mask=hm[:, None])
    tl.store(qs_ptr + n * H + h, qs, mask=hm)
    live = trow >= 0  # a padding request (ring row -1) writes nothing
    if live & ((pos + 1) % KP == 0):
        j = tl.arange(0, KP)
        m = pos - KP + 1 + j  # the pool's tokens
        mine = (m >= start)[:, None]
        row = n - (pos - m)  # this step's row of token m
        ring_at = trow * stride_tr + (m % ring) * HD
        own = _key(tl.load(k_ptr + row[:, None] * stride_k + d[None, :], mask=mine, other=0.0),
                   nw, nb, eps, HD, RAW, INTERPRETER)  # fmt: skip
        kk = tl.where(mine, own, tl.load(tail_ptr + ring_at[:, None] + d[None, :], mask=~mine))
        gate_at = tail_ptr + stride_tc + ring_at[:, None] + d[None, :]  # the ring's gate half
        own = tl.load(g_ptr + row[:, None] * stride_g + d[None, :], mask=mine, other=0.0)
        gg = tl.where(mine, round_bf16(own.to(tl.float32), INTERPRETER),
                      tl.load(gate_at, mask=~mine).to(tl.float32))  # fmt: skip
        ape = tl.load(ape_ptr + j[:, None] * HD + d[None, :]).to(tl.float32)
        logits = gg + ape  # softmax over the pool's tokens, channel by channel
        p = tl.exp(logits - tl.max(logits, axis=0)[None, :])
        p = p / tl.sum(p, axis=0)[None, :]
        pooled = round_bf16(tl.sum(p * kk, axis=0), INTERPRETER)
        tile = tl.where((tl.arange(0, 16) == 0)[:, None], pooled[None, :], 0.0)  # [16, HD]
        y8, ys = _rotate_quant(tile, sign, had_scale, INTERPRETER)
        first = pos - KP + 1
        block = tl.load(bt_ptr + r * stride_bt + first // block_size).to(tl.int64)
        slot = (first % block_size) // KP
        page = block * stride_pb  # S keys of HD bytes, then S FP32 scales
        top = tl.arange(0, 16)[:, None] == 0
        tl.store(page_ptr + page + slot * HD + (d[None, :] + tl.zeros([16, 1], tl.int64)),
                 y8.to(tl.uint8, bitcast=True), mask=top)  # fmt: skip
        tl.store(pscale_ptr + (page + S * HD) // 4 + slot + tl.arange(0, 16), ys,
                 mask=tl.arange(0, 16) == 0)  # fmt: skip
    if live:
        at = trow * stride_tr + (pos % ring) * HD + d[None, :]
        key = _key(tl.load(k_ptr + n * stride_k + d[None, :]), nw, nb, eps, HD, RAW, INTERPRETER)
        tl.store(tail_ptr + at, key.to(tl.bfloat16))
        gate = tl.load(g_ptr + n * stride_g + d[None, :]).to(tl.float32)
        tl.store(tail_ptr + stride_tc + at, round_bf16(gate, INTERPRETER).to(tl.bfloat16))
