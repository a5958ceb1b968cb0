"""Whole-sublayer stages the layer loop runs itself (`LayerStages.attention`): a KDA layer's
attention from its input rows to its o_proj output, every op a stage op of the policy's,
on the backbone's caches at the step's neutral placement (seam 5). Nothing of the backbone's
sublayer runs, and no forward of its is shadowed.

The ops are found by name among those the decode serves for the step's token count
(`KDA_PARTS` under `layers.{i}.self_attn.`), so each stays an op of its own stage for the
kernel table, the shadow checks of the tests and `prepare`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from .protocol import KdaPlacement

__all__ = ["KDA_PARTS", "kda_attention"]

# A KDA sublayer's ops by name under `layers.{i}.self_attn.`: the fused input projection
# (q | k | v | b | f_a | g_a), the gates' up-projections (absent where the core projects
# them itself: `fused_gates`), the core (conv -> gates -> delta rule -> gated norm), o_proj.
KDA_PARTS = ("in_proj_qkvbfg_a.weight", "forget_gate.f_b_proj.weight", "g_b_proj.weight",
             "kda", "o_proj.weight")  # fmt: skip


def kda_attention(x: Tensor, ops: Mapping[str, Any], conv: Tensor, recurrent: Tensor,
                  place: KdaPlacement) -> Tensor:  # fmt: skip
    """x [M, D] BF16 rows (M >= the placement's R * T: a padded step's rows past them run
    o_proj on zeros) -> the layer's TP-partial attention output [M, D]; the conv and
    recurrent states updated in place (`ops`: KDA_PARTS -> op, a `KdaDecode` as "kda")."""
    core = ops["kda"]
    r, t = place.write_slots.shape
    n = r * t
    projected = ops["in_proj_qkvbfg_a.weight"](x)
    qkv, b, f_a, g_a = projected.split(kda_widths(core, ops), dim=-1)
    if core.low_rank:  # the core projects f_b and g_b itself
        f, gate = f_a, g_a
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
    else:
        rf, rg = ops["forget_gate.f_b_proj.weight"].k, ops["g_b_proj.weight"].k
    return [core.conv_weight.shape[0], core.heads, rf, rg]


def _aligned(rows: Tensor) -> Tensor:
    """Strided rows as the skinny GEMMs take them (16-byte aligned), else a copy."""
    return rows if rows.data_ptr() % 16 == 0 else rows.contiguous()
