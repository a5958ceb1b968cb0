"""vLLM's KDA layers (`Glm5NextLinearAttention`) for the fused KDA sublayer: its constants
from the layers (`kda_constants`: `Backbone.kda`) and the HF names of the weights vLLM keeps
on the layer itself. The runtime runs a served layer whole (`glm5_runtime.sublayers`) over
these weights, the layer's caches and the placement of the step's GDN metadata
(`VllmBackbone.kda_caches`, `kda_placement`)."""

from __future__ import annotations

from torch import nn

from glm5_runtime.protocol import Kda

__all__ = ["KDA_CONV", "KDA_MODULES", "KDA_WEIGHTS", "kda_constants"]

# The KDA layer's small weights, by HF name under `self_attn.`, where vLLM keeps them on the
# layer itself; its conv weight is three modules there (q_conv1d, k_conv1d, v_conv1d).
KDA_WEIGHTS = {"forget_gate.dt_bias": "dt_bias", "forget_gate.A_log": "A_log"}
# HF modules vLLM holds under another name: the forget gate's up-projection is the layer's.
KDA_MODULES = {".self_attn.forget_gate.f_b_proj.": ".self_attn.f_b_proj."}
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
