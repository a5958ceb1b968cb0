"""Whole-sublayer stages the layer loop runs itself (`LayerStages.attention`): a KDA or MLA
layer's attention from its input rows to its o_proj output, every op a stage op of the
policy's, on the backbone's caches at the step's neutral placement (seam 5). Nothing of the
backbone's sublayer runs, and no forward of its is shadowed.

The ops are found by name among those the decode serves for the step's token count
(`KDA_PARTS`, `MLA_PARTS` under `layers.{i}.self_attn.`), so each stays an op of its own
stage for the kernel table, the shadow checks of the tests and `prepare`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from .protocol import KdaPlacement, MlaCaches, MlaPlacement

__all__ = ["GATES_B", "INDEXER_PARTS", "KDA_PARTS", "MLA_PARTS", "Q_B_WQ_B", "kda_attention",
           "mla_attention"]  # fmt: skip

# A KDA sublayer's ops by name under `layers.{i}.self_attn.`: the fused input projection
# (q | k | v | b | f_a | g_a), the gates' up-projections (apart, or as one two-block op;
# absent where the core projects them itself: `fused_gates`), the core (conv -> gates ->
# delta rule -> gated norm), o_proj.
KDA_PARTS = ("in_proj_qkvbfg_a.weight", "forget_gate.f_b_proj.weight", "g_b_proj.weight",
             "kda", "o_proj.weight", "f_b_g_b_proj")  # fmt: skip
GATES_B = KDA_PARTS[-1]  # f_b and g_b as one two-block projection (their inputs adjacent)


def kda_attention(x: Tensor, ops: Mapping[str, Any], conv: Tensor, recurrent: Tensor,
                  place: KdaPlacement) -> Tensor:  # fmt: skip
    """x [M, D] BF16 rows (M >= the placement's R * T: a padded step's rows past them run
    o_proj on zeros) -> the layer's TP-partial attention output [M, D]; the conv and
    recurrent states updated in place (`ops`: KDA_PARTS -> op, a `KdaDecode` as "kda")."""
    core = ops["kda"]
    r, t = place.write_slots.shape
    n = r * t
    projected = ops["in_proj_qkvbfg_a.weight"](x)
    widths = kda_widths(core, ops)
    qkv, b, f_a, g_a = projected.split(widths, dim=-1)
    if core.low_rank:  # the core projects f_b and g_b itself
        f, gate = f_a, g_a
    elif ops.get(GATES_B) is not None:  # f_a | g_a: adjacent columns, one launch
        gates = ops[GATES_B](_aligned(projected.narrow(-1, sum(widths[:2]), sum(widths[2:]))))
        f, gate = gates.split(gates.shape[-1] // 2, dim=-1)
    else:
        f = ops["forget_gate.f_b_proj.weight"](_aligned(f_a))
        gate = ops["g_b_proj.weight"](_aligned(g_a))
    out = torch.empty(x.shape[0], core.heads * core.v, dtype=x.dtype, device=x.device)
    if n < out.shape[0]:  # a padded step: finite rows into o_proj past the real ones
        out[n:].zero_()

    def steps(rows: Tensor) -> Tensor:  # [N, width] rows -> [R, T, width], a view
        return rows[:n].view(r, t, rows.shape[-1])

    core(steps(qkv), steps(f), steps(b), steps(gate), conv, recurrent, **place.kwargs(),
         out=steps(out))  # fmt: skip
    return ops["o_proj.weight"](out)


def kda_widths(core: Any, ops: Mapping[str, Any]) -> list[int]:
    """The fused input projection's parts' widths: q | k | v, b, f_a, g_a."""
    if core.low_rank:
        rf, rg = core.f_width, core.gate_width
    elif ops.get(GATES_B) is not None:
        rf = rg = ops[GATES_B].k
    else:
        rf, rg = ops["forget_gate.f_b_proj.weight"].k, ops["g_b_proj.weight"].k
    return [core.conv_weight.shape[0], core.heads, rf, rg]


def _aligned(rows: Tensor) -> Tensor:
    """Strided rows as the skinny GEMMs take them (16-byte aligned), else a copy."""
    return rows if rows.data_ptr() % 16 == 0 else rows.contiguous()


# An MLA layer's ops by name under `layers.{i}.self_attn.`: the fused q_a | kv_a projection,
# the input norms + latent write, q_b, the attention over the selection (with the query
# absorption and value-up), o_proj; a full indexer's (INDEXER_PARTS) besides: its query
# projection, the key | gate | head-weight projection, the pool write and the selection.
INDEXER_PARTS = ("indexer.wq_b.weight", "indexer.inputs", "indexer.kpool", "indexer.topk")
MLA_PARTS = ("fused_qkv_a_proj.weight", "latent", "q_b_proj.weight", "dsa_attn",
             "o_proj.weight", *INDEXER_PARTS)  # fmt: skip
# A full indexer layer's q_b and wq_b as one projection of q_resid (`Projection(then=)`), in
# place of both.
Q_B_WQ_B = "q_b_wq_b"


def mla_attention(x: Tensor, ops: Mapping[str, Any], caches: MlaCaches, place: MlaPlacement,
                  selection: Tensor | None) -> tuple[Tensor, Tensor]:  # fmt: skip
    """x [M, D] BF16 rows (M >= the placement's N = R * T: a padded step's rows past them run
    o_proj on zeros) -> (the layer's TP-partial attention output [M, D], the token positions
    it attended [N, W]); the latent cache, and a full indexer's pools and ring, written in
    place. `selection`: a shared-indexer layer's (the last full layer's), else None: the
    layer's own indexer selects."""
    write, attend = ops["latent"], ops["dsa_attn"]
    n = place.request.shape[0]
    rows = x[:n]
    projected = ops["fused_qkv_a_proj.weight"](x)[:n]
    q_a, kv_a = projected.split([write.q_dim, write.latent_dim], dim=-1)
    q_resid = write(q_a, kv_a, caches.latent.view(-1, write.latent_dim), place.slots)
    both, q_index = ops.get(Q_B_WQ_B), None
    if both is not None:  # q | the indexer's query: column views of one output
        qs = both(q_resid)
        q, q_index = qs[:, : both.n_first], qs[:, both.n_first :]
    else:
        q = ops["q_b_proj.weight"](q_resid)
    q = q.view(n, attend.heads, -1)
    if selection is None:
        selection = _select(rows, q_resid, ops, caches, place, q_index)
    out = torch.empty(x.shape[0], attend.heads * attend.vd, dtype=x.dtype, device=x.device)
    if n < out.shape[0]:  # a padded step: finite rows into o_proj past the real ones
        out[n:].zero_()
    attend(attend.absorb(q), caches.latent, place.block_table, place.request, selection,
           out=out[:n].view(n, attend.heads, attend.vd))  # fmt: skip
    return ops["o_proj.weight"](out), selection


def _select(x: Tensor, q_resid: Tensor, ops: Mapping[str, Any], caches: MlaCaches,
            place: MlaPlacement, q: Tensor | None) -> Tensor:  # fmt: skip
    """A full indexer's step: the pools and ring written, each row's selected token
    positions [N, W] int32 (-1: none). `q`: its query rows where q_b's launch made them."""
    write, select = ops["indexer.kpool"], ops["indexer.topk"]
    (r, t), n, hd = place.positions.shape, x.shape[0], write.head_dim
    if q is None:
        q = ops["indexer.wq_b.weight"](q_resid)
    q = q.view(r, t, write.heads, hd)
    sums = ops["indexer.inputs"](x)  # [N, hd | hd | heads] FP32: key, gate, head weights
    k, gate = (sums[:, i * hd : (i + 1) * hd].view(r, t, hd) for i in (0, 1))
    q8, q_scale = write(k, gate, q, caches.ring, caches.pools, place.pool_table,
                        place.positions, place.tail_rows)  # fmt: skip
    out = None if caches.selected is None else caches.selected[:n, : select.width]
    return select(q8.view(n, write.heads, hd), q_scale.view(n, write.heads), sums[:, 2 * hd :],
                  caches.pools, place.pool_table, place.request, place.positions.reshape(n),
                  out=out)  # fmt: skip
