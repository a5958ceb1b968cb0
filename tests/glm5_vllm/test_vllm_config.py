"""specialized_decode_config / unsupported on real VllmConfig objects: one reason per
unsupported setting, all of them at once, our additional_config keys only."""

import pytest
import torch

pytestmark = pytest.mark.vllm

H200 = (9, 0)


def _full_graphs(config):
    from vllm.config import CUDAGraphMode

    config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    config.compilation_config.cudagraph_capture_sizes = [1, 2, 4, 8, 16, 32, 64, 128]
    return config


def _good(vllm_config, **extra):
    return _full_graphs(
        vllm_config(additional_config={"decode_backend": "latency_specialized", **extra})
    )


def test_stock_unless_asked(vllm_config):
    from glm5_vllm.config import specialized_decode_config

    assert specialized_decode_config(vllm_config(), H200) is None
    # Other plugins' and vLLM's keys are not ours: ignored.
    other = vllm_config(additional_config={"kda_prefill_backend": "x", "someone": {"else": 1}})
    assert specialized_decode_config(other, H200) is None


def test_supported_deployment_builds_the_decode_config(vllm_config):
    from glm5_vllm.config import specialized_decode_config, unsupported

    config = _good(vllm_config, policy={"moe": {"1-8": "per_route", "9-64": "grouped"}})
    assert unsupported(config, H200) == []
    decode = specialized_decode_config(config, H200)
    assert decode.q == 1 and decode.planned_tokens == (1, 2, 4, 8, 16, 32, 64)
    assert decode.policy("moe", 8) == "per_route" and decode.policy("router", 1) == "split_k"
    sm100 = specialized_decode_config(config, (10, 0))
    assert sm100.policy("logits_head", 8) == "cute"  # the SM100 table


def _set(obj, **values):
    for k, v in values.items():
        setattr(obj, k, v)


CASES = {
    "capability": (None, "no CUDA GPU"),
    "tp": (lambda c: _set(c.parallel_config, tensor_parallel_size=3), "tensor parallel size 3"),
    "pp": (lambda c: _set(c.parallel_config, pipeline_parallel_size=2), "pipeline parallelism"),
    "dp": (lambda c: _set(c.parallel_config, data_parallel_size=2), "data parallelism"),
    "ep": (lambda c: _set(c.parallel_config, enable_expert_parallel=True), "expert parallelism"),
    "dbo": (lambda c: _set(c.parallel_config, enable_dbo=True), "dual-batch overlap"),
    "dcp": (
        lambda c: _set(c.parallel_config, decode_context_parallel_size=2),
        "context parallelism",
    ),
    "lora": (lambda c: _set(c, lora_config=object()), "LoRA"),
    "sleep": (lambda c: _set(c.model_config, enable_sleep_mode=True), "sleep mode"),
    "compile": (
        lambda c: _set(
            c.compilation_config, mode=__import__("vllm").config.CompilationMode.STOCK_TORCH_COMPILE
        ),
        "torch.compile",
    ),
    "eager": (
        lambda c: _set(
            c.compilation_config, cudagraph_mode=__import__("vllm").config.CUDAGraphMode.NONE
        ),
        "FULL decode CUDA graphs",
    ),
    "kv-dtype": (lambda c: _set(c.cache_config, cache_dtype="fp8_e5m2"), "KV cache dtype"),
    "kda-dtype": (lambda c: _set(c.cache_config, mamba_cache_dtype="float32"), "KDA state dtypes"),
    "replay": (lambda c: _set(c.cache_config, use_replayssm=True), "ReplaySSM"),
    "mhc": (lambda c: _set(c.model_config.hf_text_config, mhc=False), "without mHC"),
    "geometry": (
        lambda c: _set(c.model_config.hf_text_config, qk_rope_head_dim=64),
        "qk_rope_head_dim=64",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_one_reason_per_setting(vllm_config, case):
    from glm5_vllm.config import specialized_decode_config, unsupported

    change, reason = CASES[case]
    config = _good(vllm_config)
    capability = H200
    if change is None:
        capability = None  # this CPU machine's platform has no GPU
    else:
        change(config)
    reasons = unsupported(config, capability)
    assert len(reasons) == 1 and reason in reasons[0], reasons
    with pytest.raises(ValueError, match="does not support"):
        specialized_decode_config(config, capability)


def test_sequence_parallel_moe_comes_with_its_expert_and_data_parallelism(vllm_config):
    from glm5_vllm.config import unsupported

    config = _good(vllm_config)
    _set(config.parallel_config, all2all_backend="deepep_low_latency", enable_expert_parallel=True,
         tensor_parallel_size=2, data_parallel_size=2)  # fmt: skip
    reasons = unsupported(config, H200)
    assert len(reasons) == 3
    for reason in ("data parallelism", "expert parallelism", "sequence-parallel MoE"):
        assert any(reason in r for r in reasons), reasons


def test_every_reason_at_once_in_one_error(vllm_config):
    from glm5_vllm.config import specialized_decode_config

    config = _good(vllm_config)
    config.parallel_config.pipeline_parallel_size = 2
    config.cache_config.use_replayssm = True
    config.model_config.enable_sleep_mode = True
    with pytest.raises(ValueError) as e:
        specialized_decode_config(config, (8, 0))
    message = str(e.value)
    for reason in ("compute capability (8, 0)", "pipeline", "ReplaySSM", "sleep mode"):
        assert reason in message


def test_bad_backend_or_policy_is_one_clear_error(vllm_config):
    from glm5_policy import PolicyError
    from glm5_vllm.config import specialized_decode_config

    with pytest.raises(ValueError, match="decode_backend"):
        specialized_decode_config(_good(vllm_config, decode_backend="fastest"), H200)
    with pytest.raises(PolicyError) as e:
        specialized_decode_config(_good(vllm_config, policy={"moe": "mega", "x": 1}), H200)
    assert len(e.value.problems) == 2


def test_kda_dtypes_follow_the_mamba_cache_dtype(vllm_config):
    from glm5_vllm.config import deployment

    assert deployment(_good(vllm_config), H200).kda_state_dtypes == (torch.bfloat16, torch.float32)


def test_models_fail_before_building_when_the_request_cannot_run(vllm_config):
    """The registered classes read the configuration first: an unsupported request (this
    CPU machine has no GPU) raises with its reasons before any module is built."""
    from glm5_vllm import models

    config = _good(vllm_config)
    for cls in (models.Glm5NextForCausalLM, models.Glm5NextMTP):
        with pytest.raises(ValueError, match="no CUDA GPU"):
            cls(vllm_config=config)
    stock = vllm_config()  # not requested: nothing of ours runs before vLLM's constructor
    model = models.Glm5NextForCausalLM.__new__(models.Glm5NextForCausalLM)
    model._configure(stock)
    assert model.glm5_decode is None
