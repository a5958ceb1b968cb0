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
        # The whole MoE layer (router, routing, routed + shared experts, summed) in four
        # launches, the shared expert one more expert of them. The routes are grouped by
        # expert, each group's weights read once for its tokens: `per_route`, one group per
        # touched expert holding all of its tokens (every expert read once a step);
        # `grouped`, groups of at most 16 tokens (smaller MMA tiles, a hot expert read once
        # per 16); `fused_router`, per_route's groups with the router GEMM inside the
        # routing launch (three launches).
        "moe": frozenset({"per_route", "grouped", "fused_router"}),
        # The shared expert's FP8 SwiGLU MLP as two skinny GEMMs (where `moe` does not run
        # it within its own launches).
        "shared_expert": frozenset({"gemv"}),
        # The BF16 router GEMM as split-K.
        "router": frozenset({"split_k"}),
        # (All-reduce +) mHC post + Sinkhorn pre + RMSNorm in one kernel: the Triton kernel
        # (every world size), or the CuTe DSL cluster kernel (world size 1; Triton above);
        # `cute_deferred`: the CuTe kernel leaving each comb's Sinkhorn to the next
        # boundary, which runs it before its PDL wait.
        "boundary": frozenset({"triton", "cute", "cute_deferred"}),
        # Layers 0-2's dense SwiGLU MLP as FP8 block-scaled GEMVs.
        "dense_mlp": frozenset({"gemv"}),
        # KDA conv + gate + recurrence + gated norm in one kernel; `fused_gates`: with the
        # forget and output gates' low-rank up-projections (f_b, g_b) inside it too.
        "kda": frozenset({"fused", "fused_gates"}),
        # KDA input projections as one skinny GEMM, and its output projection.
        "kda_proj": frozenset({"gemm"}),
        # MLA / indexer projections routed to split-K skinny GEMMs.
        "dsa_proj": frozenset({"split_k"}),
        "dsa_indexer": frozenset({"fused"}),
        "dsa_attn": frozenset({"sparse"}),
        "dsa_kpool": frozenset({"fused"}),
        "logits_gather": frozenset({"nvlink"}),
        # The LM head GEMM as glm5-kernels' skinny GEMM.
        "logits_head": frozenset({"skinny"}),
        # The vocab-parallel token embedding (the masked row lookup) in one launch.
        "embed": frozenset({"gather"}),
    }
)

# Named by the seed's design but not built: a table naming one is refused with the reason
# (`stage` or `stage.choice`), never run as something else.
NOT_BUILT: MappingProxyType[str, str] = MappingProxyType(
    {
        "kda_gate": "not built (the seed's CuTe KDA gate; the fused `kda` step computes the gate)",
        "dsa_value_up": "not built (the seed's CuTe value-up; `dsa_attn: sparse` includes it)",
        "kda.split_gate": "not built (the forget gate in its own kernel; `fused` is)",
        "logits_head.cute": "not built (the seed's CuTe LM head; `skinny` is)",
    }
)
