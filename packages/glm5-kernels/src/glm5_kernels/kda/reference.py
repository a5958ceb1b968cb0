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
    "kda_decode_ref",
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


def kda_decode_ref(
    qkv: Tensor,
    f: Tensor,
    b: Tensor,
    gate: Tensor,
    conv: Tensor,
    recurrent: Tensor,
    conv_weight: Tensor,
    dt_bias: Tensor,
    A_log: Tensor,
    norm_weight: Tensor,
    *,
    conv_slots: Tensor,
    conv_offset: Tensor,
    read_slots: Tensor,
    write_slots: Tensor,
    keep: bool,
    lower_bound: float | None,
    eps: float,
    recurrence=kda_recurrence_ref,
) -> Tensor:
    """One KDA decode / verify step of R requests x T tokens from the projections' outputs,
    caches updated in place (vLLM 0.33's layouts), as the reference backbone runs it:

    qkv [R, T, 3C'] (q | k | v, C' = H*K), f [R, T, H*K] (f_b output), b [R, T, H] (beta
    logits), gate [R, T, H*V] (g_b output), all the model dtype; conv [slots, W-2+q, 3C']
    (a W-1 window at conv_offset of row conv_slots), recurrent [slots, H, V, K] FP32 (read at
    read_slots, written at write_slots [R, T]: every token's state with `keep` (a verify),
    else the last; -1 is not stored); conv_weight [3C', W]. -> [R, T, H*V] gated-RMSNormed
    output in the model dtype, ready for o_proj. `recurrence`: the delta rule over stacked
    heads, `kda_recurrence_ref`'s contract (a caller may swap in a library kernel).
    """
    r, t, c3 = qkv.shape
    h, width = A_log.shape[0], conv_weight.shape[1]
    kd, vd = f.shape[-1] // h, gate.shape[-1] // h
    dtype = qkv.dtype
    window = conv_offset[:, None] + torch.arange(width - 1, device=qkv.device)
    rows = conv_slots[:, None]
    history = conv[rows, window]  # [R, W-1, 3C']
    full = torch.cat([history, qkv.to(conv.dtype)], dim=1)  # [R, W-1+T, 3C']

    def channels(x: Tensor) -> Tensor:  # requests are independent channels
        return x.transpose(0, 1).reshape(x.shape[1], r * c3)

    y, _ = short_conv_ref(channels(qkv), channels(history), conv_weight.repeat(r, 1))
    y = y.reshape(t, r, c3).transpose(0, 1)
    q, k, v = y.split([h * kd, h * kd, h * vd], dim=-1)
    g = kda_gate_ref(f.reshape(r * t, -1), dt_bias, A_log, lower_bound).reshape(r, t, h, kd)
    beta = torch.sigmoid(b.float())

    def heads(x: Tensor, d: int | None = None) -> Tensor:  # [R, T, H(*d)] -> [T, R*H(, d)]
        x = x.reshape(r, t, h, -1) if d else x
        return x.transpose(0, 1).reshape(t, r * h, *((d,) if d else ()))

    state = recurrent[read_slots].transpose(-1, -2).reshape(r * h, kd, vd)
    o, final, states = recurrence(
        heads(q, kd), heads(k, kd), heads(v, vd), heads(g, kd), heads(beta), state,
        all_states=keep,
    )  # fmt: skip
    for i in range(t) if keep else [t - 1]:
        s = (final if states is None else states[i]).reshape(r, h, kd, vd).transpose(-1, -2)
        # -1 (not stored) rewrites the null slot 0 with its own value: no host sync, so the
        # step stays capturable.
        slots = write_slots[:, i].long()
        at = slots.clamp(min=0)
        recurrent[at] = torch.where((slots >= 0)[:, None, None, None], s, recurrent[at])
    # Conv rows: a verify stores its W-2+T newest inputs from column 0 (the window after
    # accepting n starts at column n - 1); a decode overwrites its window.
    if keep:
        conv[rows, torch.arange(width - 2 + t, device=qkv.device)] = full[:, 1:]
    else:
        conv[rows, window] = full[:, -(width - 1) :]
    o = o.reshape(t, r, h, vd).transpose(0, 1).to(dtype)
    out = gated_rms_norm_ref(o, gate.reshape(r, t, h, vd), norm_weight, eps, dtype)
    return out.reshape(r, t, h * vd)
