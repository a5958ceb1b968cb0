"""The routing decision against an oracle restated from the seed's rule (`seed_accepts`,
`seed_plans`; never `is_decode` itself): `plan` plans exactly the steps the seed plans and
`is_decode` accepts exactly the rows it accepts (4,000 generated row-count / capture-state
combinations, drawn mostly near the boundary between planned and stock); every accepted row
with one field off decides as the seed says (each field the rule reads rejects under some
perturbation); every case the seed lists runs stock; and `plan` is a pure function of its
inputs (so every TP rank decides alike)."""

import logging
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from glm5_runtime.plan import Rows, StepContext, is_decode, plan, plan_draft

BATCHES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)


def seed_accepts(rows: Rows, q: int, b: int) -> bool:
    """The seed's rule for one layer's metadata (decode.txt, `is_decode`), restated as the
    rows each metadata kind holds in a planned step of b tokens at q, not read from the code
    under test. q = 1 (a pure decode) trusts the FULL graph's padding: any rows but prompt
    rows and speculative rows. q > 1 (a uniform verify of b / q requests):
      - the indexer's metadata holds them as b / q decodes of q tokens, or as b / q short
        prefills of q tokens and no decodes;
      - metadata without speculative fields (MLA) as b / q decodes of q tokens;
      - KDA metadata as speculative decodes of q tokens each, with b / q state rows, no plain
        decodes and no prompt rows."""
    if q == 1:
        return rows.prefills == 0 and rows.spec_decodes in (None, 0)
    requests = b // q if b % q == 0 else None
    if rows.indexer:
        as_decodes = rows.prefills == 0 and rows.decodes == requests and rows.decode_tokens == b
        as_prefills = (
            rows.prefills > 0 and rows.prefills == requests and rows.prefill_tokens == b
        ) and rows.decodes == 0
        return as_decodes or as_prefills
    if rows.prefills:
        return False
    if rows.spec_decodes is None:  # MLA
        return rows.decodes == requests and rows.decode_tokens == b
    return (
        rows.decodes == 0
        and rows.spec_state_rows is not None
        and rows.spec_state_rows == requests
        and rows.spec_decode_tokens == rows.spec_decodes * q
    )


def seed_plans(context: StepContext, batches, q: int) -> int | None:
    """The seed's step decision: the planned step's q, or None where the stock forward runs
    (outside a capture, a pipeline input, an unplanned count, aux layers, a graph that is
    not FULL, no metadata, a count that q does not divide, or a layer not uniform). The
    step's q is the decoder's where any layer has speculative decodes, else 1."""
    b = context.tokens
    if not (context.capturing and context.graph == "FULL" and not context.pipeline_input):
        return None
    if b not in batches or context.aux_layers or not context.rows:
        return None
    step_q = q if any(r.spec_decodes for r in context.rows.values()) else 1
    if b % step_q or not all(seed_accepts(r, step_q, b) for r in context.rows.values()):
        return None
    return step_q


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
    step_q = seed_plans(context, BATCHES, q)  # the seed's rule, not is_decode
    if decision.step is None:
        assert step_q is None and decision.reason, "ran stock a step the seed plans"
    else:
        assert step_q is not None, "planned a step that a condition rejects"
        assert decision.step.q == step_q and decision.step.tokens == context.tokens
        assert decision.step.requests * step_q == context.tokens
    for r in context.rows.values():
        for layer_q in {1, q}:
            assert is_decode(r, layer_q, context.tokens) == seed_accepts(r, layer_q, context.tokens)
    # A pure function of the inputs: every rank, given the same step, decides the same.
    assert plan(context, BATCHES, q) == decision


def accepted(q: int, b: int) -> dict[str, Rows]:
    """Each metadata kind's rows in a planned step of b tokens at q (b a multiple of q)."""
    r = b // q
    if q == 1:
        return {
            "kda": Rows(decodes=b, decode_tokens=b, spec_decodes=0, spec_decode_tokens=0),
            "mla": Rows(decodes=b, decode_tokens=b),
            "indexer": Rows(decodes=b, decode_tokens=b, indexer=True),
        }
    return {
        "kda": Rows(spec_decodes=r, spec_decode_tokens=b, spec_state_rows=r),
        "mla": Rows(decodes=r, decode_tokens=b),
        "indexer": Rows(decodes=r, decode_tokens=b, indexer=True),
        "indexer-prefill": Rows(prefills=r, prefill_tokens=b, indexer=True),
    }


def one_field_off(rows: Rows, b: int, q: int):
    """(rows, b) with one thing changed: a count one more or one less, an absent field
    present or a present one absent, the indexer flag flipped, or the step's token count one
    more, one less or q more (rows consistent among themselves but not with b)."""
    for name, value in vars(rows).items():
        if isinstance(value, bool):
            yield replace(rows, **{name: not value}), b
        elif value is None:
            yield replace(rows, **{name: 0}), b
            yield replace(rows, **{name: 1}), b
        else:
            yield from ((replace(rows, **{name: v}), b) for v in (value + 1, value - 1) if v >= 0)
            if name.startswith("spec_"):
                yield replace(rows, **{name: None}), b
    for other in (b + 1, b - 1, b + q):
        yield rows, other


@pytest.mark.parametrize("q", range(1, 9))
def test_one_field_off_an_accepted_row_decides_as_the_seed(q):
    """Every accepted row (each metadata kind, every planned count q divides) is accepted,
    and each of its one-field perturbations decides as the seed's rule says; every field the
    rule reads is one that some perturbation makes it reject."""
    rejected = set()
    for b in (q, 2 * q, 8 * q):  # one request, several, the most a 64-token step holds
        for kind, rows in accepted(q, b).items():
            assert seed_accepts(rows, q, b) and is_decode(rows, q, b), (kind, rows)
            for off, at in one_field_off(rows, b, q):
                want = seed_accepts(off, q, at)
                assert is_decode(off, q, at) == want, (kind, off, q, at, want)
                if not want:
                    changed = {n for n, v in vars(off).items() if getattr(rows, n) != v}
                    rejected |= {(kind, n) for n in changed} | ({(kind, "b")} if at != b else set())
    if q == 1:  # only prompt rows and speculative rows make a pure decode stock
        fields = {"kda": {"prefills", "spec_decodes"}, "mla": {"prefills"},
                  "indexer": {"prefills"}}  # fmt: skip
    else:
        counts = {"prefills", "decodes", "decode_tokens", "b"}
        fields = {
            "kda": {"prefills", "decodes", "spec_decodes", "spec_decode_tokens",
                    "spec_state_rows", "indexer", "b"},
            "mla": counts,
            "indexer": counts,
            "indexer-prefill": {"prefills", "prefill_tokens", "decodes", "indexer", "b"},
        }  # fmt: skip
    for kind in accepted(q, q):
        assert fields[kind] <= {n for k, n in rejected if k == kind}, kind


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
