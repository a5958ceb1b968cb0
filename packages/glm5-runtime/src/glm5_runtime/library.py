"""The library stock: the reference backbone's step with the ops a user without this project
would hand to library kernels, so `glm5-decode bench` judges the specialized decode against
the best stock this machine offers, not only against the reference's plain torch:

- BF16 linears: cuBLAS (the reference's `F.linear`, unchanged); the router: cuBLAS with an
  FP32 output (`glm5_kernels.gemm.library.router_library`);
- block-FP8 linears (dense MLPs, shared experts): per-token 1x128 activation quantization,
  then torch's block-scaled `_scaled_mm`, as vLLM's block-FP8 linears run;
- routed experts: the same two `_scaled_mm` GEMMs per touched expert — each route's expert
  gathered (a CUDA graph cannot index weights by routing data otherwise), or every expert
  once over all tokens where there are fewer experts than routes (the reference's rule);
- the KDA recurrence: fla's `fused_recurrent_kda` where fla imports (decode steps; a verify
  that keeps every token's state stays on the reference's, which fla does not return).

Everything else (attention, mHC, norms, the indexer) is the reference's own, and so is any
FP8 weight `_scaled_mm` cannot take (K not a multiple of 512: `kernels` counts them). Numbers differ
from the reference stock by FP8 activation quantization (the reference's FP8 weights are
dequantized to BF16): `tests/glm5_runtime/test_library_gpu.py` bounds both against FP64."""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor

from glm5_kernels.gemm import quantize_tokens_fp8_ref
from glm5_kernels.gemm.library import (
    block_fp8_supported,
    fp8_linear_library,
    fp8_mlp_library,
    router_library,
    supports,
)

from .reference import ReferenceModel
from .reference.stages import RankStages

__all__ = ["LibraryStock", "experts_library"]

OPS = ("linear", "router", "experts", "recurrence")


def _fla_kda():
    try:
        from fla.ops.kda import fused_recurrent_kda
    except Exception:  # not installed, or no GPU build of its Triton kernels
        return None
    return fused_recurrent_kda


class LibraryStock:
    """While entered, `model`'s ranks run the library kernels above. `kernels` names what
    runs each op here (the bench records it)."""

    def __init__(self, model: ReferenceModel):
        layout = block_fp8_supported(model.device)
        if layout is None:
            raise RuntimeError(
                f"the library stock needs torch's block-scaled _scaled_mm on a CUDA GPU "
                f"(torch {torch.__version__} on {model.device} has none)"
            )
        self.model, self.fla = model, _fla_kda()
        fp8 = [w for rank in model.ranks for w in rank.w.values() if w.dtype == torch.float8_e4m3fn]
        refused = sum(not supports(w[0] if w.dim() == 3 else w) for w in fp8)  # experts: [E, N, K]
        self.kernels = {
            "bf16_linear": "cuBLAS (torch F.linear)",
            "router": "cuBLAS, FP32 output",
            "fp8_linear": f"torch._scaled_mm block-scaled ({layout}) + torch quantization ops",
            "experts": "torch._scaled_mm per touched expert (gathered per route, or every "
            "expert once when experts <= routes)",
            "kda_recurrence": "fla fused_recurrent_kda" if self.fla else "reference (no fla)",
            "fp8_weights_on_the_reference_path": f"{refused} of {len(fp8)}",
        }

    def __enter__(self) -> LibraryStock:
        for rank in self.model.ranks:
            rank.linear = partial(_linear, rank)
            rank.router = partial(_router, rank)
            rank.experts = partial(_experts, rank)
            if self.fla is not None:
                rank.recurrence = partial(_recurrence, self.fla, rank)
        return self

    def __exit__(self, *exc) -> None:
        for rank in self.model.ranks:
            for name in OPS:
                rank.__dict__.pop(name, None)


def _linear(rank: RankStages, x: Tensor, name: str) -> Tensor:
    w = rank.w[name]
    if w.dtype != torch.float8_e4m3fn:
        return F.linear(x, w)
    if not supports(w):
        return RankStages.linear(rank, x, name)
    rows = x.reshape(-1, x.shape[-1])
    y = fp8_linear_library(rows, w, rank.w[name + "_scale_inv"], rank.ue8m0)
    return y.view(*x.shape[:-1], -1)


def _router(rank: RankStages, name: str, x: Tensor) -> Tensor:
    return router_library(x, rank.w[name])


def _experts(rank: RankStages, prefix: str, x: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
    w = rank.w
    if not (supports(w[f"{prefix}.gate_up_proj"][0]) and supports(w[f"{prefix}.down_proj"][0])):
        return RankStages.experts(rank, prefix, x, ids, weights)
    return experts_library(
        x, w[f"{prefix}.gate_up_proj"], w[f"{prefix}.gate_up_proj_scale_inv"],
        w[f"{prefix}.down_proj"], w[f"{prefix}.down_proj_scale_inv"], ids, weights,
        rank.g.swiglu_limit, rank.ue8m0,
    )  # fmt: skip


def experts_library(
    x: Tensor, w13: Tensor, s13: Tensor, w2: Tensor, s2: Tensor, ids: Tensor,
    weights: Tensor, limit: float, ue8m0: bool = False,
) -> Tensor:  # fmt: skip
    """x [N, D] BF16; w13 [E, 2I, D], w2 [E, D, I] e4m3 with block scales s13, s2; ids,
    weights [N, k] -> Σ_j weights[:, j] * expert_{ids[:, j]}(x) [N, D] FP32. Capturable: no
    host sync, no shape that depends on the routing."""
    n, k = ids.shape
    xq, sx = quantize_tokens_fp8_ref(x, ue8m0)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    if w13.shape[0] <= n * k:  # every expert once on every token, weighted 0 where unrouted
        for e in range(w13.shape[0]):
            combine = (weights * (ids == e)).sum(-1, keepdim=True).float()
            y = fp8_mlp_library(xq, sx, w13[e], s13[e], w2[e], s2[e], limit, ue8m0)
            out += y.float() * combine
        return out
    for t in range(n):
        for j in range(k):
            # A 1-element device index gathers (a 0-d one would sync to read it back).
            e = ids[t, j : j + 1]
            y = fp8_mlp_library(
                xq[t : t + 1], sx[t : t + 1], w13[e][0], s13[e][0], w2[e][0], s2[e][0], limit, ue8m0
            )
            out[t : t + 1] += y.float() * weights[t, j]
    return out


def _recurrence(fla_kda, rank: RankStages, q, k, v, gate, beta, state, *, all_states: bool):
    """fla's KDA decode kernel for steps that need only the final state."""
    if all_states:
        return RankStages.recurrence(rank, q, k, v, gate, beta, state, all_states=True)
    o, final = fla_kda(
        q[None], k[None], v[None], gate[None].float(), beta[None].float(),
        scale=q.shape[-1] ** -0.5, initial_state=state[None].float().contiguous(),
        output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    return o[0].float(), final[0].float(), None
