"""The deployment's specialized decode settings, read from a VllmConfig: our keys of
`additional_config` ("decode_backend", "policy"; other plugins' and vLLM's keys are left
alone, except that one a keyboard slip away from ours warns), and every reason the deployment
cannot run it (the model's architecture, then glm5_runtime.checks over the VllmConfig's
parallel, compilation, cache and speculative settings), all in one error.

vLLM's CLI hands `--additional-config` text that is not a JSON object through as a string:
a string is parsed as JSON here, and one that is not an object is an error, never a silent
stock decode. The policy must survive vLLM's hash of additional_config
(`json.dumps(..., sort_keys=True)`): its token keys are strings, as in JSON text.

Warnings go out once per process: vLLM builds the model classes more than once per process
(the multimodal wrapper builds its language model; the MTP drafter reads the same config)."""

from __future__ import annotations

import dataclasses
import difflib
import logging
import reprlib
from typing import Any

from glm5_policy import DecodeConfig, PolicyError, family_of, loads
from glm5_runtime.checks import Deployment, DeploymentError
from glm5_runtime.checks import unsupported as runtime_unsupported

from . import OVERRIDES

__all__ = ["BACKENDS", "KEYS", "deployment", "specialized_decode_config", "unsupported"]

BACKENDS = ("auto", "latency_specialized")
KEYS = ("decode_backend", "policy")  # ours in additional_config
ARCHITECTURES = tuple(OVERRIDES)  # vLLM's GLM-5.3-Flash architectures, those we register
FULL_DECODE_MODES = ("FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")

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


def _architecture(vllm_config: Any) -> str | None:
    """Why the model is not GLM-5.3-Flash, None where it is. Its config's `mhc` flag and
    geometry alone let other models through (a Llama config carrying "mhc": true)."""
    model = vllm_config.model_config
    archs = list(getattr(model, "architectures", None) or [])
    model_type = getattr(model.hf_text_config, "model_type", None)
    if any(a in ARCHITECTURES for a in archs):
        return None
    return (
        f"model architecture {', '.join(archs) or 'not given'} (model_type {model_type!r}): "
        f"expects GLM-5.3-Flash ({', '.join(ARCHITECTURES)})"
    )


def _graphs(vllm_config: Any) -> str:
    """The reason for a deployment without FULL decode CUDA graphs, naming what was found."""
    mode = vllm_config.compilation_config.cudagraph_mode
    eager = getattr(vllm_config.model_config, "enforce_eager", False)
    found = f"cudagraph_mode {'None' if mode is None else mode.name}"
    # vLLM turns graphs off itself for enforce-eager, and some platforms do for every model.
    why = "enforce-eager" if eager else "enforce-eager not set"
    return (
        f"{found} ({why}): the specialized decode runs in FULL decode CUDA graphs "
        f"({', '.join(FULL_DECODE_MODES)})"
    )


def unsupported(vllm_config: Any, capability: tuple[int, int] | None = None) -> list[str]:
    """Every reason this deployment cannot run the specialized decode."""
    c = _capability(capability)
    d = deployment(vllm_config, c)
    reasons = runtime_unsupported(dataclasses.replace(d, full_decode_graphs=True))
    if c is None:  # deployment() stood (0, 0) in for the missing GPU
        reasons = ["no CUDA GPU" if "compute capability" in r else r for r in reasons]
    if not d.full_decode_graphs:
        reasons.append(_graphs(vllm_config))
    architecture = _architecture(vllm_config)
    if architecture is not None:
        # Another model's geometry and mHC flag say nothing more: only its architecture.
        model = ("model geometry:", "checkpoints without mHC")
        reasons = [architecture, *(r for r in reasons if not r.startswith(model))]
    return reasons


def _extra(vllm_config: Any) -> dict:
    """additional_config as a mapping: a JSON string parsed (vLLM's CLI passes text that is
    not a JSON object through as it is); another plugin's hashable object has no keys of
    ours. Raises PolicyError for a string that is not a JSON object."""
    extra = vllm_config.additional_config
    if isinstance(extra, str):
        shown = reprlib.repr(extra)
        try:
            extra = loads(extra)  # keeps what json.loads drops: the keys given twice
        except ValueError as error:
            msg = getattr(error, "msg", str(error))
            problem = f"additional_config {shown}: not valid JSON ({msg})"
            raise PolicyError([problem]) from None
        except RecursionError:
            raise PolicyError([f"additional_config {shown}: nested too deeply"]) from None
        if not isinstance(extra, dict):
            kind = type(extra).__name__
            raise PolicyError([f"additional_config {shown}: expects a JSON object, got {kind}"])
        if extra.repeated:  # the policy's own objects are checked where it is parsed
            given = ", ".join(repr(k) for k in extra.repeated)
            repeated = f"{given} given more than once (JSON keeps the last)"
            raise PolicyError([f"additional_config {shown}: {repeated}"])
    return extra if isinstance(extra, dict) else {}


def _keys_not_strings(obj: Any, where: str) -> list[str]:
    """Every key of the mappings in `obj` that is not a string (vLLM's config hash sorts
    additional_config's keys as JSON text), each with its path."""
    if not isinstance(obj, dict):
        return []
    found = []
    for key, value in obj.items():
        at = f"{where}[{key!r}]"
        if isinstance(key, str):
            found += _keys_not_strings(value, at)
        else:
            found.append(f"{at}: key {key!r} is not a string (keys are JSON text: write '{key}')")
    return found


def specialized_decode_config(
    vllm_config: Any, capability: tuple[int, int] | None = None
) -> DecodeConfig | None:
    """The specialized decode's settings, None for the stock decode. Raises one ValueError
    naming every problem when it is requested for a deployment it cannot run (a
    DeploymentError), or with a backend name or policy table it does not know (a
    PolicyError, where the deployment itself is supported), or when additional_config is
    text that is not a JSON object. Warns (once per process) when a policy is given for the
    stock decode, and when a key is a misspelling of ours."""
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
            # Ignored, but still hashed by vLLM as sorted JSON: a key that is no string
            # would crash that hash with no word of why (one error here instead).
            if problems := _keys_not_strings(extra["policy"], "policy"):
                raise PolicyError(problems)
            _warn_once(
                "policy ignored",
                "additional_config['policy'] is ignored: decode_backend is %s, not "
                "'latency_specialized' (vLLM's stock decode runs)",
                repr(backend) if "decode_backend" in extra else "not set",
            )  # fmt: skip
        return None
    problems = []
    if backend not in BACKENDS:
        problems.append(
            f"additional_config['decode_backend']={reprlib.repr(backend)}: expects one of "
            f"{BACKENDS}"
        )
    reasons = unsupported(vllm_config, capability)
    spec = vllm_config.speculative_config
    c = _capability(capability)
    config = None
    try:
        config = DecodeConfig.build(
            max_context=vllm_config.model_config.max_model_len,
            q=1 + (spec.num_speculative_tokens if spec is not None else 0),
            capture_sizes=tuple(vllm_config.compilation_config.cudagraph_capture_sizes or ()),
            policy=extra.get("policy"),
            family=None if c is None else family_of(c),
            strict_json=True,  # vLLM hashes additional_config as sorted JSON
        )
    except PolicyError as error:
        problems += error.problems
    if reasons:
        raise DeploymentError(reasons + problems)
    if problems:
        raise PolicyError(problems)
    return config
