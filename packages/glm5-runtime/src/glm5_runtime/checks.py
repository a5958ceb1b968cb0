"""Deployment checks in the runtime's own terms: every reason a deployment cannot run the
specialized decode, all at once. The vLLM adapter maps a VllmConfig onto `Deployment`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from glm5_policy import family_of

from .reference.config import Geometry

__all__ = ["TP_SIZES", "Deployment", "DeploymentError", "check", "unsupported"]

TP_SIZES = (1, 2, 4, 8)  # what glm5-comm's one-shot all-reduce supports
MAX_SPECULATIVE_TOKENS = 7  # q <= 8 tokens per request


class DeploymentError(ValueError):
    """A deployment the specialized decode cannot run; `reasons` names each problem."""

    def __init__(self, reasons: list[str]):
        self.reasons = list(reasons)
        super().__init__(
            "GLM-5.3-Flash specialized decode does not support:\n"
            + "\n".join(f"  - {r}" for r in self.reasons)
        )


@dataclass(frozen=True)
class Deployment:
    """A deployment as the runtime sees it.

    capability: the GPU's CUDA compute capability; model: the text config's fields (any
    object with Glm5NextTextConfig's attributes); the rest: parallelism, compilation, cache
    and speculation settings, with the stock-compatible values as defaults."""

    capability: tuple[int, int]
    model: Any
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    data_parallel: int = 1
    expert_parallel: bool = False
    sequence_parallel_moe: bool = False
    micro_batching: bool = False  # dual-batch overlap
    context_parallel: int = 1  # decode or prefill context parallel degree
    lora: bool = False
    sleep_mode: bool = False
    torch_compile: bool = False  # the forward traced by torch.compile
    full_decode_graphs: bool = True
    kv_cache_dtype: str = "auto"
    speculative_method: str | None = None  # None: no speculation
    speculative_tokens: int = 0
    kda_state_dtypes: tuple[torch.dtype, torch.dtype] = (torch.bfloat16, torch.float32)
    ssm_replay: bool = False  # ReplaySSM / RecoverSSM records
    mhc: bool = True


def unsupported(d: Deployment) -> list[str]:
    """Every reason `d` cannot run the specialized decode (empty: it can)."""
    reasons = []
    if family_of(d.capability) is None:
        reasons.append(f"GPU compute capability {d.capability} (expects SM90 or SM100)")
    if d.tensor_parallel not in TP_SIZES:
        reasons.append(f"tensor parallel size {d.tensor_parallel} (expects one of {TP_SIZES})")
    else:
        try:
            Geometry.from_hf(d.model, tp_size=d.tensor_parallel)
        except (ValueError, TypeError) as e:
            lines = [ln.strip(" -") for ln in str(e).splitlines()[1:]] or [str(e)]
            reasons += [f"model geometry: {ln}" for ln in lines]
    if not d.mhc:
        reasons.append("checkpoints without mHC")
    settings = (
        (d.pipeline_parallel != 1, "pipeline parallelism"),
        (d.data_parallel != 1, "data parallelism"),
        (d.expert_parallel, "expert parallelism"),
        (d.sequence_parallel_moe, "sequence-parallel MoE"),
        (d.micro_batching, "dual-batch overlap (micro-batching)"),
        (d.context_parallel != 1, "context parallelism"),
        (d.lora, "LoRA"),
        (d.sleep_mode, "sleep mode"),
        # The decode loop runs inside forward; a compiled forward would trace it.
        (d.torch_compile, "torch.compile of the forward"),
        # The loop runs only in FULL decode graphs; eager and PIECEWISE steps run stock.
        (not d.full_decode_graphs, "deployments without FULL decode CUDA graphs (enforce-eager)"),
        (
            # vLLM 0.33 names the sparse-MLA FP8 cache fp8_ds_mla once it builds the layers.
            d.kv_cache_dtype not in ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_ds_mla"),
            f"KV cache dtype {d.kv_cache_dtype!r} (expects auto, bfloat16 or fp8: "
            "fp8_e4m3 / fp8_ds_mla)",
        ),
        (
            d.speculative_method not in (None, "mtp"),
            f"speculative method {d.speculative_method!r} (expects MTP)",
        ),
        (
            d.speculative_tokens > MAX_SPECULATIVE_TOKENS,
            f"{d.speculative_tokens} speculative tokens (at most {MAX_SPECULATIVE_TOKENS})",
        ),
        # The KDA decode keeps a BF16 conv state and an FP32 recurrent state in place.
        (
            tuple(d.kda_state_dtypes) != (torch.bfloat16, torch.float32),
            f"KDA state dtypes {tuple(d.kda_state_dtypes)} (expects BF16 conv, FP32 recurrent)",
        ),
        (d.ssm_replay, "ReplaySSM / RecoverSSM state records"),
    )
    return reasons + [reason for bad, reason in settings if bad]


def check(d: Deployment) -> None:
    """Raise one DeploymentError naming every reason, if there is any."""
    reasons = unsupported(d)
    if reasons:
        raise DeploymentError(reasons)
