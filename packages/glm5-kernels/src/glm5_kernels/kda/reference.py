"""Kimi delta attention (KDA) as GLM-5.3-Flash's linear-attention layers use it, the spec.

Per head, with S ∈ R^{K×V} the fp32 recurrent state and per-channel log-decay g_t ∈ R^K:

    q̂ = l2norm(q) * K^-0.5,  k̂ = l2norm(k)          l2norm(x) = x / sqrt(Σx² + 1e-6)
    S  = diag(exp(g_t)) S
    S += k̂ ⊗ β_t (v_t - k̂ᵀ S)                       (delta rule)
    o_t = q̂ᵀ S

Around it: a depthwise causal short conv (width W, SiLU) over cat(q, k, v) channels; the forget
gate g = lb * sigmoid(exp(A_log) * (f + dt_bias)) (or -exp(A_log) * softplus(f + dt_bias) when no
lower bound); and the output gated RMSNorm  weight * rmsnorm(o) * sigmoid(gate).
"""

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "gated_rms_norm_ref",
    "kda_gate_ref",
    "kda_recurrence_ref",
    "short_conv_ref",
]


def kda_gate_ref(f: Tensor, dt_bias: Tensor, A_log: Tensor, lower_bound: float | None) -> Tensor:
    """f [T, Hk*K] (f_b_proj output), dt_bias [Hk*K], A_log [Hk] -> g [T,Hk,K] fp32 (log-decay)."""
    hk = A_log.shape[0]
    g = (f.float() + dt_bias.float()).view(f.shape[0], hk, -1)
    a = torch.exp(A_log.float())[None, :, None]
    if lower_bound is not None:
        # "Safe gate": g in (lb, 0), so a step never decays the state by more than exp(lb).
        return lower_bound * torch.sigmoid(a * g)
    # Same cut-over as transformers (x > 20 -> x); log1p differs from its log(1 + exp(x)) only
    # below fp32 resolution of 1 + exp(x).
    return -a * F.softplus(g, beta=1.0, threshold=20.0)


def short_conv_ref(x: Tensor, history: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """x [T,C], history [W-1,C], weight [C,W] -> y [T,C] x.dtype, new history [W-1,C] its dtype."""
    w = weight.shape[-1]
    xs = torch.cat([history.float(), x.float()])  # [W-1+T, C]
    # y[t] = Σ_j weight[:, j] * xs[t + j]; xs[t + W-1] is x[t] (weight's last tap is "now").
    windows = xs.unfold(0, w, 1)  # [T, C, W]
    y = F.silu((windows * weight.float()).sum(-1))
    # Taken from the original-dtype inputs, so a BF16 conv state round-trips bit-exactly.
    new_history = torch.cat([history, x.to(history.dtype)])[x.shape[0] :]
    return y.to(x.dtype), new_history


def _l2norm(x: Tensor) -> Tensor:
    # eps inside the sqrt (FLA's kernel convention), not F.normalize's max(norm, eps).
    return x / torch.sqrt(x.square().sum(-1, keepdim=True) + 1e-6)


def kda_recurrence_ref(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state: Tensor,
    *,
    all_states: bool = False,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """q,k,g [T,Hk,K], v [T,Hk,V], beta [T,Hk], state [Hk,K,V] -> o, final, states|None; fp32.

    o [T,Hk,V], final [Hk,K,V], states [T,Hk,K,V] (the state after each token, for MTP verify).
    """
    q = _l2norm(q.float()) * q.shape[-1] ** -0.5
    k = _l2norm(k.float())
    v, decay, beta = v.float(), g.float().exp(), beta.float()
    s = state.float().clone()  # never write the caller's state
    o = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    states = (
        torch.empty((*k.shape, v.shape[-1]), dtype=torch.float32, device=v.device)
        if all_states
        else None
    )
    for t in range(q.shape[0]):
        s = s * decay[t][..., None]
        delta = (v[t] - torch.einsum("hk,hkv->hv", k[t], s)) * beta[t][:, None]
        s = s + k[t][..., None] * delta[:, None, :]
        o[t] = torch.einsum("hk,hkv->hv", q[t], s)
        if states is not None:
            states[t] = s
    return o, s, states


def gated_rms_norm_ref(
    o: Tensor, gate: Tensor, weight: Tensor, eps: float, out_dtype: torch.dtype
) -> Tensor:
    """o [T,Hk,V], gate [T,Hk,V], weight [V] -> [T,Hk,V] in out_dtype (all math fp32)."""
    of = o.float()
    normed = of * torch.rsqrt(of.square().mean(-1, keepdim=True) + eps)
    # Unlike rms_norm_ref, the weight stays fp32 and there is no intermediate cast.
    return (weight.float() * normed * torch.sigmoid(gate.float())).to(out_dtype)
