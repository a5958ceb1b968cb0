"""Deployment checks: one reason per unsupported setting, all of them at once."""

from dataclasses import replace

import pytest
import torch

from glm5_runtime.checks import Deployment, DeploymentError, check, unsupported
from glm5_runtime.reference import geometry

FLASH = geometry("flash").to_hf()
GOOD = Deployment(capability=(9, 0), model=FLASH, tensor_parallel=4, speculative_method="mtp",
                  speculative_tokens=3)  # fmt: skip


def test_supported_deployments_have_no_reasons():
    assert unsupported(GOOD) == []
    for tp in (1, 2, 4, 8):
        assert unsupported(replace(GOOD, tensor_parallel=tp)) == []
    assert unsupported(replace(GOOD, capability=(10, 0), kv_cache_dtype="fp8")) == []
    assert unsupported(replace(GOOD, kv_cache_dtype="fp8_ds_mla")) == []
    assert unsupported(replace(GOOD, speculative_method=None, speculative_tokens=0)) == []
    check(GOOD)


@pytest.mark.parametrize(
    "change, reason",
    [
        ({"capability": (8, 0)}, "compute capability (8, 0)"),
        ({"tensor_parallel": 3}, "tensor parallel size 3"),
        ({"pipeline_parallel": 2}, "pipeline parallelism"),
        ({"data_parallel": 2}, "data parallelism"),
        ({"expert_parallel": True}, "expert parallelism"),
        ({"sequence_parallel_moe": True}, "sequence-parallel MoE"),
        ({"micro_batching": True}, "dual-batch overlap"),
        ({"context_parallel": 2}, "context parallelism"),
        ({"lora": True}, "LoRA"),
        ({"sleep_mode": True}, "sleep mode"),
        ({"torch_compile": True}, "torch.compile"),
        ({"full_decode_graphs": False}, "FULL decode CUDA graphs"),
        ({"kv_cache_dtype": "fp8_e5m2"}, "KV cache dtype 'fp8_e5m2'"),
        ({"speculative_method": "eagle3"}, "speculative method 'eagle3'"),
        ({"speculative_tokens": 8}, "8 speculative tokens"),
        ({"kda_state_dtypes": (torch.float32, torch.float32)}, "KDA state dtypes"),
        ({"ssm_replay": True}, "ReplaySSM"),
        ({"mhc": False}, "without mHC"),
    ],
    ids=lambda v: next(iter(v)) if isinstance(v, dict) else "",
)
def test_each_setting_is_one_reason(change, reason):
    reasons = unsupported(replace(GOOD, **change))
    assert len(reasons) == 1 and reason in reasons[0], reasons


def test_model_geometry_problems_are_named():
    rope = geometry("flash", qk_rope_head_dim=0).to_hf()
    rope.qk_rope_head_dim = 64
    rope.n_group = 8
    reasons = unsupported(replace(GOOD, model=rope))
    assert any("qk_rope_head_dim=64" in r for r in reasons)
    assert any("n_group=8" in r for r in reasons)
    assert all(r.startswith("model geometry: ") for r in reasons)


def test_every_reason_at_once():
    bad = replace(GOOD, capability=(8, 6), tensor_parallel=16, lora=True, speculative_tokens=9)
    with pytest.raises(DeploymentError) as e:
        check(bad)
    assert len(e.value.reasons) == 4
    assert isinstance(e.value, ValueError)
    for r in e.value.reasons:
        assert r in str(e.value)


def test_indexed_attention_is_the_same_layer_kind():
    """transformers 5.20 (what vLLM 0.33 installs) names MLA+DSA layers indexed_attention."""
    hf = geometry("tiny").to_hf()
    renamed = [
        "indexed_attention" if t == "deepseek_sparse_attention" else t for t in hf.layer_types
    ]
    hf.layer_types = renamed
    assert unsupported(replace(GOOD, model=hf, tensor_parallel=1)) == []
