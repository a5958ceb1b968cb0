"""The routing decision: `plan` never plans a step `is_decode` would reject, plans every step
that satisfies all its conditions (4,000 generated row-count / capture-state combinations,
drawn mostly near the boundary between planned and stock), runs every case the seed lists
stock, and is a pure function of its inputs (so every TP rank decides alike)."""

import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from glm5_runtime.plan import Rows, StepContext, is_decode, plan, plan_draft

BATCHES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)


def counts():
    return st.integers(0, 70)


@st.composite
def rows(draw, b: int | None = None):
    """Any metadata shape: KDA-like (spec fields), MLA-like (none), the indexer's."""
    kind = draw(st.sampled_from(["kda", "mla", "indexer"]))
    spec = kind == "kda"
    return Rows(
        prefills=draw(st.sampled_from([0, 0, 0, 1, 2]) if b else counts()),
        prefill_tokens=draw(counts()),
        decodes=draw(counts()),
        decode_tokens=draw(counts()),
        spec_decodes=draw(counts()) if spec else None,
        spec_decode_tokens=draw(counts()) if spec else None,
        spec_state_rows=draw(st.one_of(st.none(), counts())) if spec else None,
        indexer=kind == "indexer",
    )


@st.composite
def uniform_rows(draw, b: int, q: int):
    """Rows that do form a uniform step of b tokens at q (the interesting, rare region)."""
    kind = draw(st.sampled_from(["kda", "mla", "indexer", "indexer-prefill"]))
    r = b // q
    if kind == "kda":
        if q == 1:
            return Rows(decodes=b, decode_tokens=b, spec_decodes=0, spec_decode_tokens=0)
        return Rows(spec_decodes=r, spec_decode_tokens=b, spec_state_rows=r)
    if kind == "mla":
        return Rows(decodes=r, decode_tokens=b)
    if kind == "indexer-prefill" and q > 1:
        return Rows(prefills=r, prefill_tokens=b, indexer=True)
    return Rows(decodes=r, decode_tokens=b, indexer=True)


def mostly(n: int):
    """True in all but one of n equally weighted choices."""
    return st.sampled_from([True] * (n - 1) + [False])


@st.composite
def contexts(draw):
    """A step and the decoder's q. Each of plan's conditions holds in most draws, so planned
    steps and steps that miss exactly one condition (the boundary) are common: of 4,000
    draws about 300 plan at q = 1, 130 at q > 1 and 950 miss one condition, where 12,000
    draws of fair coins planned 90 and 17 and missed one condition 880 times."""
    b = draw(st.sampled_from([*BATCHES, 3, 5, 7, 65, 80]))
    divides = [q for q in range(1, 9) if b % q == 0]
    q = draw(st.sampled_from(divides) if draw(mostly(4)) else st.integers(1, 8))
    n = draw(st.integers(0, 4))
    if b % q == 0 and draw(mostly(4)):
        layer_rows = [draw(uniform_rows(b, q)) for _ in range(n)]
        if layer_rows and draw(st.booleans()):  # one layer spoiled
            layer_rows[draw(st.integers(0, n - 1))] = draw(rows(b))
    else:
        layer_rows = [draw(rows()) for _ in range(n)]
    context = StepContext(
        tokens=b,
        capturing=draw(mostly(4)),
        graph=draw(st.sampled_from(["FULL"] * 6 + ["PIECEWISE", "NONE"])),
        pipeline_input=not draw(mostly(8)),
        aux_layers=draw(st.sampled_from([()] * 7 + [(2, 20)])),
        rows={f"layers.{i}": r for i, r in enumerate(layer_rows)},
    )
    return context, q


@settings(max_examples=4_000, deadline=None)
@given(contexts())
def test_plan_is_sound_and_complete(case):
    context, q = case
    decision = plan(context, BATCHES, q)
    step_q = q if any(r.spec_decodes for r in context.rows.values()) else 1
    eligible = (
        context.capturing
        and context.graph == "FULL"
        and not context.pipeline_input
        and not context.aux_layers
        and context.tokens in BATCHES
        and bool(context.rows)
        and context.tokens % step_q == 0
        and all(is_decode(r, step_q, context.tokens) for r in context.rows.values())
    )
    if decision.step is None:
        assert not eligible and decision.reason
    else:
        assert eligible, "planned a step that a condition rejects"
        assert decision.step.q == step_q and decision.step.tokens == context.tokens
        assert decision.step.requests * step_q == context.tokens
    # A pure function of the inputs: every rank, given the same step, decides the same.
    assert plan(context, BATCHES, q) == decision


DECODE = {"kda": Rows(decodes=8, decode_tokens=8, spec_decodes=0, spec_decode_tokens=0)}
VERIFY = {
    "kda": Rows(spec_decodes=2, spec_decode_tokens=8, spec_state_rows=2),
    "mla": Rows(decodes=2, decode_tokens=8),
    "indexer": Rows(prefills=2, prefill_tokens=8, indexer=True),
}


def test_pure_decodes_and_uniform_verifies_are_planned():
    decode = plan(StepContext(8, True, rows=DECODE), BATCHES, q=4)
    assert decode.step is not None and decode.step.q == 1 and decode.step.requests == 8
    verify = plan(StepContext(8, True, rows=VERIFY), BATCHES, q=4)
    assert verify.step is not None and verify.step.q == 4 and verify.step.requests == 2
    as_decodes = dict(VERIFY, indexer=Rows(decodes=2, decode_tokens=8, indexer=True))
    assert plan(StepContext(8, True, rows=as_decodes), BATCHES, q=4).step is not None


@pytest.mark.parametrize(
    "context, why",
    [
        (StepContext(8, False, rows=VERIFY), "capture"),
        (StepContext(8, True, pipeline_input=True, rows=VERIFY), "pipeline"),
        (StepContext(80, True, rows=DECODE), "planned token count"),
        (
            StepContext(
                6, True, rows={"kda": Rows(spec_decodes=1, spec_decode_tokens=4, spec_state_rows=1)}
            ),
            "planned token count",
        ),
        (StepContext(8, True, graph="PIECEWISE", rows=VERIFY), "PIECEWISE"),
        (StepContext(8, True, graph="NONE", rows=VERIFY), "NONE"),
        (
            StepContext(8, True, rows=dict(VERIFY, kda=Rows(prefills=1, prefill_tokens=8))),
            "uniform",
        ),
        (
            StepContext(
                8,
                True,
                rows=dict(
                    VERIFY,
                    kda=Rows(
                        decodes=1,
                        decode_tokens=1,
                        spec_decodes=1,
                        spec_decode_tokens=4,
                        spec_state_rows=2,
                    ),
                ),
            ),
            "uniform",
        ),
        (
            StepContext(8, True, rows=dict(VERIFY, mla=Rows(decodes=3, decode_tokens=8))),
            "uniform",
        ),
        (StepContext(8, True, aux_layers=(2,), rows=VERIFY), "aux"),
        (StepContext(8, True, rows={}), "metadata"),
    ],
    ids=[
        "eager",
        "pipeline-input",
        "above-cap",
        "not-planned-count",
        "piecewise",
        "no-graph",
        "prompt-rows",
        "mixed-decode-and-verify",
        "non-uniform-verify",
        "aux-layers",
        "no-metadata",
    ],
)
def test_seed_fallbacks_run_stock(context, why, caplog):
    with caplog.at_level(logging.INFO, logger="glm5_runtime"):
        decision = plan(context, BATCHES, q=4)
    assert decision.step is None and why in decision.reason


def test_draft_plans_prefills_of_q_and_decodes_of_one():
    prefill = {"mla": Rows(decodes=2, decode_tokens=8), "indexer": VERIFY["indexer"]}
    assert plan_draft(StepContext(8, True, rows=prefill), BATCHES, q=4).step.q == 4
    decode = {"mla": Rows(decodes=8, decode_tokens=8)}
    assert plan_draft(StepContext(8, True, rows=decode), BATCHES, q=4).step.q == 1
    assert plan_draft(StepContext(8, False, rows=decode), BATCHES, q=4).step is None
    # q = 1 trusts the capture's padding (the seed's rule): only prompt rows or speculative
    # rows make a one-token step stock.
    mixed = {"mla": Rows(prefills=1, prefill_tokens=5, decodes=3, decode_tokens=3)}
    assert plan_draft(StepContext(8, True, rows=mixed), BATCHES, q=4).step is None
