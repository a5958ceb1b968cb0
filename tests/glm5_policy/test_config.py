"""DecodeConfig: building from plain values, planned token counts, one error for all."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from glm5_policy import MAX_TOKENS, DecodeConfig, Policy, PolicyError


def test_build_resolves_the_policy_over_the_family_default():
    config = DecodeConfig.build(
        max_context=4096,
        q=4,
        capture_sizes=[64, 1, 8, 4, 8, 128, 12],
        policy={"moe": "grouped"},
        family="sm90",
    )
    assert config.capture_sizes == (1, 4, 8, 12, 64, 128)
    assert config.planned_tokens == (4, 8, 12, 64)
    assert config.policy("moe", 1) == "grouped"
    assert config.policy("kda", 1) == Policy.default("sm90")("kda", 1)
    assert hash(config) == hash(DecodeConfig.build(4096, 4, (1, 4, 8, 12, 64, 128), config.policy))


@given(st.sets(st.integers(1, 512), max_size=20), st.integers(1, 8))
def test_planned_tokens_are_whole_requests_within_the_cap(sizes, q):
    config = DecodeConfig.build(1024, q, sizes)
    assert set(config.planned_tokens) == {b for b in sizes if b <= MAX_TOKENS and b % q == 0}


def test_one_error_names_every_bad_field():
    with pytest.raises(PolicyError) as info:
        DecodeConfig.build(max_context=-1, q=0, capture_sizes=[1, 0, "8"], policy={"moe": "x"})
    assert [p.split(":")[0] for p in info.value.problems] == [
        "max_context",
        "q",
        "capture_sizes[1]",
        "capture_sizes[2]",
        "policy['moe']",
    ]


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"q": 9}, "q: expects an integer in 1..8"),
        ({"q": True}, "q: expects an integer"),
        ({"capture_sizes": "1,2"}, "capture_sizes: expects a sequence"),
        ({"capture_sizes": 8}, "capture_sizes: expects a sequence"),
        ({"max_context": 2.0}, "max_context: expects a positive integer"),
    ],
)
def test_bad_fields(kwargs, fragment):
    with pytest.raises(PolicyError, match=fragment):
        DecodeConfig.build(**{"max_context": 128, **kwargs})


def test_direct_construction_is_validated_too():
    with pytest.raises(PolicyError, match="policy: expects a Policy"):
        DecodeConfig(128, 1, (1,), {"moe": "grouped"})
    with pytest.raises(PolicyError, match="capture_sizes: must be a tuple"):
        DecodeConfig(128, 1, [1], Policy())
