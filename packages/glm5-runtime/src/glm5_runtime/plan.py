"""One routing decision per step: is it a planned decode, or does the stock forward run?

The decision reads neutral row counts (seam 2 of the architecture): the vLLM adapter converts
each layer's real attention metadata (KDA / GDN, MLA, the DSA indexer's) into `Rows`, and the
reference backbone builds them directly. `plan` is a pure function of its inputs, which are
the same on every TP rank, so all ranks take one path.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

__all__ = [
    "Plan",
    "Rows",
    "Step",
    "StepContext",
    "info_once",
    "is_decode",
    "plan",
    "plan_draft",
]

logger = logging.getLogger("glm5_runtime")
_said: set[str] = set()


def info_once(message: str) -> None:
    """Log `message` at INFO the first time it is seen (the decision repeats every step)."""
    if message not in _said:
        _said.add(message)
        logger.info(message)


@dataclass(frozen=True)
class Rows:
    """One layer's step metadata as row counts.

    `spec_decodes` / `spec_decode_tokens` / `spec_state_rows` are None for metadata without
    speculative fields (MLA); `spec_state_rows` is the row count of the KDA metadata's
    spec_state_indices_tensor (None when the tensor is absent). `indexer`: the DSA indexer's
    metadata, which files q-token verify rows either as decodes or as short prefills."""

    prefills: int = 0
    prefill_tokens: int = 0
    decodes: int = 0
    decode_tokens: int = 0
    spec_decodes: int | None = None
    spec_decode_tokens: int | None = None
    spec_state_rows: int | None = None
    indexer: bool = False


def is_decode(rows: Rows, q: int, b: int) -> bool:
    """Whether one layer's rows are a pure decode (q = 1) or a uniform verify of q tokens
    per request, b tokens in all. FULL graphs pad whole requests, so every row verifies q."""
    if q > 1 and rows.indexer:
        if rows.prefills:
            return not rows.decodes and rows.prefills * q == rows.prefill_tokens == b
        return rows.decode_tokens == rows.decodes * q == b
    if rows.prefills:
        return False
    if q == 1:
        return not rows.spec_decodes
    if rows.spec_decodes is None:
        return rows.decode_tokens == rows.decodes * q == b
    full = rows.spec_state_rows is not None and rows.spec_state_rows * q == b
    return full and not rows.decodes and rows.spec_decode_tokens == (rows.spec_decodes or 0) * q


@dataclass(frozen=True)
class StepContext:
    """What one step looks like to the routing decision.

    tokens: rows of the step (b); capturing: inside a CUDA-graph capture; graph: the
    runtime's CUDA-graph mode for the step ("FULL", "PIECEWISE" or "NONE"); pipeline_input:
    intermediate tensors from an earlier pipeline stage; aux_layers: layers whose hidden
    states a drafter collects (EAGLE-3 style); rows: each layer's metadata."""

    tokens: int
    capturing: bool
    graph: str = "FULL"
    pipeline_input: bool = False
    aux_layers: tuple[int, ...] = ()
    rows: Mapping[str, Rows] = field(default_factory=dict)


@dataclass(frozen=True)
class Step:
    """A planned step: q tokens for each of `requests` requests (q = 1: a pure decode)."""

    q: int
    tokens: int

    @property
    def requests(self) -> int:
        return self.tokens // self.q


@dataclass(frozen=True)
class Plan:
    """`step` when the step runs planned, else None and the `reason` the stock path runs."""

    step: Step | None
    reason: str = ""


def plan(context: StepContext, batches: Sequence[int], q: int) -> Plan:
    """The step's plan for a decoder whose planned token counts are `batches` and whose MTP
    verify holds q tokens per request (q = 1 without speculation).

    The stock forward runs for: steps outside a CUDA-graph capture (profiling, warm-up and
    the warm-up run before each capture, so every stock kernel runs before its capture);
    pipeline-stage inputs; token counts that are not planned (above the cap or not a multiple
    of q); PIECEWISE graphs (keyed by token count alone, so captured stock); steps with prompt
    rows; speculative steps whose requests do not all verify q tokens; drafters that collect
    aux hidden states."""
    b = context.tokens
    reason = ""
    if not context.capturing:
        reason = "not inside a CUDA-graph capture"
    elif context.pipeline_input:
        reason = "a pipeline-parallel stage input"
    elif b not in batches:
        reason = f"{b} tokens is not a planned token count {tuple(batches)}"
    elif context.aux_layers:
        reason = f"aux hidden-state layers {context.aux_layers}"
    elif context.graph != "FULL":
        reason = f"a {context.graph} CUDA graph"
    elif not context.rows:
        reason = "no attention metadata"
    if reason:
        return _stock(b, reason)
    step_q = q if any(r.spec_decodes for r in context.rows.values()) else 1
    if b % step_q:
        return _stock(b, f"{b} tokens is not a multiple of q={step_q}")
    for name, rows in context.rows.items():
        if not is_decode(rows, step_q, b):
            return _stock(b, f"{name} is not a uniform q={step_q} step: {rows}")
    info_once(f"GLM-5.3-Flash specialized decode plans {b}-token steps (q={step_q})")
    return Plan(Step(step_q, b))


def plan_draft(context: StepContext, batches: Sequence[int], q: int) -> Plan:
    """The MTP draft step's plan: planned only inside FULL-graph captures of uniform draft
    prefills (q tokens per request) and draft decodes (one token per request)."""
    b = context.tokens
    if not context.capturing or context.graph != "FULL" or b not in batches or not context.rows:
        return Plan(None, "not a FULL-graph capture of a planned token count")
    for step_q in dict.fromkeys((q, 1)):
        if b % step_q == 0 and all(is_decode(r, step_q, b) for r in context.rows.values()):
            info_once(f"Specialized draft plans {b}-token steps (q={step_q})")
            return Plan(Step(step_q, b))
    return _stock(b, "a draft step that is neither a uniform prefill nor a decode")


def _stock(b: int, reason: str) -> Plan:
    info_once(f"Specialized decode runs a {b}-token step stock: {reason}")
    return Plan(None, reason)
