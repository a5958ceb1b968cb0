"""Bad input to the reference backbone: one clear error naming the field, never a silent
wrong answer."""

import pytest
import torch

from glm5_runtime.reference import (
    Geometry,
    ReferenceModel,
    geometry,
    model_specs,
    random_state_dict,
)


@pytest.mark.parametrize(
    "changes, fragment",
    [
        ({"qk_rope_head_dim": 64}, "qk_rope_head_dim=64: MLA is NoPE"),
        ({"index_topk": 10}, "index_topk=10: must be a multiple of index_kpool=4"),
        ({"n_group": 2}, "n_group=2"),
        ({"tp_size": 3}, "not divisible by tp_size=3"),
        (
            {"tp_size": 2, "intermediate_size": 96, "moe_intermediate_size": 256},
            "128-wide FP8 block",
        ),
        ({"layer_types": ("linear_attention",)}, "layer_types: 1 entries for 8 layers"),
        ({"indexer_types": ("sometimes",) * 8}, "indexer_types: unknown values ['sometimes']"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ],
    ids=["rope", "topk-pool", "groups", "tp3", "fp8-block", "layer-count", "indexer", "act"],
)
def test_unsupported_geometry_names_the_field(changes, fragment):
    with pytest.raises(ValueError, match=r"unsupported GLM-5\.3-Flash geometry") as info:
        geometry("tiny", **changes)
    assert fragment in str(info.value)


def test_every_problem_is_listed_at_once():
    with pytest.raises(ValueError) as info:
        geometry("tiny", qk_rope_head_dim=64, index_topk=10, hidden_act="gelu")
    assert str(info.value).count("\n  - ") == 3


def test_unknown_geometry_name():
    with pytest.raises(ValueError, match="unknown name 'flash-tp3-rank'"):
        geometry("flash-tp3-rank")


def test_flash_rank_geometries_hold_one_shard_of_the_real_model():
    g = geometry("flash-tp4-rank")
    assert (g.tp_size, g.ranks, g.num_hidden_layers, len(g.mla_layers)) == (4, (0,), 45, 11)
    specs = model_specs(g)
    experts = specs["layers.3.mlp.experts.gate_up_proj"]
    assert experts.shape == (288, 4096, 4096) and experts.fp8 and experts.axis == 1
    assert "layers.45.eh_proj.weight" in specs and "layers.45.attn_hc.fn" not in specs
    params = sum(torch.Size(s.shape).numel() for s in specs.values())
    # 43 MoE blocks (42 layers + MTP) x 288 experts x 3 x 2048 x 4096 = 311.7e9 of it.
    assert 320e9 < params < 322e9


@pytest.fixture(scope="module")
def model():
    return ReferenceModel.random(
        geometry("tiny"), 0, max_requests=2, max_context=32, q=4, block_size=16
    )


@pytest.mark.parametrize(
    "tokens, fragment",
    [
        (torch.tensor([[512]]), "ids outside the vocabulary 0..511"),
        (torch.tensor([[-1]]), "ids outside the vocabulary"),
        (torch.tensor([[1.0]]), "expects an int32/int64 tensor, got torch.float32"),
        (torch.tensor([1, 2]), "expects shape [1, T>=1]"),
    ],
    ids=["above-vocab", "negative", "float", "1d"],
)
def test_bad_tokens(model, tokens, fragment):
    r = model.add()
    try:
        with pytest.raises(ValueError, match="bad tokens") as info:
            model.forward([r], tokens)
        assert fragment in str(info.value)
        assert model.lengths[r] == 0  # nothing was written
    finally:
        model.release(r)


def test_cache_overflow_and_step_misuse(model):
    r = model.add()
    try:
        model.forward([r], torch.zeros(1, 30, dtype=torch.long))
        with pytest.raises(ValueError, match=r"30 \+ 3 tokens exceed max_context=32"):
            model.forward([r], torch.zeros(1, 3, dtype=torch.long))
        with pytest.raises(ValueError, match="no verify step to accept"):
            model.accept(r, 1)
        with pytest.raises(ValueError, match="5 tokens per request exceed q=4"):
            model.step([r], 5, verify=True)
        with pytest.raises(ValueError, match="request 1: not added"):
            model.forward([1], torch.zeros(1, 1, dtype=torch.long))
    finally:
        model.release(r)


def test_state_dict_that_does_not_fit_names_each_tensor():
    g = geometry("tiny")
    sd = random_state_dict(g, seed=0)
    del sd["norm.weight"]
    sd["layers.0.self_attn.q_proj.weight"] = torch.zeros(3, 3)
    sd["layers.99.extra"] = torch.zeros(1)
    del sd["layers.0.mlp.down_proj.weight_scale_inv"]
    sd["layers.0.mlp.nothing_scale_inv"] = torch.ones(1)
    with pytest.raises(ValueError) as info:
        ReferenceModel.from_state_dict(g, sd, max_requests=1, max_context=16, block_size=16)
    text = str(info.value)
    assert "norm.weight: missing" in text
    assert "layers.99.extra: unexpected tensor" in text
    assert "layers.0.self_attn.q_proj.weight: shape (3, 3)" in text
    assert "layers.0.mlp.down_proj.weight_scale_inv: missing (an FP8 weight" in text
    assert "layers.0.mlp.nothing_scale_inv: unexpected tensor" in text


def test_geometry_round_trips_through_the_transformers_config():
    pytest.importorskip("transformers")
    g = geometry("tiny")
    assert Geometry.from_hf(g.to_hf()) == g


def test_a_model_too_large_for_the_device_is_refused_before_allocating():
    with pytest.raises(ValueError, match=r"1 of 1 TP ranks need [\d.]+ GiB on cpu .* fits") as e:
        ReferenceModel.random(geometry("flash"), 0, max_requests=1, max_context=16)
    assert "'flash'" not in str(e.value)  # it names a geometry that fits, not the one asked
