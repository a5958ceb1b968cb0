"""Which layout a vLLM module's weights are in once vLLM has processed them, and whether a
stage reads it.

vLLM 0.33 rewrites weights after loading for the kernel it picked: block-FP8
linears are re-quantized in place to power-of-two (UE8M0) scales, and on SM100 their scales
become DeepGEMM's packed int32 words; FlashInfer's experts swap w13 to [up; gate] (same shape
as [gate; up]) and TRT-LLM's shuffle it into blocks. So a layout is identified from the
module's quant method and kernel (the object vLLM chose) first, then checked against the
tensors (dtype, shape, strides); a shape alone never decides, since two layouts share one.

Served (the stages' kernels read them as they are, no copy):
- BF16 [N, K] row-major weights of unquantized linears, the LM head and nn.Linear;
- block-FP8: e4m3 [N, K] row-major with [⌈N/128⌉, ⌈K/128⌉] row-major FP32 (or e8m0fnu) scales,
  under a kernel known to keep that layout. UE8M0 re-quantized scales are FP32 powers of two:
  still plain block scales, served as such.
Everything else (DeepGEMM's packed int32 scales, Marlin, transposed or padded weights, any
kernel not listed) is refused: the module's op stays vLLM's, with one warning per layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = ["Layout", "expert_layout", "linear_layout"]

BLOCK = 128  # FP8 block-scale granularity
# vLLM 0.33's block-FP8 linear kernels that leave weight and scales row-major in the
# checkpoint's [N, K] / [N/128, K/128] order (kernels/linear/scaled_mm/): DeepGEMM's
# re-quantizes values in place (and packs SM100 scales, refused by dtype below), the others
# keep the loaded tensors.
ROW_MAJOR_FP8_KERNELS = frozenset(
    {
        "DeepGemmFp8BlockScaledMMKernel",
        "FlashInferFp8BlockScaledMMKernel",
        "FlashInferFp8DeepGEMMDynamicBlockScaledKernel",
        "TritonFp8BlockScaledMMKernel",
        "CutlassFp8BlockScaledMMKernel",
    }
)
UNQUANTIZED = frozenset({"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"})
# vLLM 0.33's FP8 MoE backends (fused_moe/oracle/fp8.py) whose experts keep the checkpoint's
# w13 [gate; up] row order; FlashInfer's swap it to [up; gate] with the same shapes.
CHECKPOINT_ORDER_MOE = frozenset({"TRITON", "BATCHED_TRITON", "DEEPGEMM", "BATCHED_DEEPGEMM"})


@dataclass(frozen=True)
class Layout:
    """A module's weight layout: `backend` is the vLLM object that decided it (quant method /
    kernel / MoE backend), `name` the layout, `served` whether the stages read it."""

    backend: str
    name: str
    served: bool

    def __str__(self) -> str:
        return f"{self.name} ({self.backend})"


def _row_major(t: Tensor, shape: tuple[int, ...]) -> bool:
    return tuple(t.shape) == shape and t.is_contiguous()


def _describe(t: Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')} {tuple(t.shape)} strides {t.stride()}"


def linear_layout(module: nn.Module) -> Layout:
    """The layout of a linear's (or the LM head's) weight [N, K] and block scales."""
    method = getattr(module, "quant_method", None)
    kind = type(method).__name__ if method is not None else type(module).__name__
    weight = getattr(module, "weight", None)
    if not isinstance(weight, Tensor):
        return Layout(kind, "no weight tensor", False)
    w = weight.data
    if w.dim() != 2 or not w.is_contiguous():
        return Layout(kind, f"weight {_describe(w)}, not [N, K] row-major", False)
    if (method is None and isinstance(module, nn.Linear)) or kind in UNQUANTIZED:
        if w.dtype != torch.bfloat16:
            return Layout(kind, f"weight {_describe(w)}, not BF16", False)
        return Layout(kind, "BF16 [N, K]", True)
    if kind != "Fp8LinearMethod" or not getattr(method, "block_quant", False):
        return Layout(kind, "a quantization no stage reads", False)
    kernel = type(getattr(method, "fp8_linear", None)).__name__
    backend = f"{kind}, {kernel}"
    if getattr(method, "use_marlin", False) or kernel not in ROW_MAJOR_FP8_KERNELS:
        return Layout(backend, "a block-FP8 kernel layout no stage reads", False)
    if list(getattr(method, "weight_block_size", None) or ()) != [BLOCK, BLOCK]:
        return Layout(backend, f"block size {method.weight_block_size}, not 128x128", False)
    scale = getattr(module, "weight_scale_inv", None)
    if w.dtype != torch.float8_e4m3fn or not isinstance(scale, Tensor):
        return Layout(backend, f"weight {_describe(w)} without block scales", False)
    s = scale.data
    n, k = w.shape
    if s.dtype == torch.int32:  # DeepGEMM's SM100 layout: four UE8M0 exponents per word
        return Layout(backend, f"packed int32 UE8M0 scales {_describe(s)} (SM100)", False)
    blocks = (-(-n // BLOCK), -(-k // BLOCK))
    if s.dtype not in (torch.float32, torch.float8_e8m0fnu) or not _row_major(s, blocks):
        return Layout(backend, f"scales {_describe(s)}, not {blocks} row-major", False)
    return Layout(backend, "block-FP8 [N, K], 128x128 block scales", True)


def expert_layout(experts: nn.Module) -> Layout:
    """The layout of a FusedMoE's w13 [E, 2I, H] / w2 [E, H, I], as the MoE stage reads them
    (BF16 is identified too; the stage itself refuses it). [gate; up] and [up; gate] share
    every shape, so the row order comes from the backend vLLM picked, never the tensors."""
    # vLLM 0.33's FusedMoE factory holds the weights and quant method in `routed_experts`.
    experts = getattr(experts, "routed_experts", experts)
    method = getattr(experts, "quant_method", None)
    kind = type(method).__name__
    backend = getattr(method, "fp8_backend", None) or getattr(method, "unquantized_backend", None)
    name = getattr(backend, "name", str(backend))
    where = f"{kind}, {name}"
    w13, w2 = getattr(experts, "w13_weight", None), getattr(experts, "w2_weight", None)
    if not isinstance(w13, Tensor) or not isinstance(w2, Tensor):
        return Layout(where, "no expert weights", False)
    if name.startswith("FLASHINFER"):
        shuffled = "" if w13.dim() == 3 else ", block-shuffled"
        return Layout(where, f"w13 [up; gate]{shuffled}", False)
    e, i2, h = w13.shape if w13.dim() == 3 else (0, 0, 0)
    if not (_row_major(w13.data, (e, i2, h)) and _row_major(w2.data, (e, h, i2 // 2))):
        return Layout(where, f"w13 {_describe(w13.data)}, w2 {_describe(w2.data)}", False)
    if kind == "Fp8MoEMethod" and name in CHECKPOINT_ORDER_MOE:
        s13, s2 = (getattr(experts, f"{w}_weight_scale_inv", None) for w in ("w13", "w2"))
        if not isinstance(s13, Tensor) or not isinstance(s2, Tensor):
            return Layout(where, "block-FP8 experts without block scales", False)
        if s13.dtype == torch.int32:
            return Layout(where, f"packed int32 UE8M0 scales {_describe(s13.data)}", False)
        want13 = (e, -(-i2 // BLOCK), -(-h // BLOCK))
        want2 = (e, -(-h // BLOCK), -(-(i2 // 2) // BLOCK))
        if s13.dtype != torch.float32 or not (
            _row_major(s13.data, want13) and _row_major(s2.data, want2)
        ):
            return Layout(where, f"scales {_describe(s13.data)}, not row-major blocks", False)
        return Layout(where, "block-FP8 w13 [gate; up]", True)
    if kind == "UnquantizedFusedMoEMethod" and name == "TRITON" and w13.dtype == torch.bfloat16:
        return Layout(where, "BF16 w13 [gate; up]", True)
    return Layout(where, "an expert layout no stage reads", False)
