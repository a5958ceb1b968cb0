"""Triton kernel of the KDA decode step: short conv, forget gate, beta, L2-normed q / k, the
gated delta rule on the FP32 state and the gated RMSNorm, in one launch.

A CTA per (request, head) holds the head's state [V, K] in registers for the whole step:
loaded once from the request's read slot, updated token by token, stored after each token
to its write slot (a verify keeps every token's state: vLLM's rollback layout) or only
after the last (a decode). Per token it convolves the head's q / k / v channels over the
W-1 conv-state columns at the request's offset and the step's inputs (BF16 out, as the
model rounds), then

    S = diag(exp g) S;  S += beta (v - S k) k^T;  o = S q;  out = w * rmsnorm(o) * sigmoid(gate)

(S is [V, K]: each row of V evolves on its own). Last, the conv state: a decode overwrites
its window, a verify stores its W-2+T newest inputs from column 0 (accepting n resumes at
column n - 1): its sources are loaded before the recurrence and stored after one barrier.
The inputs are the projections' outputs read as strided rows (vLLM's fused
q | k | v | ... rows need no copy).
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from glm5_kernels.gemm.triton_skinny import _bf16, _narrow
from glm5_kernels.moe.triton_moe import _sigmoid


@triton.jit
def _conv_row(conv_row_ptr, qkv_ptr, i, c, offset, stride_cc, stride_qkv, row0,
              W: tl.constexpr):  # fmt: skip
    """Row i of the step's sequence (the W-1 conv-state columns, then the step's inputs),
    channels c, as loaded (BF16)."""
    if i < W - 1:
        return tl.load(conv_row_ptr + (offset + i) * stride_cc + c)
    else:
        return tl.load(qkv_ptr + (row0 + i - (W - 1)) * stride_qkv + c)


@triton.jit
def _conv(conv_row_ptr, qkv_ptr, w_ptr, t, c, offset, stride_cc, stride_qkv, row0,
          W: tl.constexpr, INTERPRETER: tl.constexpr):  # fmt: skip
    """silu(sum_j w[c, j] x[t + j, c]) in FP32, rounded to BF16 (short_conv_ref)."""
    acc = tl.zeros(c.shape, tl.float32)
    for j in tl.static_range(W):
        x = _conv_row(conv_row_ptr, qkv_ptr, t + j, c, offset, stride_cc, stride_qkv, row0, W)
        acc += tl.load(w_ptr + c * W + j).to(tl.float32) * x.to(tl.float32)
    return _bf16(acc * _sigmoid(acc, INTERPRETER), INTERPRETER)


@triton.jit
def _window(conv_row_ptr, qkv_ptr, cols, shift, n, c, offset, stride_cc, stride_qkv, row0,
            W: tl.constexpr):  # fmt: skip
    """Rows cols + shift of the step's sequence, channels c: [len(cols), len(c)] (cols >= n
    masked), one 2-D load."""
    i = cols[:, None] + shift
    ptr = tl.where(i < W - 1, conv_row_ptr + (offset + i) * stride_cc + c[None, :],
                   qkv_ptr + (row0 + i - (W - 1)) * stride_qkv + c[None, :])  # fmt: skip
    return tl.load(ptr, mask=(cols[:, None] < n) & (c[None, :] >= 0))


@triton.jit
def _store_state(rec_ptr, slot, stride_rs, state_at, s, V: tl.constexpr, K: tl.constexpr):
    """The state to its slot; slot -1: not stored."""
    keep = (tl.zeros([V, K], tl.int64) + slot) >= 0
    tl.store(rec_ptr + slot * stride_rs + state_at, s, mask=keep)


@triton.jit
def kda_decode_kernel(
    qkv_ptr, f_ptr, b_ptr, gate_ptr, out_ptr,  # token rows r * T + t
    conv_ptr, rec_ptr,  # caches, updated in place
    conv_w_ptr, dt_bias_ptr, a_log_ptr, norm_w_ptr,
    conv_slot_ptr, conv_off_ptr, read_slot_ptr, write_slot_ptr,
    stride_qkv, stride_f, stride_b, stride_g, stride_out, stride_cs, stride_cc, stride_rs,
    H, q_scale, lower_bound, eps,
    T: tl.constexpr, K: tl.constexpr, V: tl.constexpr, W: tl.constexpr, NCP: tl.constexpr,
    KEEP: tl.constexpr, HAS_LB: tl.constexpr, INTERPRETER: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    r, h = tl.program_id(0), tl.program_id(1)
    kk, vv = tl.arange(0, K), tl.arange(0, V)
    cq, ck, cv = h * K + kk, H * K + h * K + kk, 2 * H * K + h * V + vv
    # The head's small weights first: they do not depend on the previous kernel.
    a = tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
    dt = tl.load(dt_bias_ptr + h * K + kk).to(tl.float32)
    norm_w = tl.load(norm_w_ptr + vv).to(tl.float32)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    conv_row = conv_ptr + tl.load(conv_slot_ptr + r).to(tl.int64) * stride_cs
    offset = tl.load(conv_off_ptr + r)
    row0 = r * T
    state_at = h * (V * K) + vv[:, None] * K + kk[None, :]
    s = tl.load(rec_ptr + tl.load(read_slot_ptr + r).to(tl.int64) * stride_rs + state_at)
    # The conv state's new columns, loaded now and stored last (after a barrier: a column
    # written may be one another thread still reads). Column j of the new window is row
    # j + shift of the sequence: a verify keeps its W-2+T newest rows from column 0, a
    # decode moves its window at the offset on by T.
    cols = tl.arange(0, NCP)
    if KEEP:
        n_cols, shift, dst = W - 2 + T, 1, cols
    else:
        n_cols, shift, dst = W - 1, T, offset + cols
    new_q = _window(conv_row, qkv_ptr, cols, shift, n_cols, cq, offset, stride_cc, stride_qkv,
                    row0, W)  # fmt: skip
    new_k = _window(conv_row, qkv_ptr, cols, shift, n_cols, ck, offset, stride_cc, stride_qkv,
                    row0, W)  # fmt: skip
    new_v = _window(conv_row, qkv_ptr, cols, shift, n_cols, cv, offset, stride_cc, stride_qkv,
                    row0, W)  # fmt: skip

    for t in tl.static_range(T):
        row = row0 + t
        q = _conv(conv_row, qkv_ptr, conv_w_ptr, t, cq, offset, stride_cc, stride_qkv, row0, W,
                  INTERPRETER)  # fmt: skip
        k = _conv(conv_row, qkv_ptr, conv_w_ptr, t, ck, offset, stride_cc, stride_qkv, row0, W,
                  INTERPRETER)  # fmt: skip
        v = _conv(conv_row, qkv_ptr, conv_w_ptr, t, cv, offset, stride_cc, stride_qkv, row0, W,
                  INTERPRETER)  # fmt: skip
        # L2 norms with the eps inside the root; q also scaled by K^-1/2.
        q = q / tl.sqrt_rn(tl.sum(q * q, axis=0) + 1e-6) * q_scale
        k = k / tl.sqrt_rn(tl.sum(k * k, axis=0) + 1e-6)
        f = tl.load(f_ptr + row * stride_f + h * K + kk).to(tl.float32) + dt
        if HAS_LB:  # the safe gate: each step decays by at most exp(lower_bound)
            g = lower_bound * _sigmoid(a * f, INTERPRETER)
        else:  # -a * softplus(f), linear above 20 as torch's
            g = -a * tl.where(f > 20.0, f, tl.log(1.0 + tl.exp(tl.minimum(f, 20.0))))
        beta = _sigmoid(tl.load(b_ptr + row * stride_b + h).to(tl.float32), INTERPRETER)
        s = s * tl.exp(g)[None, :]
        delta = (v - tl.sum(s * k[None, :], axis=1)) * beta
        s = s + delta[:, None] * k[None, :]
        o = _bf16(tl.sum(s * q[None, :], axis=1), INTERPRETER)  # the model dtype
        if KEEP:
            slot = tl.load(write_slot_ptr + r * T + t).to(tl.int64)
            _store_state(rec_ptr, slot, stride_rs, state_at, s, V, K)
        gate = tl.load(gate_ptr + row * stride_g + h * V + vv).to(tl.float32)
        normed = o / tl.sqrt_rn(tl.sum(o * o, axis=0) / V + eps)
        y = norm_w * normed * _sigmoid(gate, INTERPRETER)
        tl.store(out_ptr + row * stride_out + h * V + vv, _narrow(y, tl.bfloat16, INTERPRETER))
    if not KEEP:
        slot = tl.load(write_slot_ptr + r * T + T - 1).to(tl.int64)
        _store_state(rec_ptr, slot, stride_rs, state_at, s, V, K)

    tl.debug_barrier()
    at = conv_row + dst[:, None] * stride_cc
    keep_cols = cols[:, None] < n_cols
    tl.store(at + cq[None, :], new_q, mask=keep_cols & (cq[None, :] >= 0))
    tl.store(at + ck[None, :], new_k, mask=keep_cols & (ck[None, :] >= 0))
    tl.store(at + cv[None, :], new_v, mask=keep_cols & (cv[None, :] >= 0))
