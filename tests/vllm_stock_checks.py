"""The vLLM-kernel stock's checks, shared by its CPU tests (tests/glm5_vllm/test_vllm_stock.py,
vLLM's kernels interpreted) and its GPU tests (tests/glm5_runtime/test_vllm_stock_gpu.py): each
vLLM call against the reference on the same inputs, with bounds from the roundings.

Bounds (a BF16 value x is one ulp <= 2^-7 |x| from its neighbours):
- token quantization: vLLM's per-token 1x128 FP8 rule (`vllm_quant`), code for code. Its
  scale is amax * (1/448) where the reference's `quantize_tokens_fp8_ref` divides by 448: one
  FP32 ulp apart at times, which moves every code at an e4m3 midpoint (frequent for BF16
  inputs; ~1% relative L2 on random tokens), so the experts are held to the reference's FP8
  numerics with vLLM's rule.
- experts: relative L2 2^-6 against `stock_experts` with each input and SwiGLU quantized by
  `vllm_quant`, as for the library stock: the GEMMs accumulate in another order (a gate_up
  output one BF16 ulp apart may move its SwiGLU's code one e4m3 step, 2^-4 relative at that
  element) and vLLM rounds each route's weighted output to BF16 (2^-8) before the sum; few
  elements move a step, so 2^-6 in relative L2.
- KDA conv: FP32 products (GLM's conv weights are FP32, in vLLM too; a BF16 weight would
  round each product to BF16 in the kernel, emulated so) summed in FP32: against FP64, one
  BF16 ulp (the output's rounding). The conv cache holds raw inputs: bit-equal to the
  reference's.
- KDA recurrence and gated norm, from vLLM's conv output: FP32 in both but for op order and
  the GPU's exp (~2^-22), so the states within 2^-16 of their largest; the output o is
  rounded to BF16 in both (a flip: 2^-7 of that element, and of its head's RMS), then normed
  and rounded again (2^-7): 2^-5 of each element.
- mHC pre (`vllm_mhc.mhc_pre`), against FP64: the pre gate (vLLM's kernel, recomputed on the
  call's inputs), post and comb are FP32 on both sides, the same math in another
  association (vLLM scales the mix GEMM by rstd where the reference normalizes first, and
  sums in another order): each within 2x the reference's own worst error against FP64 (what
  FP32 makes of this math on these inputs), plus 2^-20 (8 FP32 ulps of 1; the values are
  <= 2) for where the reference happens to land near the truth. The
  collapse from vLLM's pre, bounded by its roundings alone: FP32 products and three sums,
  each within 2^-24 of the running sum of |pre * stream| (<= 2^-22 of it in all, taken
  twice for the rounding of a value that far off), then one BF16 rounding (half an ulp:
  <= 2^-8 of the value)."""

import inspect
from contextlib import contextmanager
from functools import partial

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from glm5_kernels.kda import gated_rms_norm_ref, kda_decode_ref, kda_gate_ref, kda_recurrence_ref
from glm5_kernels.mhc import hc_mix_ref
from glm5_kernels.quant import quantize_fp8_block_ref
from glm5_runtime import vllm_mhc, vllm_stock
from glm5_runtime.reference.stages import Placement, stock_experts


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@contextmanager
def exact_interpreter():
    """Triton's interpreter with a GPU's FP32 -> BF16 / FP16 / e4m3 narrowing (nearest-even)
    and BF16 binary arithmetic (in FP32, rounded to BF16). The interpreter narrows BF16 by
    truncating and e4m3 by rounding half up with a carry that can halve the value
    (124.3 -> 64), and runs BF16 arithmetic on the raw uint16 bits: glm5-kernels' own
    kernels round explicitly under it, vLLM's cannot be edited."""
    import triton.language as tl
    from triton._C.libtriton import ir
    from triton.runtime import interpreter

    narrow = {tl.bfloat16: (torch.bfloat16, torch.int16, np.uint16),
              tl.float16: (torch.float16, torch.int16, np.uint16),
              tl.float8e4nv: (torch.float8_e4m3fn, torch.uint8, np.uint8)}  # fmt: skip
    convert, binary = interpreter._convert_float, interpreter.InterpreterBuilder.binary_op

    def to(x32: np.ndarray, dtype) -> np.ndarray:
        target, bits, np_bits = narrow[dtype]
        t = torch.from_numpy(np.ascontiguousarray(x32, dtype=np.float32).copy())
        return t.to(target).view(bits).numpy().view(np_bits)

    def exact_convert(data, src, dst, rounding):
        if src == tl.float32 and dst in narrow and rounding != ir.ROUNDING_MODE.RTZ:
            return to(np.frombuffer(data.tobytes(), np.float32), dst).reshape(data.shape)
        return convert(data, src, dst, rounding)

    def exact_binary(self, lhs, rhs, op):
        if lhs.dtype.scalar == tl.bfloat16 and rhs.dtype.scalar == tl.bfloat16:
            f32 = [(np.asarray(h.data).astype(np.uint32) << 16).view(np.float32)
                   for h in (lhs, rhs)]  # fmt: skip
            out = op(*f32)
            if out.dtype == np.float32:
                bits = to(out, tl.bfloat16).reshape(out.shape)
                return interpreter.TensorHandle(bits, tl.bfloat16)
        return binary(self, lhs, rhs, op)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(interpreter, "_convert_float", exact_convert)
        m.setattr(interpreter.InterpreterBuilder, "binary_op", exact_binary)
        yield


def vllm_quant(x: torch.Tensor, ue8m0: bool = False) -> torch.Tensor:
    """x [N, K] -> FP32 values of vLLM's per-token 1x128 FP8 quantization: scale amax *
    (1/448), UE8M0 as exp2(ceil(log2(scale)))."""
    groups = x.float().view(x.shape[0], -1, 128)
    scale = groups.abs().amax(-1).clamp_min(1e-10) * torch.tensor(1 / 448.0, device=x.device)
    if ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (groups / scale[..., None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return (q.float() * scale[..., None]).view(x.shape)


def experts_case(tokens, experts, top_k, d, inter, gen, *, ue8m0=False, scale=1.0):
    """x, w13, s13, w2, s2, ids, weights of one routed-experts call on gen's device."""
    dev = gen.device

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=dev)

    x = randn(tokens, d).bfloat16()
    w13, s13 = quantize_fp8_block_ref(scale * randn(experts, 2 * inter, d) / d**0.5, ue8m0=ue8m0)
    w2, s2 = quantize_fp8_block_ref(randn(experts, d, inter) / inter**0.5, ue8m0=ue8m0)
    ids = torch.stack(
        [torch.randperm(experts, generator=gen, device=dev)[:top_k] for _ in range(tokens)]
    )
    weights = torch.rand(tokens, top_k, generator=gen, device=dev) * 2.5
    return x, w13, s13, w2, s2, ids, weights


def check_experts(x, w13, s13, w2, s2, ids, weights, limit, ue8m0, out):
    """vLLM's experts' output against the reference's FP8 numerics (with vLLM's token
    quantization) on the same inputs -> the reference's."""
    want = stock_experts(x, w13, w2, ids.long(), weights, limit, s13, s2,
                         partial(vllm_quant, ue8m0=ue8m0))  # fmt: skip
    assert out.dtype == torch.bfloat16 and out.shape == want.shape
    assert torch.isfinite(out).all()
    assert rel(out, want) < 2.0**-6, rel(out, want)
    return want


def kda_case(requests, q, gen, h=4, kd=16, width=4):
    """One KDA step's core inputs and placement on gen's device (request i owns slots
    1 + i*q ..; a verify resumes from a random accepted token)."""
    c, dev = 3 * h * kd, gen.device

    def randn(*shape, s=1.0):
        return torch.randn(*shape, generator=gen, device=dev) * s

    def long(x):
        return torch.as_tensor(x, device=dev).long()

    verify = q > 1
    owned = 1 + torch.arange(requests * q, device=dev).view(requests, q)
    accepted = torch.randint(1, q + 1, (requests,), generator=gen, device=dev) if verify else None
    rows = torch.arange(requests, device=dev)
    step = Placement(
        positions=long(torch.zeros(requests, q)), slots=owned,
        block_table=long(torch.zeros(requests, 1)),
        read_slots=owned[rows, accepted - 1] if verify else owned[:, 0],
        write_slots=owned if verify else owned[:, :1], conv_slots=owned[:, 0],
        conv_offset=accepted - 1 if verify else long(torch.zeros(requests)),
        tail_rows=long(torch.zeros(requests)), block_size=16, keep_states=verify,
    )  # fmt: skip
    args = dict(
        mixed=randn(requests, q, c).bfloat16(), f=randn(requests, q, h * kd).bfloat16(),
        b=randn(requests, q, h).bfloat16(), gate=randn(requests, q, h * kd).bfloat16(),
        conv=randn(1 + requests * q, width - 2 + q, c).bfloat16(),
        recurrent=randn(1 + requests * q, h, kd, kd, s=0.1),
        conv_weight=randn(c, width, s=width**-0.5), dt_bias=randn(h * kd, s=0.5),
        A_log=randn(h, s=0.5), norm_weight=(1 + randn(kd, s=0.1)).bfloat16(),
        lower_bound=-5.0,
    )  # fmt: skip
    return args, step


def check_kda(args: dict, conv_out, out, conv_after, rec_after, step: Placement):
    """One vLLM KDA core call (its inputs `args` as they were, its conv's output, its
    output, the caches after) against the reference on the same inputs (module docstring)."""
    mixed, conv, rec = args["mixed"], args["conv"], args["recurrent"]
    r, t, c = mixed.shape
    h = args["A_log"].shape[0]
    kd, vd = args["f"].shape[-1] // h, args["gate"].shape[-1] // h
    keep = step.keep_states and t > 1
    # The conv in FP64 (a BF16 weight's products rounded to BF16, as the kernel's are).
    w = args["conv_weight"]
    window = step.conv_offset[:, None] + torch.arange(w.shape[1] - 1, device=mixed.device)
    full = torch.cat([conv[step.conv_slots[:, None], window], mixed], 1).double()
    taps = [full[:, j : j + t] * w[:, j].double() for j in range(w.shape[1])]
    if w.dtype == torch.bfloat16:
        taps = [tap.float().bfloat16().double() for tap in taps]
    want = F.silu(sum(taps))
    y = conv_out.reshape(r, t, c)
    assert ((y.double() - want).abs() <= 2.0**-7 * want.abs() + 1e-30).all()
    # The conv cache: the reference's update, bit for bit.
    ref_conv = conv.clone()
    kda_decode_ref(
        mixed, args["f"], args["b"], args["gate"], ref_conv, rec.clone(), args["conv_weight"],
        args["dt_bias"], args["A_log"], args["norm_weight"], conv_slots=step.conv_slots,
        conv_offset=step.conv_offset, read_slots=step.read_slots,
        write_slots=step.write_slots, keep=keep, lower_bound=args["lower_bound"], eps=1e-5,
    )  # fmt: skip
    assert torch.equal(conv_after, ref_conv)
    # The recurrence and gated norm from vLLM's conv output.
    q, k, v = y.split([h * kd, h * kd, h * vd], dim=-1)
    g = kda_gate_ref(args["f"].reshape(r * t, -1), args["dt_bias"], args["A_log"],
                     args["lower_bound"]).reshape(r, t, h, kd)  # fmt: skip
    beta = torch.sigmoid(args["b"].float())
    ref_rec, o = rec.clone(), []
    for i in range(r):
        state = rec[step.read_slots[i]].transpose(-1, -2)  # [H, K, V]
        oi, final, states = kda_recurrence_ref(
            q[i].reshape(t, h, kd), k[i].reshape(t, h, kd), v[i].reshape(t, h, vd), g[i],
            beta[i], state, all_states=keep,
        )  # fmt: skip
        for j in range(t) if keep else [t - 1]:
            slot = int(step.write_slots[i, j])
            if slot > 0:  # vLLM's null slot 0 is never written
                ref_rec[slot] = (states[j] if keep else final).transpose(-1, -2)
        o.append(oi)
    o = torch.stack(o).to(mixed.dtype)
    ref_out = gated_rms_norm_ref(o, args["gate"].reshape(r, t, h, vd), args["norm_weight"],
                                 vllm_stock.O_NORM_EPS, mixed.dtype)  # fmt: skip
    ref_out = ref_out.reshape(r, t, h * vd)
    assert out.dtype == mixed.dtype and torch.isfinite(out).all()
    assert ((out.double() - ref_out.double()).abs() <= 2.0**-5 * ref_out.double().abs()).all()
    assert (rec_after - ref_rec).abs().max() <= 2.0**-16 * ref_rec.abs().max()
    written = step.write_slots.flatten() if keep else step.read_slots
    kept = torch.ones(rec.shape[0], dtype=torch.bool, device=rec.device)
    kept[written] = False
    assert torch.equal(rec_after[kept], rec[kept])  # no other slot touched


def mhc_case(tokens, gen, h=4, d=64):
    """streams, fn, scale, base of one mHC pre on gen's device, with the reference model's
    init statistics (unit streams, fn std 0.5 / sqrt(H*D), scale 0.5 + U[0, 1), base std
    0.5)."""
    dev = gen.device

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=dev)

    streams = randn(tokens, h, d).bfloat16()
    fn = randn((2 + h) * h, h * d) * 0.5 / (h * d) ** 0.5
    scale = 0.5 + torch.rand(3, generator=gen, device=dev)
    return streams, fn, scale, randn((2 + h) * h) * 0.5


def _mix64(streams, fn, scale, base, rms_eps, hc_eps, iters, post_mult=2.0):
    """hc_mix_ref's math in FP64 -> pre, post, comb."""
    t, h, _ = streams.shape
    x = streams.reshape(t, -1).double()
    x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + rms_eps)
    m_pre, m_post, m_comb = (x @ fn.double().T).split([h, h, h * h], dim=-1)
    s, b = scale.double(), base.double()
    pre = torch.sigmoid(m_pre * s[0] + b[:h]) + hc_eps
    post = post_mult * torch.sigmoid(m_post * s[1] + b[h : 2 * h])
    comb = torch.softmax(m_comb.view(t, h, h) * s[2] + b[2 * h :].view(h, h), -1) + hc_eps
    comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    return pre, post, comb


def check_mhc_pre(mhc, streams, fn, scale, base, rms_eps, hc_eps, iters, out):
    """One `vllm_mhc.mhc_pre` call's output (post, comb, collapsed) against FP64 and the
    reference (module docstring); `mhc`: VllmKernels.mhc, to recompute vLLM's pre gate."""
    post, comb, collapsed = out
    t, h, d = streams.shape
    kw = dict(rms_eps=rms_eps, hc_eps=hc_eps, sinkhorn_iters=iters)
    ref_pre, ref_post, ref_comb = hc_mix_ref(streams, fn, scale, base, **kw)
    flat = streams.reshape(t, -1).float()
    pre = mhc.mhc_pre_mix_triton((flat @ fn.T)[None], flat.square().sum(-1)[None], scale, base,
                                 h, h * d, rms_eps, hc_eps)  # fmt: skip
    truth = _mix64(streams, fn, scale, base, rms_eps, hc_eps, iters)
    for name, got, ref, want in zip(("pre", "post", "comb"), (pre, post, comb),
                                    (ref_pre, ref_post, ref_comb), truth, strict=True):  # fmt: skip
        assert got.dtype == torch.float32 and got.shape == want.shape, name
        err, noise = (got - want).abs().max().item(), (ref - want).abs().max().item()
        assert err <= 2 * noise + 2.0**-20, (name, err, noise)
    terms = pre.double()[..., None] * streams.double()
    exact, size = terms.sum(1), terms.abs().sum(1)
    assert collapsed.dtype == torch.bfloat16 and collapsed.shape == (t, d)
    err = (collapsed.double() - exact).abs()
    assert (err <= 2.0**-8 * exact.abs() + 2.0**-21 * size).all(), err.max()


class Recorder:
    """Each vLLM KDA core, experts and mHC pre call checked as it runs, on its own inputs
    (`step`: the placement of the step they run in)."""

    def __init__(self, kernels, monkeypatch):
        self.calls = {"kda": 0, "experts": 0, "mhc": 0}
        self.step = self.conv_out = None
        conv, core = kernels.conv.causal_conv1d_update, vllm_stock.kda_core
        experts, pre = vllm_stock.fused_experts, vllm_mhc.mhc_pre

        def conv_recorded(*args, **kwargs):
            self.conv_out = conv(*args, **kwargs)
            return self.conv_out

        def core_checked(*args, **kwargs):
            called = inspect.signature(core).bind(*args, **kwargs).arguments
            before = {k: v.clone() if k in ("mixed", "conv", "recurrent") else v
                      for k, v in called.items() if k not in ("vk", "placed")}  # fmt: skip
            out = core(*args, **kwargs)
            check_kda(before, self.conv_out, out, called["conv"], called["recurrent"], self.step)
            self.calls["kda"] += 1
            return out

        def experts_checked(vk, x, w13, s13, w2, s2, ids, weights, limit, ue8m0=False):
            out = experts(vk, x, w13, s13, w2, s2, ids, weights, limit, ue8m0)
            check_experts(x, w13, s13, w2, s2, ids, weights, limit, ue8m0, out)
            self.calls["experts"] += 1
            return out

        def pre_checked(mhc, streams, fn, scale, base, *, rms_eps, hc_eps, sinkhorn_iters,
                        **kw):  # fmt: skip
            out = pre(mhc, streams, fn, scale, base, rms_eps=rms_eps, hc_eps=hc_eps,
                      sinkhorn_iters=sinkhorn_iters, **kw)  # fmt: skip
            check_mhc_pre(mhc, streams, fn, scale, base, rms_eps, hc_eps, sinkhorn_iters, out)
            self.calls["mhc"] += 1
            return out

        monkeypatch.setattr(kernels.conv, "causal_conv1d_update", conv_recorded)
        monkeypatch.setattr(vllm_mhc, "mhc_pre", pre_checked)
        monkeypatch.setattr(vllm_stock, "kda_core", core_checked)
        monkeypatch.setattr(vllm_stock, "fused_experts", experts_checked)
