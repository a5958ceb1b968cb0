"""The deployment's specialized decode settings, read from a VllmConfig: our keys of
`additional_config` ("decode_backend", "policy"; other plugins' and vLLM's keys are left
alone, except that one a keyboard slip away from ours warns), and every reason the deployment
cannot run it (glm5_runtime.checks over the VllmConfig's parallel, compilation, cache and
speculative settings).

Warnings go out once per process: vLLM builds the model classes more than once per process
(the multimodal wrapper builds its language model; the MTP drafter reads the same config)."""

from __future__ import annotations

import difflib
import logging
from typing import Any

from glm5_policy import DecodeConfig, family_of
from glm5_runtime.checks import Deployment, DeploymentError
from glm5_runtime.checks import unsupported as runtime_unsupported

__all__ = ["BACKENDS", "KEYS", "deployment", "specialized_decode_config", "unsupported"]

BACKENDS = ("auto", "latency_specialized")
KEYS = ("decode_backend", "policy")  # ours in additional_config

logger = logging.getLogger("glm5_vllm")
_warned: set[Any] = set()  # what has been warned in this process


def _warn_once(what: Any, message: str, *args: Any) -> None:
    if what not in _warned:
        _warned.add(what)
        logger.warning(message, *args)


def _misspelling_of(key: Any) -> str | None:
    """Our key that `key` is a slip of the keyboard away from: a dropped, doubled or wrong
    letter, two letters swapped, another case or '-' for '_' (at most two insertions or
    deletions apart). Longer names built on ours (vLLM's own `kda_decode_backend`) are four
    or more apart: other keys."""
    if not isinstance(key, str) or key in KEYS:
        return None
    folded = key.lower().replace("-", "_")
    for ours in KEYS:
        match = difflib.SequenceMatcher(None, folded, ours)
        common = sum(block.size for block in match.get_matching_blocks())
        if len(folded) + len(ours) - 2 * common <= 2:
            return ours
    return None


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
        kv_cache_dtype=str(cache.cache_dtype),  # fp8_ds_mla: vLLM 0.33's rename of fp8
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
    backend name or policy table it does not know. Warns (once per process) when a policy
    is given for the stock decode, and when a key is a misspelling of ours."""
    extra = _extra(vllm_config)
    for key in extra:
        ours = _misspelling_of(key)
        if ours is not None:
            _warn_once(
                ("misspelled", key),
                "additional_config[%r] is not a key glm5-vllm reads: did you mean %r?",
                key, ours,
            )  # fmt: skip
    backend = extra.get("decode_backend", "auto")
    if backend == "auto":
        if extra.get("policy") is not None:
            _warn_once(
                "policy ignored",
                "additional_config['policy'] is ignored: decode_backend is %s, not "
                "'latency_specialized' (vLLM's stock decode runs)",
                repr(backend) if "decode_backend" in extra else "not set",
            )  # fmt: skip
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
