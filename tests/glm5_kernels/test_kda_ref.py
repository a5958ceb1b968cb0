"""KDA references against transformers: the forget gate, causal_conv1d_fn / _update, the
recurrent and the chunked KDA, the gated RMSNorm, and the whole Glm5NextTextLinearAttention
rebuilt from the references.

Tolerances (fp32 throughout): elementwise ops with the same formula agree to 1e-6; the
recurrence sums k·S with einsum where transformers multiplies and sums, so ~1e-7 relative per
step, rtol/atol 1e-5 over 17+ steps; the chunked algorithm is a different factorization (a
triangular inverse per 16/64-token chunk, exp of cumulative gates) yet measured within 3e-7
absolute of the recurrence on outputs of size ~0.3 and states of size ~1 (T up to 200): atol
and rtol 1e-5 leave 30x headroom. BF16 outputs may differ by one BF16 rounding (an ulp is up to
2^-7 relative) where the fp32 sums differ in the last bits.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import Glm5NextTextConfig
from transformers.models.glm5_next.modeling_glm5_next import (
    Glm5NextTextForgetGate,
    Glm5NextTextLinearAttention,
    Glm5NextTextRMSNormGated,
    causal_conv1d_fn,
    causal_conv1d_update,
    chunk_kimi_delta_attention,
    recurrent_kimi_delta_attention,
)

from glm5_kernels.kda import gated_rms_norm_ref, kda_gate_ref, kda_recurrence_ref, short_conv_ref

EXACTISH = {"rtol": 1e-6, "atol": 1e-6}
RECURRENT = {"rtol": 1e-5, "atol": 1e-5}
CHUNKED = {"rtol": 1e-5, "atol": 1e-5}
BF16_ULP = {"rtol": 2**-7, "atol": 1e-6}


def _config(heads=4, head_dim=16, hidden=64, **kw):
    return Glm5NextTextConfig(
        hidden_size=hidden,
        hc_mult=4,
        linear_num_heads=heads,
        linear_head_dim=head_dim,
        num_hidden_layers=4,
        **kw,
    )


def _dt_bias(n, gen):
    # The trained init: inverse softplus of dt ~ logU(1e-3, 1e-1), so decays are mostly mild.
    dt = torch.exp(
        math.log(1e-3) + (math.log(1e-1) - math.log(1e-3)) * torch.rand(n, generator=gen)
    )
    return dt + torch.log(-torch.expm1(-dt))


def _kda_inputs(t, heads, dim, gen, lower_bound=-5.0):
    """q, k, v ~ N(0, 1) (l2-normalized inside), g from the real gate, beta = sigmoid(N(0,1))."""
    q, k, v = (torch.randn(t, heads, dim, generator=gen) for _ in range(3))
    f = 2 * torch.randn(t, heads * dim, generator=gen)
    g = kda_gate_ref(
        f, _dt_bias(heads * dim, gen), 0.3 * torch.randn(heads, generator=gen), lower_bound
    )
    beta = torch.sigmoid(torch.randn(t, heads, generator=gen))
    return q, k, v, g, beta


@pytest.mark.parametrize("spread", [1.0, 30.0], ids=["f-normal", "f-wide"])
@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["lower-bound", "softplus"])
@pytest.mark.parametrize("t", [1, 3, 17])
def test_kda_gate_matches_forget_gate(t, lower_bound, spread):
    config = _config(linear_lower_bound=lower_bound)
    assert config.linear_lower_bound == lower_bound
    gen = torch.Generator().manual_seed(t)
    gate = Glm5NextTextForgetGate(config)
    with torch.no_grad():
        for lin in (gate.f_a_proj, gate.f_b_proj):
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen) / lin.in_features**0.5)
        gate.dt_bias.copy_(_dt_bias(gate.dt_bias.numel(), gen))
        a_log = 0.3 * torch.randn(4, generator=gen)
        if lower_bound is None:  # trained init for the softplus branch: A ~ U(1, 16)
            a_log = torch.log(1 + 15 * torch.rand(4, generator=gen))
        gate.A_log.copy_(a_log)
    h = spread * torch.randn(1, t, 64, generator=gen)
    with torch.no_grad():
        want = gate(h)[0]
        f = gate.f_b_proj(gate.f_a_proj(h))[0]
    got = kda_gate_ref(f, gate.dt_bias, gate.A_log, lower_bound)
    assert got.dtype == torch.float32 and got.shape == (t, 4, 16)
    torch.testing.assert_close(got, want, **EXACTISH)
    assert (got <= 0).all()
    if lower_bound is not None:
        assert (got >= lower_bound).all()
    elif spread > 1:
        assert (f + gate.dt_bias > 20).any()  # the softplus cut-over branch was exercised


CONV_CASES = [
    pytest.param(t, c, dtype, id=f"T{t}-C{c}-{str(dtype)[6:]}")
    for t, c in [(1, 192), (3, 192), (17, 200)]
    for dtype in (torch.float32, torch.bfloat16)
] + [pytest.param(2, 3 * 64 * 128, torch.bfloat16, id="T2-C24576-bfloat16-flash")]


def _conv_weight(c, w, gen):
    return torch.randn(c, w, generator=gen) / w**0.5  # fp32: transformers keeps conv1d in fp32


@pytest.mark.parametrize(("t", "c", "dtype"), CONV_CASES)
def test_short_conv_matches_causal_conv1d_fn(t, c, dtype):
    gen = torch.Generator().manual_seed(t * 31 + c)
    weight = _conv_weight(c, 4, gen)
    x = torch.randn(t, c, generator=gen).to(dtype)
    want = causal_conv1d_fn(x.T[None], weight, activation="silu")[0].T
    y, history = short_conv_ref(x, torch.zeros(3, c, dtype=dtype), weight)
    assert y.dtype == dtype and history.dtype == dtype
    torch.testing.assert_close(y, want, **(EXACTISH if dtype == torch.float32 else BF16_ULP))
    tail = torch.cat([torch.zeros(3, c, dtype=dtype), x])[-3:]
    assert torch.equal(history, tail)


@pytest.mark.parametrize("chunk", [1, 2, 5], ids=lambda n: f"chunk{n}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_short_conv_continues_like_causal_conv1d_update(dtype, chunk):
    """A random (non-zero) history carried through pieces of 1, 2 or 5 tokens, against
    transformers' decode-path update that mutates its conv_state in place."""
    gen = torch.Generator().manual_seed(chunk)
    c, t = 96, 11
    weight = _conv_weight(c, 4, gen)
    history = torch.randn(3, c, generator=gen).to(dtype)
    x = torch.randn(t, c, generator=gen).to(dtype)
    state = history.T[None].clone()  # [1, C, W-1] as transformers holds it
    full, _ = short_conv_ref(x, history, weight)
    for s in range(0, t, chunk):
        piece = x[s : s + chunk]
        want = causal_conv1d_update(piece.T[None], state, weight, activation="silu")[0].T
        y, history = short_conv_ref(piece, history, weight)
        torch.testing.assert_close(y, want, **(EXACTISH if dtype == torch.float32 else BF16_ULP))
        assert torch.equal(history, state[0].T)
        torch.testing.assert_close(y, full[s : s + chunk], rtol=0, atol=0)


RECURRENCE_CASES = [
    pytest.param(t, h, d, id=f"T{t}-H{h}-K{d}") for t, h, d in [(1, 4, 16), (3, 4, 16), (17, 4, 16)]
] + [pytest.param(2, 64, 128, id="T2-H64-K128-flash")]


@pytest.mark.parametrize(("t", "heads", "dim"), RECURRENCE_CASES)
def test_recurrence_matches_recurrent_kda(t, heads, dim):
    gen = torch.Generator().manual_seed(t * heads + dim)
    q, k, v, g, beta = _kda_inputs(t, heads, dim, gen)
    state = 0.5 * torch.randn(heads, dim, dim, generator=gen)
    state_before = state.clone()
    o, final, states = kda_recurrence_ref(q, k, v, g, beta, state)
    want_o, want_final = recurrent_kimi_delta_attention(
        q[None],
        k[None],
        v[None],
        g[None],
        beta[None],
        state[None].clone(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    assert states is None and o.dtype == final.dtype == torch.float32
    torch.testing.assert_close(o, want_o[0], **RECURRENT)
    torch.testing.assert_close(final, want_final[0], **RECURRENT)
    assert torch.equal(state, state_before)  # the caller's state is never written


@pytest.mark.parametrize("initial", ["zero-state", "random-state"])
@pytest.mark.parametrize(
    ("t", "chunk"),
    [(17, 64), (17, 16), (37, 16), (64, 16)],
    ids=["T17-chunk64", "T17-chunk16", "T37-chunk16", "T64-chunk16"],
)
def test_recurrence_matches_chunked_kda_prefill(t, chunk, initial):
    gen = torch.Generator().manual_seed(t + chunk)
    heads, dim = 4, 16
    q, k, v, g, beta = _kda_inputs(t, heads, dim, gen)
    state = torch.zeros(heads, dim, dim)
    if initial == "random-state":
        state = 0.5 * torch.randn(heads, dim, dim, generator=gen)
    o, final, _ = kda_recurrence_ref(q, k, v, g, beta, state)
    want_o, want_final = chunk_kimi_delta_attention(
        q[None],
        k[None],
        v[None],
        g[None],
        beta[None],
        chunk_size=chunk,
        initial_state=state[None].clone(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    torch.testing.assert_close(o, want_o[0], **CHUNKED)
    torch.testing.assert_close(final, want_final[0], **CHUNKED)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), t=st.integers(2, 12), data=st.data())
def test_prefill_then_decode_equals_full(seed, t, data):
    """Splitting a sequence anywhere and carrying the state gives the same outputs and state,
    bit for bit (the recurrence is token-serial), and all_states[i] is the state after token i."""
    split = data.draw(st.integers(1, t - 1), label="split")
    gen = torch.Generator().manual_seed(seed)
    q, k, v, g, beta = _kda_inputs(t, 2, 8, gen)
    state0 = 0.5 * torch.randn(2, 8, 8, generator=gen)
    o, final, states = kda_recurrence_ref(q, k, v, g, beta, state0, all_states=True)
    o1, mid, _ = kda_recurrence_ref(
        q[:split], k[:split], v[:split], g[:split], beta[:split], state0
    )
    outs, s = [o1], mid
    for i in range(split, t):  # decode: one token at a time
        oi, s, _ = kda_recurrence_ref(
            q[i : i + 1], k[i : i + 1], v[i : i + 1], g[i : i + 1], beta[i : i + 1], s
        )
        outs.append(oi)
    assert torch.equal(torch.cat(outs), o) and torch.equal(s, final)
    assert states.shape == (t, 2, 8, 8)
    assert torch.equal(states[split - 1], mid) and torch.equal(states[-1], final)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize(
    ("t", "heads", "dim"),
    [(1, 4, 16), (17, 4, 16), (2, 64, 128)],
    ids=["T1-H4-V16", "T17-H4-V16", "T2-H64-V128-flash"],
)
def test_gated_rms_norm_matches_transformers(t, heads, dim, out_dtype):
    gen = torch.Generator().manual_seed(t * dim)
    norm = Glm5NextTextRMSNormGated(dim, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(dim, generator=gen))
    o = torch.randn(t, heads, dim, generator=gen).to(out_dtype)
    gate = (2 * torch.randn(t, heads, dim, generator=gen)).to(out_dtype)
    got = gated_rms_norm_ref(o, gate, norm.weight, 1e-5, out_dtype)
    assert got.dtype == out_dtype
    torch.testing.assert_close(got, norm(o, gate), rtol=0, atol=0)  # same fp32 ops, same order


@pytest.mark.parametrize("t", [1, 5, 17])
def test_linear_attention_layer_from_references(t):
    """The whole Glm5NextTextLinearAttention (prefill, no cache: conv with zero history, chunked
    KDA) equals projections + short_conv_ref + kda_gate_ref + kda_recurrence_ref +
    gated_rms_norm_ref: the composition the runtime's reference model uses."""
    config = _config()
    gen = torch.Generator().manual_seed(50 + t)
    attn = Glm5NextTextLinearAttention(config, layer_idx=0)
    with torch.no_grad():
        for name, p in attn.named_parameters():
            if name == "forget_gate.A_log":
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif name == "forget_gate.dt_bias":
                p.copy_(_dt_bias(p.numel(), gen))
            elif name == "o_norm.weight":
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    h = torch.randn(1, t, 64, generator=gen)
    with torch.no_grad():
        want = attn(h)[0]
        x = h[0]
        qkv = torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], -1)
        conv_w = attn.conv1d.weight[:, 0]
        qkv, _ = short_conv_ref(qkv, torch.zeros(3, qkv.shape[-1]), conv_w)
        q, k, v = (z.reshape(t, 4, 16) for z in qkv.split(64, -1))
        fg = attn.forget_gate
        g = kda_gate_ref(
            fg.f_b_proj(fg.f_a_proj(x)), fg.dt_bias, fg.A_log, config.linear_lower_bound
        )
        beta = torch.sigmoid(attn.b_proj(x))
        o, _, _ = kda_recurrence_ref(q, k, v, g, beta, torch.zeros(4, 16, 16))
        gate = attn.g_b_proj(attn.g_a_proj(x)).reshape(t, 4, 16)
        o = gated_rms_norm_ref(o, gate, attn.o_norm.weight, config.rms_norm_eps, x.dtype)
        got = attn.o_proj(o.reshape(t, -1))
    torch.testing.assert_close(got, want, **CHUNKED)
    assert want.abs().mean() > 1e-2  # a real signal, not a decayed-to-zero output


def test_l2norm_is_eps_inside_the_sqrt():
    """l2norm(x) = x / sqrt(|x|² + 1e-6), not F.normalize's x / max(|x|, eps): a q of norm 1e-3
    is scaled by 1e-3 / sqrt(2e-6) = 1/sqrt(2), not to unit length; q = 0 gives o = 0; and k's
    scale does not matter while |k|² >> 1e-6."""
    gen = torch.Generator().manual_seed(5)
    q, k, v, g, beta = _kda_inputs(3, 2, 8, gen)
    s0 = torch.randn(2, 8, 8, generator=gen)
    unit = q / q.norm(dim=-1, keepdim=True)
    o_unit = kda_recurrence_ref(unit, k, v, g, beta, s0)[0]
    o_small = kda_recurrence_ref(1e-3 * unit, k, v, g, beta, s0)[0]
    torch.testing.assert_close(o_small, o_unit * math.sqrt((1 + 1e-6) / 2), **EXACTISH)
    o_zero = kda_recurrence_ref(torch.zeros_like(q), k, v, g, beta, s0)[0]
    assert torch.equal(o_zero, torch.zeros_like(o_zero))
    a = kda_recurrence_ref(q, k, v, g, beta, s0)[0]
    b = kda_recurrence_ref(7 * q, 1000 * k, v, g, beta, s0)[0]
    torch.testing.assert_close(a, b, **RECURRENT)
