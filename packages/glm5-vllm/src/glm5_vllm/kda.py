"""The fused KDA stage inside vLLM's KDA layer (`Glm5NextLinearAttention`): the stage's
constants from the layers (`kda_constants`: `Backbone.kda`), the small weights' HF names, and
the layer the backbone runs where the route `layers.{i}.self_attn.kda` is set
(`kda_attention`): vLLM's projections, the fused step on the layer's own caches at the
placement of the step's GDN metadata, o_proj — or vLLM's forward for a step that placement
does not cover."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from glm5_runtime.protocol import Kda

from .metadata import kda_placement

__all__ = ["KDA_CONV", "KDA_WEIGHTS", "kda_attention", "kda_constants"]

# The KDA layer's small weights, by HF name under `self_attn.`, where vLLM keeps them on the
# layer itself; its conv weight is three modules there (q_conv1d, k_conv1d, v_conv1d).
KDA_WEIGHTS = {"forget_gate.dt_bias": "dt_bias", "forget_gate.A_log": "A_log"}
KDA_CONV = ("q_conv1d", "k_conv1d", "v_conv1d")


def kda_constants(modules: list[nn.Module]) -> Kda | None:
    """The fused KDA stage's constants where every KDA layer is vLLM's GLM-5.3-Flash linear
    attention (q | k | v | b | f_a | g_a in one projection, the safe or softplus gate, the
    sigmoid-gated output norm) with one lower bound and norm eps, and the conv state is
    channels-last (vLLM's default "SD" layout, the one the kernel reads); None otherwise
    (then KDA stays vLLM's)."""
    needed = ("in_proj_qkvbfg_a", "f_b_proj", "g_b_proj", "o_norm", "o_proj", *KDA_CONV)
    if not modules or not all(hasattr(m, n) for m in modules for n in needed):
        return None
    if any(getattr(m, "_conv_state_dim_first", True) for m in modules):
        return None
    found = {(m.kda_lower_bound if m.kda_safe_gate else None, m.o_norm.eps) for m in modules}
    if len(found) != 1 or modules[0].o_norm.activation != "sigmoid":
        return None
    lower_bound, eps = found.pop()
    return Kda(None if lower_bound is None else float(lower_bound), float(eps))


def kda_attention(module: nn.Module, op: Any, x: Tensor, step: Any) -> Tensor:
    """A KDA layer with the fused KDA step (conv -> gates -> delta rule -> gated norm)
    between vLLM's projections (routed as the policy says) and o_proj, for a step whose GDN
    metadata is a plain decode or a uniform verify of at most the op's tokens (the placement
    `metadata.kda_placement` gives, derived once a step from `step`: a `VllmStep`); vLLM's
    own forward for any other step."""
    md = step.metadata.get(module.prefix)
    place = None if md is None else step.once("kda", (md,), lambda: kda_placement(md))
    if place is None or not op.supports(place.write_slots.shape[1]):
        return module(hidden_states=x, positions=step.positions)
    r, t = place.write_slots.shape
    n, p = r * t, module.local_projection_size
    h, d = module.local_num_heads, module.head_dim
    projected = module.in_proj_qkvbfg_a(x)[0]
    qkv, beta, f_a, g_a = projected.split([3 * p, h, d, d], dim=-1)
    f, gate = module.f_b_proj(f_a)[0], module.g_b_proj(g_a)[0]
    out = torch.empty(x.shape[0], h * d, dtype=qkv.dtype, device=qkv.device)
    if n < out.shape[0]:  # a padded step: finite rows into o_proj past the real ones
        out[n:].zero_()
    conv, recurrent = module.kv_cache

    def steps(rows: Tensor) -> Tensor:  # [N, width] rows -> [R, T, width], a view
        return rows[:n].view(r, t, rows.shape[-1])

    op(steps(qkv), steps(f), steps(beta), steps(gate), conv, recurrent, **place.kwargs(),
       out=steps(out))  # fmt: skip
    return module.o_proj(out)[0]
