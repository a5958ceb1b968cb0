"""The HBM floor of a step: the least traffic one backbone step on the held ranks must move.

Counted once a step: every backbone weight but the routed experts and the embedding table
(a fused projection once, not its parts; no MTP layer), the routed experts the step's
routing selected, and per request — a verify step's q tokens share their request's caches —
the latents one query selects, every pool key and the KDA states read and written. The
selected latents of a request's tokens may differ: one query's share is the least any
verify step reads. `kernel_table.owner_bytes` splits the same bytes by owner."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch

from .reference import ReferenceModel
from .reference.stages import FUSED_PARTS

__all__ = ["cache_bytes", "expert_hits", "floor_bytes", "touched_experts"]


def expert_hits(model: ReferenceModel, tokens: int, touched: dict[int, int] | None = None):
    """Per MoE layer, the share of its routed experts a step reads: the experts its routing
    selected (`touched`, as `touched_experts` counts them), else — a layer not in `touched`
    — the uniform-routing expectation 1 - (1 - k/E)^tokens."""
    g = model.g
    e, k = g.n_routed_experts, g.num_experts_per_tok
    expected = 1 - (1 - k / e) ** tokens
    touched = touched or {}
    moe = (i for i, t in enumerate(g.mlp_layer_types) if t != "dense")
    return {i: touched[i] / e if i in touched else expected for i in moe}


def touched_experts(model: ReferenceModel, forward: Callable[[], object]) -> dict[int, int]:
    """Per MoE layer, how many routed experts one eager run of `forward` (a step of the
    reference ranks' stages) selected: every rank's `experts` stage is wrapped for the run
    and reads the routing it is handed (ranks route the same tokens: their union)."""
    seen: dict[int, set[int]] = defaultdict(set)

    def recording(experts):
        def run(prefix: str, x, ids, weights):
            seen[int(prefix.split(".")[1])].update(ids.unique().tolist())
            return experts(prefix, x, ids, weights)

        return run

    own = [(rank, rank.__dict__.get("experts")) for rank in model.ranks]
    for rank, _ in own:
        rank.experts = recording(rank.experts)
    try:
        with torch.no_grad():
            forward()
    finally:
        for rank, experts in own:
            del rank.experts
            if experts is not None:
                rank.experts = experts
    return {i: len(s) for i, s in seen.items()}


def cache_bytes(model: ReferenceModel, requests: int, context: int) -> dict[str, int]:
    """Bytes of cache one layer of each kind moves in a step of `requests` requests at
    `context`: "latents" (one query's selected latents), "pools" (every pool key of the
    request), "states" (the KDA states read and written)."""
    g = model.g
    selected = min(context + 1, g.index_topk + g.index_kpool - 1)
    pool = model.ranks[0].c.kpool[g.mla_layers[0]][0, 0].nbytes if g.mla_layers else 0
    heads = g.linear_num_heads // g.tp_size
    return {
        "latents": requests * selected * g.kv_lora_rank * 2,
        "pools": requests * (context // g.index_kpool) * pool,
        "states": requests * 2 * heads * g.linear_head_dim**2 * 4,
    }


def _layer(name: str) -> int:
    return int(name.split(".")[1])


def floor_bytes(
    model: ReferenceModel,
    tokens: int,
    context: int,
    requests: int | None = None,
    touched: dict[int, int] | None = None,
) -> float:
    """The step's floor traffic (the module docstring): `tokens` rows of `requests` requests
    (default one token each), the routed experts by `expert_hits(model, tokens, touched)`."""
    g = model.g
    hits = expert_hits(model, tokens, touched)
    mtp = tuple(f"layers.{i}." for i in model.mtp_layers)
    weights = 0.0
    for rank in model.ranks:
        for n, t in rank.w.items():
            # A fused projection's parts are views of it: their bytes count once.
            fused = n.removesuffix(".weight").rpartition(".")[2] in FUSED_PARTS
            if n.startswith(mtp) or fused or "embed_tokens" in n:
                continue
            weights += t.nbytes * (hits[_layer(n)] if ".experts." in n else 1)
    c = cache_bytes(model, tokens if requests is None else requests, context)
    attention = len(g.mla_layers) * (c["latents"] + c["pools"])
    return weights + attention + len(g.kda_layers) * c["states"]
