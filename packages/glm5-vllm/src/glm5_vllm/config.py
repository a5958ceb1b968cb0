"""The deployment's specialized decode settings, read from a VllmConfig: our keys of
`additional_config` ("decode_backend", "policy"; other plugins' and vLLM's keys are left
alone), and every reason the deployment cannot run it (glm5_runtime.checks over the
VllmConfig's parallel, compilation, cache and speculative settings)."""

from __future__ import annotations

from typing import Any

from glm5_policy import DecodeConfig, family_of
from glm5_runtime.checks import Deployment, DeploymentError
from glm5_runtime.checks import unsupported as runtime_unsupported

__all__ = ["BACKENDS", "deployment", "specialized_decode_config", "unsupported"]

BACKENDS = ("auto", "latency_specialized")


def _capability(capability: tuple[int, int] | None) -> tuple[int, int] | None:
    if capability is not None:
        return tuple(capability)
    from vllm.platforms import current_platform

    c = current_platform.get_device_capability()
    return None if c is None else (c.major, c.minor)


def deployment(vllm_config: Any, capability: tuple[int, int] | None = None) -> Deployment:
    """The VllmConfig in the runtime's terms; `capability` defaults to this GPU's."""
    from vllm.config import CompilationMode, CUDAGraphMode
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator

    parallel, cache = vllm_config.parallel_config, vllm_config.cache_config
    model, compilation = vllm_config.model_config, vllm_config.compilation_config
    spec = vllm_config.speculative_config
    graphs = compilation.cudagraph_mode
    text = model.hf_text_config
    return Deployment(
        capability=_capability(capability) or (0, 0),
        model=text,
        tensor_parallel=parallel.tensor_parallel_size,
        pipeline_parallel=parallel.pipeline_parallel_size,
        data_parallel=parallel.data_parallel_size,
        expert_parallel=bool(parallel.enable_expert_parallel),
        sequence_parallel_moe=bool(parallel.use_sequence_parallel_moe),
        micro_batching=bool(parallel.use_ubatching),
        context_parallel=max(
            parallel.decode_context_parallel_size, parallel.prefill_context_parallel_size
        ),
        lora=vllm_config.lora_config is not None,
        sleep_mode=bool(model.enable_sleep_mode),
        torch_compile=compilation.mode == CompilationMode.STOCK_TORCH_COMPILE,
        full_decode_graphs=graphs is not None and graphs.decode_mode() == CUDAGraphMode.FULL,
        kv_cache_dtype=str(cache.cache_dtype),
        speculative_method=None if spec is None else spec.method,
        speculative_tokens=0 if spec is None else spec.num_speculative_tokens,
        kda_state_dtypes=MambaStateDtypeCalculator.kda_state_dtype(
            model.dtype, cache.mamba_cache_dtype, cache.mamba_ssm_cache_dtype
        ),
        ssm_replay=bool(cache.use_replayssm or cache.use_kda_recoverssm),
        mhc=bool(getattr(text, "mhc", False)),
    )


def unsupported(vllm_config: Any, capability: tuple[int, int] | None = None) -> list[str]:
    """Every reason this deployment cannot run the specialized decode."""
    c = _capability(capability)
    reasons = runtime_unsupported(deployment(vllm_config, c))
    if c is None:  # deployment() stood (0, 0) in for the missing GPU
        reasons = ["no CUDA GPU" if "compute capability" in r else r for r in reasons]
    return reasons


def _extra(vllm_config: Any) -> dict:
    extra = vllm_config.additional_config
    return extra if isinstance(extra, dict) else {}


def specialized_decode_config(
    vllm_config: Any, capability: tuple[int, int] | None = None
) -> DecodeConfig | None:
    """The specialized decode's settings, None for the stock decode. Raises one ValueError
    naming every problem when it is requested for a deployment it cannot run, or with a
    backend name or policy table it does not know."""
    extra = _extra(vllm_config)
    backend = extra.get("decode_backend", "auto")
    if backend == "auto":
        return None
    if backend not in BACKENDS:
        raise ValueError(
            f"additional_config['decode_backend']={backend!r}: expects one of {BACKENDS}"
        )
    reasons = unsupported(vllm_config, capability)
    if reasons:
        raise DeploymentError(reasons)
    spec = vllm_config.speculative_config
    c = _capability(capability)
    return DecodeConfig.build(
        max_context=vllm_config.model_config.max_model_len,
        q=1 + (spec.num_speculative_tokens if spec is not None else 0),
        capture_sizes=tuple(vllm_config.compilation_config.cudagraph_capture_sizes or ()),
        policy=extra.get("policy"),
        family=family_of(c),
    )
