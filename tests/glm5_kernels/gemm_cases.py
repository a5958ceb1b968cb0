"""Shared by the CPU (interpreter) and GPU skinny-GEMM tests: inputs with sentinels past their
end, NaN-poisoned outputs, and the error bounds each op is held to.

Bounds. e = the exact product (FP64). A K-long FP32 dot product errs by at most K·u·(|x|·|w|)
(u = 2^-24, sequential summation; tensor-core and split-K orders are within it, +64 for the
split sums); a BF16 output adds half an ulp, 2^-8·|e|. FP8 ops are compared with
fp8_linear_ref, which quantizes activations identically; but the GPU's FP8 MMA accumulates
each 128-wide block with ~14 mantissa bits (DeepSeek-V3 §3.3.2), so there the per-term error
is taken as 2^-13 over a 128-term block: 2^-13·sqrt(128) ~ 2^-9.5 typical, bounded here by
2^-9·(|x|·|w|) elementwise, and the normwise error must stay within 4e-3 (BF16 output
rounding is ~2^-9.5 rms): a dropped K block or a wrong scale is >= 10x that."""

import torch

from glm5_kernels.gemm import fp8_mlp_ref
from glm5_kernels.quant import quantize_fp8_block_ref

SENTINEL = 1e30  # past the end of every input: a read out of bounds shows up as inf / huge


def padded(t: torch.Tensor, rows: int = 3) -> torch.Tensor:
    """t [R, C] as the leading rows of a buffer whose next rows are SENTINEL."""
    buf = torch.full((t.shape[0] + rows, t.shape[1]), SENTINEL, device=t.device)
    buf = buf.to(t.dtype) if t.dtype != torch.float8_e4m3fn else buf.clamp(max=448).to(t.dtype)
    buf[: t.shape[0]] = t
    return buf[: t.shape[0]]


def poisoned(m: int, n: int, dtype: torch.dtype, device) -> torch.Tensor:
    return torch.full((m, n), float("nan"), dtype=dtype, device=device)


def bf16_inputs(m: int, n: int, k: int, device, gen: torch.Generator):
    x = torch.randn(m, k, generator=gen, device=device).bfloat16()
    w = (torch.randn(n, k, generator=gen, device=device) / k**0.5).bfloat16()
    return padded(x), padded(w)


def fp8_inputs(m: int, n: int, k: int, device, gen: torch.Generator, e8m0: bool = False):
    x = torch.randn(m, k, generator=gen, device=device).bfloat16()
    w = torch.randn(n, k, generator=gen, device=device) / k**0.5
    wq, s = quantize_fp8_block_ref(w, ue8m0=e8m0)
    if e8m0:
        s = s.to(torch.float8_e8m0fnu)  # exact: UE8M0 scales are powers of two
    return padded(x), padded(wq), s


def assert_linear_close(y, exact, abs_product, k, bf16_out: bool, fp8_mma: bool = False):
    """|y - e| <= (K + 64)·2^-24·(|x|·|w|) [+ 2^-8·|e| for BF16 outputs], elementwise; FP8 MMA:
    2^-9·(|x|·|w|) [+ 2^-8·|e|] and normwise <= 4e-3."""
    y, exact = y.double(), exact.double()
    assert not torch.isnan(y).any(), "NaN left in the output (an element was never written)"
    bound = (2.0**-9 if fp8_mma else (k + 64) * 2.0**-24) * abs_product
    if fp8_mma:
        rel = ((y - exact).norm() / exact.norm()).item()
        assert rel <= 4e-3, f"normwise error {rel:.2e} > 4e-3"
    if bf16_out:
        bound = bound + 2.0**-8 * exact.abs()
    excess = (y - exact).abs() - bound
    worst = excess.argmax()
    assert excess.max() <= 0, (
        f"error exceeds bound at {divmod(worst.item(), y.shape[1])}: got {y.flatten()[worst]}, "
        f"exact {exact.flatten()[worst]}, bound {bound.flatten()[worst]}"
    )


def mlp_weights(d: int, i: int, device, gen: torch.Generator, e8m0: bool = False):
    w13 = torch.randn(2 * i, d, generator=gen, device=device) / d**0.5
    w2 = torch.randn(d, i, generator=gen, device=device) / i**0.5
    (q13, s13), (q2, s2) = (quantize_fp8_block_ref(w, ue8m0=e8m0) for w in (w13, w2))
    if e8m0:
        s13, s2 = s13.to(torch.float8_e8m0fnu), s2.to(torch.float8_e8m0fnu)
    return q13, s13, q2, s2


def assert_mlp_close(y, x, weights, limit, ue8m0):
    """Against vLLM's stock sequence (fp8_mlp_ref): normwise <= 1.5e-2, elementwise <= 2^-4 of
    the largest output.

    Why looser than one GEMM: the gate_up output is BF16, and a GPU's FP8 MMA accumulates each
    128-wide K block with ~14 mantissa bits (as DeepGEMM's does) before the FP32 promotion, so
    ~7% of those BF16 values land one ulp from the FP64 reference's. About 1/16 of such moves
    cross an e4m3 rounding boundary when the down projection's input is quantized, changing
    that code by one step (<= 2^-3 relative): sqrt(0.07 / 16) * 2^-3 ~ 0.8% normwise.
    Measured on the H200: 0.4-0.55%. A single FP8 GEMM is held to the tight bound instead."""
    ref = fp8_mlp_ref(x, *weights, limit, ue8m0).double()
    y = y.double()
    assert not torch.isnan(y).any()
    assert (y - ref).norm() <= 1.5e-2 * ref.norm()
    assert (y - ref).abs().max() <= 2.0**-4 * ref.abs().max()
