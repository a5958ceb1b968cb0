"""The stage registry: every stage of the specialized decode and the choices it accepts.

A stage's choice names the algorithm that replaces the stock operation at a token count;
no entry (or ``null``) at a token count means the stock path runs there.
"""

from __future__ import annotations

from types import MappingProxyType

# The specialized decode plans steps of at most this many tokens (batch x q); larger steps
# run the stock forward, so a table entry above it could never be used.
MAX_TOKENS = 64

# GPU families with a default table (package data ``defaults/<family>.json``).
FAMILIES = ("sm90", "sm100")

STAGES: MappingProxyType[str, frozenset[str]] = MappingProxyType(
    {
        # Routed experts: one kernel per (token, route) pair, or grouped by unique expert
        # with the shared expert as one more expert.
        "moe": frozenset({"per_route", "grouped"}),
        # The shared expert as fused FP8 GEMVs on a side stream.
        "shared_expert": frozenset({"gemv"}),
        # The BF16 router GEMM as split-K.
        "router": frozenset({"split_k"}),
        # All-reduce + mHC post + Sinkhorn pre + RMSNorm in one kernel.
        "boundary": frozenset({"nvlink"}),
        # Layers 0-2's dense SwiGLU MLP as FP8 block-scaled GEMVs.
        "dense_mlp": frozenset({"gemv"}),
        # KDA conv + gate + recurrence + gated norm in one kernel; `split_gate` computes
        # the forget gate in a separate kernel and folds it into the recurrence.
        "kda": frozenset({"fused", "split_gate"}),
        # KDA input projections as one skinny GEMM.
        "kda_proj": frozenset({"gemm"}),
        "kda_gate": frozenset({"cute"}),
        # MLA / indexer projections routed to split-K skinny GEMMs.
        "dsa_proj": frozenset({"split_k"}),
        "dsa_indexer": frozenset({"fused"}),
        "dsa_attn": frozenset({"sparse"}),
        "dsa_value_up": frozenset({"cute"}),
        "dsa_kpool": frozenset({"fused"}),
        "logits_gather": frozenset({"nvlink"}),
        # The LM head GEMM: the seed's CuTe kernel, or glm5-kernels' skinny GEMM.
        "logits_head": frozenset({"cute", "skinny"}),
    }
)
