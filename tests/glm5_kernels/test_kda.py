"""The KDA decode kernel on CPU under the Triton interpreter against `kda_decode_ref`
(itself equal to the reference backbone's layer): decodes and verifies over consecutive
steps with random partial acceptance, requests in arbitrary state slots, strided q | k | v
rows, both forget gates, the gates' low-rank up-projections in the kernel, NaN-poisoned
outputs; the caches compared after every step, and every bad input in one error. The real
shapes (128-wide heads) run on the GPU."""

import os

import pytest
import torch

from glm5_kernels.kda import KdaDecode, kda_decode_ref

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton on CPU needs TRITON_INTERPRET=1"
)

H, K, V, W, Q = 2, 16, 32, 4, 3
RANK = 24  # f_a / g_a width: not a power of two, a multiple of the kernel's 8-column steps


def _weights(gen, lower_bound):
    c = H * (2 * K + V)
    return dict(
        conv_weight=(torch.randn(c, W, generator=gen) / W**0.5),
        dt_bias=torch.randn(H * K, generator=gen) * 0.5,
        A_log=torch.randn(H, generator=gen) * 0.5,
        norm_weight=1 + 0.1 * torch.randn(V, generator=gen),
        lower_bound=lower_bound,
        eps=1e-5,
    )


def _inputs(gen, r, t, extra=5):
    c = H * (2 * K + V)
    fused = torch.randn(r, t, c + extra, generator=gen).bfloat16()  # q | k | v | more columns
    return (
        fused[..., :c],
        torch.randn(r, t, H * K, generator=gen).bfloat16(),
        torch.randn(r, t, H, generator=gen).bfloat16(),
        torch.randn(r, t, H * V, generator=gen).bfloat16(),
    )


def _up(x, w):
    """The low-rank halves' up-projection as the model's BF16 linear: FP32 sums, one rounding."""
    return (x.float() @ w.float().T).bfloat16()


@pytest.mark.parametrize(
    "lower_bound, tile, rank",
    [(-5.0, (V // 2, 2, 1), 0), (None, None, 0), (-5.0, (V, 4, 1), 0), (-5.0, None, RANK),
     (-5.0, None, 64), (-5.0, (V // 2, 2, 2), 0), (None, (V, 4, 2), 0),
     (-5.0, (V // 2, 1, 2), RANK), (-5.0, (V, 2, 2), RANK)],
    ids=["safe-gate", "softplus", "whole-head", "low-rank-gates", "low-rank-gates-one-round",
         "two-launches", "two-launches-whole-head", "two-launches-low-rank",
         "two-launches-whole-head-low-rank"],
)  # fmt: skip
def test_consecutive_steps_equal_the_reference(lower_bound, tile, rank):
    """Each head's V split over two CTAs (the last one normalizes), the planned tiles
    (split for decodes, whole for the verifies), a head in one CTA; f_b and g_b in the
    kernel (`rank` > 0: the calls hand it f_a and g_a, the reference their BF16
    up-projections; 24 wide: three rounds of 8 columns, 64: one round at these heads); the
    two-launch step (conv, norms and gates, then the recurrence) split and whole."""
    gen = torch.Generator().manual_seed(0 if lower_bound else 1)
    w = _weights(gen, lower_bound)
    gates, low_rank = {}, rank > 0
    if low_rank:
        scale = rank**-0.5
        gates = {"f_b": (torch.randn(H * K, rank, generator=gen) * scale).bfloat16(),
                 "g_b": (torch.randn(H * V, rank, generator=gen) * scale).bfloat16()}  # fmt: skip
    op = KdaDecode(**w, max_tokens=Q, **gates)
    assert op.low_rank == low_rank
    op.tile = tile
    assert op.plan(3, 1) == (tile or (16, 2, 1)) and op.plan(3, 3) == (tile or (V, 4, 1))
    slots, r = 9, 3
    conv = torch.randn(slots, W - 2 + Q, H * (2 * K + V), generator=gen).bfloat16()
    rec = torch.randn(slots, H, V, K, generator=gen) * 0.1
    caches = {"kernel": (conv.clone(), rec.clone()), "ref": (conv.clone(), rec.clone())}
    # Each request owns Q state slots (vLLM's spec layout) at scattered places.
    owned = torch.tensor([[7, 2, 5], [1, 8, 3], [4, 6, 0]])
    current = torch.zeros(r, dtype=torch.int64)
    for step in range(8):
        verify = step % 2 == 1
        t = Q if verify else 1
        read = owned[torch.arange(r), current]
        write = owned[:, :t] if verify else torch.full((r, t), -1).index_put_(
            (torch.arange(r), torch.full((r,), t - 1)), read)  # fmt: skip
        place = dict(conv_slots=owned[:, 0], conv_offset=current, read_slots=read,
                     write_slots=write, keep=verify and t > 1)  # fmt: skip
        x = _inputs(gen, r, t)
        if low_rank:  # f_a and g_a as strided rows of one tensor, as the fused in_proj's
            halves = torch.randn(r, t, 2 * rank + 3, generator=gen).bfloat16()
            f_a, g_a = halves[..., :rank], halves[..., rank + 3 :]
            given = (x[0], f_a, x[2], g_a)
            x = (x[0], _up(f_a, gates["f_b"]), x[2], _up(g_a, gates["g_b"]))
        else:
            given = x
        want = kda_decode_ref(*x, *caches["ref"], **w, **place)
        poisoned = torch.full((r, t, H * V), float("nan")).bfloat16()
        got = op(*given, *caches["kernel"], **place, out=poisoned)
        assert not got.isnan().any()
        # BF16 outputs: one rounding (the sums' order differs) on top of the same math.
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-3)
        torch.testing.assert_close(caches["kernel"][1], caches["ref"][1], rtol=1e-4, atol=1e-5)
        assert torch.equal(caches["kernel"][0], caches["ref"][0])  # raw inputs moved exactly
        if verify:  # accept a random prefix: resume from that token's state and conv column
            n = torch.randint(1, Q + 1, (r,), generator=gen)
            current = n - 1


def test_bad_input_names_every_problem():
    gen = torch.Generator().manual_seed(2)
    op = KdaDecode(**_weights(gen, -5.0), max_tokens=Q)
    qkv, f, b, gate = _inputs(gen, 2, 2)
    conv = torch.zeros(4, W - 2 + Q, H * (2 * K + V)).bfloat16()
    rec = torch.zeros(4, H, V, K)
    ok = dict(conv_slots=torch.tensor([0, 1]), conv_offset=torch.tensor([0, 0]),
              read_slots=torch.tensor([0, 1]), write_slots=torch.tensor([[-1, 0], [-1, 1]]),
              keep=False)  # fmt: skip
    with pytest.raises(ValueError) as e:
        op(qkv.float(), f, b[..., :1], gate, conv.float(), rec.double(), **ok)
    msg = str(e.value)
    for name in ("qkv:", "b:", "conv:", "recurrent:"):
        assert name in msg, msg
    with pytest.raises(ValueError, match="read_slots: outside"):
        op(qkv, f, b, gate, conv, rec, **{**ok, "read_slots": torch.tensor([0, 4])})
    with pytest.raises(ValueError, match="conv_offset: a window past"):
        op(qkv, f, b, gate, conv, rec, **{**ok, "conv_offset": torch.tensor([0, 3])})
    big = _inputs(gen, 1, Q + 1)
    one = torch.tensor([0])
    place = {**ok, "conv_slots": one, "conv_offset": one, "read_slots": one,
             "write_slots": torch.zeros(1, Q + 1, dtype=torch.int64)}  # fmt: skip
    with pytest.raises(ValueError, match=r"outside 1\.\.3"):
        op(*big, conv, rec, **place)
    with pytest.raises(ValueError) as e:
        KdaDecode(**_weights(gen, -5.0), f_b=torch.zeros(H * K, 12).bfloat16())
    assert "both or neither" in str(e.value) and "f_b: (32, 12)" in str(e.value)
    with pytest.raises(ValueError, match="K=12: a power of two"):
        KdaDecode(torch.zeros(2 * (2 * 12 + V), W), torch.zeros(2 * 12), torch.zeros(2),
                  torch.ones(V), lower_bound=-5.0, eps=1e-5)  # fmt: skip
