"""The library baselines the skinny GEMMs are judged against, and that the runtime's library
stock step runs: cuBLAS for BF16 weights (torch's matmul; FP32 logits through `out_dtype`
where torch has it) and torch's block-scaled `_scaled_mm` (CUTLASS) for block-FP8 weights,
on activations quantized per token in 1x128 groups as vLLM's block-FP8 linears do.

`_scaled_mm`'s block-scale layouts differ between torch releases: `scaled_mm_block` uses the
first layout that ran and matched the FP64 reference on this GPU (probed once per process).
Measured on the H200 with torch 2.11 (cuBLAS): one row is refused (CUBLAS_STATUS error), so
rows are padded to a multiple of 16; and where K/128 is not a multiple of 4 the GEMM runs but
returns wrong numbers (relative error 45 to 1e30), while padded scale strides are refused, so
such weights are refused here (`supports`) and the caller keeps its own path for them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from glm5_kernels.gemm.reference import GROUP, fp8_linear_ref, quantize_tokens_fp8_ref, swiglu_ref

__all__ = [
    "block_fp8_supported",
    "fp8_linear_library",
    "fp8_mlp_library",
    "router_library",
    "scaled_mm_block",
    "supports",
]

MIN_ROWS = 16

# Candidate (activation scales [M, K/128], weight scales [N/128, K/128]) -> _scaled_mm's.
SCALE_LAYOUTS = {
    "a[M,K/128] outer-major, b[K/128,N/128]": lambda sx, s: (sx.T.contiguous().T, s.T),
    "a[M,K/128] outer-major, b[N/128,K/128]": lambda sx, s: (sx.T.contiguous().T, s),
    "a[M,K/128], b[K/128,N/128]": lambda sx, s: (sx, s.T.contiguous()),
    "a[M,K/128], b[N/128,K/128]": lambda sx, s: (sx, s),
    "a[M,K/128] outer-major, b[K/128,N/128] contiguous": lambda sx, s: (
        sx.T.contiguous().T,
        s.T.contiguous(),
    ),
}
_probed: dict[torch.device, tuple[str, object] | None] = {}
_why: dict[torch.device, list[str]] = {}


def _runs(layout, x: Tensor, wq: Tensor, s: Tensor, why: list[str]) -> bool:
    """Whether `_scaled_mm` with `layout` runs on x and matches the FP64 reference (a
    wrong layout may run but scale the wrong blocks: O(1) error, where FP8 gives < 1 %)."""
    xq, sx = quantize_tokens_fp8_ref(x)
    sa, sb = layout(sx, s)
    try:
        out = torch._scaled_mm(xq, wq.T, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError, TypeError, ValueError) as e:
        why.append(f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
        return False
    ref = fp8_linear_ref(x, wq, s, out_dtype=torch.float64)
    err = ((out.double() - ref).norm() / ref.norm()).item()
    why.append(f"ran, relative error {err:.2g}")
    return err < 1e-2


def _probe(device: torch.device) -> tuple[str, object] | None:
    """(name, layout) of the first scale layout `_scaled_mm` runs correctly here. The
    probe's N and K blocks differ (4 x 8), so no layout passes by transposing a square."""
    if device not in _probed:
        from glm5_kernels.quant import quantize_fp8_block_ref

        _probed[device], _why[device] = None, []
        gen = torch.Generator(device).manual_seed(0)
        x = torch.randn(MIN_ROWS, 8 * GROUP, generator=gen, device=device).bfloat16()
        w = torch.randn(4 * GROUP, 8 * GROUP, generator=gen, device=device)
        wq, s = quantize_fp8_block_ref(w)
        for name, layout in SCALE_LAYOUTS.items():
            why: list[str] = []
            if _runs(layout, x, wq, s, why):
                _probed[device] = (name, layout)
                break
            _why[device].append(f"{name}: {why[-1]}")
    return _probed[device]


def _key(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    return torch.device("cuda", torch.cuda.current_device()) if device.index is None else device


def block_fp8_supported(device: torch.device | str) -> str | None:
    """The scale layout's name where torch's block-scaled `_scaled_mm` runs on `device`."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    found = _probe(_key(device))
    return None if found is None else found[0]


def supports(w: Tensor) -> bool:
    """Whether `scaled_mm_block` takes weight w [N, K] (see the module docstring)."""
    return w.shape[0] % GROUP == 0 and w.shape[1] % (4 * GROUP) == 0


def scaled_mm_block(xq: Tensor, sx: Tensor, w: Tensor, s: Tensor) -> Tensor:
    """xq [M, K] e4m3 with sx [M, K/128] fp32, w [N, K] e4m3 with s [N/128, K/128] fp32
    (`supports(w)`) -> [M, N] BF16 through torch's block-scaled `_scaled_mm`."""
    found = _probe(xq.device)
    if found is None:
        raise RuntimeError(
            f"torch {torch.__version__}: no block-scaled _scaled_mm on {xq.device}: "
            + "; ".join(_why[xq.device])
        )
    if not supports(w):
        raise ValueError(f"w {tuple(w.shape)}: block-scaled _scaled_mm needs K % 512 == 0")
    rows = xq.shape[0]
    pad = -rows % MIN_ROWS
    if pad:  # zero rows with unit scales: their outputs are dropped
        xq = F.pad(xq.view(torch.uint8), (0, 0, 0, pad)).view(xq.dtype)
        sx = F.pad(sx, (0, 0, 0, pad), value=1.0)
    sa, sb = found[1](sx, s.float())
    out = torch._scaled_mm(xq, w.T, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    return out[:rows]


def fp8_linear_library(x: Tensor, w: Tensor, s: Tensor, ue8m0: bool = False) -> Tensor:
    """x [M, K] BF16, w [N, K] e4m3, s [N/128, K/128] -> [M, N] BF16: torch's per-token
    quantization ops, then `scaled_mm_block` (fp8_linear_ref's numbers, FP32 accumulation)."""
    xq, sx = quantize_tokens_fp8_ref(x, ue8m0)
    return scaled_mm_block(xq, sx, w, s)


def fp8_mlp_library(
    xq: Tensor, sx: Tensor, w13: Tensor, s13: Tensor, w2: Tensor, s2: Tensor, limit: float,
    ue8m0: bool = False,
) -> Tensor:  # fmt: skip
    """An FP8 SwiGLU MLP (expert) on quantized rows xq [M, D] e4m3 / sx [M, D/128], w13
    [2I, D] ([gate; up]), w2 [D, I] -> [M, D] BF16: `scaled_mm_block`, torch's clamped
    SwiGLU and quantization between (fp8_mlp_ref's numbers)."""
    h = scaled_mm_block(xq, sx, w13, s13)
    aq, sa = quantize_tokens_fp8_ref(swiglu_ref(h.float(), limit).to(torch.bfloat16), ue8m0)
    return scaled_mm_block(aq, sa, w2, s2)


def router_library(x: Tensor, w: Tensor) -> Tensor:
    """x [M, K] BF16, w [E, K] BF16 -> FP32 logits [M, E]: cuBLAS with an FP32 output where
    torch has `out_dtype`, else a BF16 GEMM's output cast (what a stock router can do)."""
    try:
        return torch.mm(x, w.T, out_dtype=torch.float32)
    except (RuntimeError, TypeError):
        return (x @ w.T).float()
