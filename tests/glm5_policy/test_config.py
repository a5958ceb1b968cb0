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


# What JSON text and vLLM's config hash need of a policy table.


@pytest.mark.parametrize(
    "text, problem",
    [
        ('{"moe": {"1-4": "grouped"}, "moe": null}', "policy: key 'moe' given more than once"),
        (
            '{"kda": "fused", "moe": {"1-4": "grouped", "5-8": null, "1-4": "per_route"}}',
            "policy['moe']: key '1-4' given more than once",
        ),
    ],
    ids=["stage", "token-range"],
)
def test_a_key_repeated_in_json_text_is_refused(text, problem):
    """json.loads keeps a repeated key's last value: the first would vanish without a word."""
    with pytest.raises(PolicyError) as info:
        DecodeConfig.build(max_context=128, policy=text)
    assert info.value.problems == [f"{problem} (JSON keeps only the last)"]
    once = text.replace('"moe": null', '"router": null').replace(
        '"1-4": "per_route"', '"9": "per_route"'
    )
    assert DecodeConfig.build(max_context=128, policy=once).policy("moe", 4) == "grouped"


def test_every_repeated_key_is_named_once_with_its_path():
    text = '{"moe": {"2": "grouped", "2": null, "2": "grouped"}, "kda": null, "kda": "fused"}'
    with pytest.raises(PolicyError) as info:
        DecodeConfig.build(max_context=128, policy=text)
    assert info.value.problems == [
        "policy: key 'kda' given more than once (JSON keeps only the last)",
        "policy['moe']: key '2' given more than once (JSON keeps only the last)",
    ]


UNICODE_DIGITS = {"fullwidth": "１-８", "arabic-indic": "٨", "mixed": "1-٨", "math": "𝟖"}


@pytest.mark.parametrize("key", UNICODE_DIGITS.values(), ids=UNICODE_DIGITS.keys())
def test_token_counts_are_ascii_digits_only(key):
    """int() reads every Unicode decimal digit ("１-８" as 1-8): a table must say 1-8."""
    with pytest.raises(PolicyError) as info:
        DecodeConfig.build(max_context=128, policy={"moe": {key: "grouped"}})
    assert info.value.problems == [
        f"policy['moe'][{key!r}]: {key!r} is not a token count or 'first-last' range in ASCII "
        "digits"
    ]
    assert DecodeConfig.build(128, policy={"moe": {" 1-8 ": "grouped"}}).policy("moe", 8)


def test_strict_json_refuses_non_string_token_keys_and_names_each():
    """Python tables may key token counts by int; a table that must survive JSON (vLLM
    hashes additional_config with json.dumps(sort_keys=True)) may not: 8 beside "1-4"
    cannot be sorted, and would crash the hash."""
    table = {"moe": {8: "per_route", "1-4": "grouped"}, "kda": {3: "fused"}}
    lenient = DecodeConfig.build(max_context=128, policy=table)
    assert lenient.policy("moe", 8) == "per_route" and lenient.policy("kda", 3) == "fused"
    with pytest.raises(PolicyError) as info:
        DecodeConfig.build(max_context=128, policy=table, strict_json=True)
    assert info.value.problems == [
        "policy['moe'][8]: token key 8 is not a string (keys are JSON text: write '8')",
        "policy['kda'][3]: token key 3 is not a string (keys are JSON text: write '3')",
    ]
    as_text = {"moe": {"8": "per_route", "1-4": "grouped"}, "kda": {"3": "fused"}}
    assert DecodeConfig.build(128, policy=as_text, strict_json=True) == lenient
