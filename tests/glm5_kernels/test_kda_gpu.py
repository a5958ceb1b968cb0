"""The KDA decode kernel on the GPU at GLM-5.3-Flash's heads (K = V = 128, conv width 4, the
safe gate), TP 1 (64 heads) and a TP-4 rank (16): 64 consecutive steps alternating decodes
and verifies of q tokens with random partial acceptance, requests in scattered state slots,
a request joining mid-run, q | k | v read as strided rows of a wider projection output,
NaN-poisoned outputs; rows, recurrent and conv states against `kda_decode_ref` after every
step (tolerances: test_kda.py's)."""

import pytest
import torch

from glm5_kernels.kda import KdaDecode, kda_decode_ref

pytestmark = pytest.mark.gpu

K = V = 128
W = 4


def assert_outputs_close(got, want, step):
    """BF16 rows: o rounds to BF16 before the norm, and a last-bit difference there (or a
    state value of assert_states_close's) can move it to the neighbouring BF16 value: at
    most 3 ulps (3 x 2^-8 relative) anywhere, at most 1 % of the values beyond one."""
    got, want = got.float(), want.float()
    err = (got - want).abs()
    assert err.max().item() <= 3 * 2**-8 * want.abs().max().item(), (step, err.max().item())
    one_ulp = 2**-8 * want.abs() + 1e-6
    assert (err > one_ulp).float().mean().item() <= 0.01, step


def assert_states_close(got, want, step):
    """FP32 states: the kernel's dot products and exp / sigmoid differ from torch's in the
    last bits (off by > 2^-16 of the state's scale: at most 1 % of the values), and a
    conv output can round to the neighbouring BF16 value (2^-8 relative) and carry into a
    head's column of the state: no value off by more than 2^-7 of the scale."""
    scale = want.abs().max().item()
    err = (got - want).abs()
    assert not got.isnan().any(), step
    assert err.max().item() <= 2**-7 * scale, (step, err.max().item(), scale)
    off = (err > 2**-16 * scale).float().mean().item()
    assert off <= 0.01, (step, off)


def _up(x, w):
    """A low-rank half's up-projection as the model's BF16 linear: FP32 sums, one rounding."""
    return (x.float() @ w.float().T).bfloat16()


# (heads, requests, q, rank, tile): one request, a split head (8 x 2), the one-warp slices of
# a 2-token verify at 384 heads x requests, a whole head (64 x 3 x 4), the fused_gates kernel;
# the two-launch step (tile (BV, warps, 2)) split, whole and with the gates' projections.
CASES = [(16, 1, 1, 0, None), (16, 8, 2, 0, None), (16, 24, 2, 0, None), (64, 3, 4, 0, None),
         (16, 32, 4, 0, None), (16, 1, 1, 128, None), (16, 8, 2, 128, None),
         (16, 32, 4, 0, (32, 4, 2)), (16, 24, 1, 0, (16, 1, 2)), (64, 3, 4, 0, (128, 8, 2)),
         (16, 8, 2, 128, (16, 2, 2))]  # fmt: skip


@pytest.mark.parametrize(
    "heads, requests, q, rank, tile",
    CASES,
    ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else str(x),
)
def test_consecutive_steps_equal_the_reference(heads, requests, q, rank, tile):
    """rank > 0: the fused_gates kernel (f_b, g_b in the kernel; the calls hand it f_a and
    g_a of the model's rank, the reference their BF16 up-projections). `tile`: every step at
    that (BV, warps, launches), else the plan's."""
    gen = torch.Generator("cuda").manual_seed(heads + requests + q)
    c = heads * (2 * K + V)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, device="cuda") * scale

    w = dict(conv_weight=randn(c, W, scale=W**-0.5), dt_bias=randn(heads * K, scale=0.5),
             A_log=randn(heads, scale=0.5), norm_weight=1 + randn(V, scale=0.1),
             lower_bound=-5.0, eps=1e-5)  # fmt: skip
    gates = {}
    if rank:
        gates = {"f_b": randn(heads * K, rank, scale=rank**-0.5).bfloat16(),
                 "g_b": randn(heads * V, rank, scale=rank**-0.5).bfloat16()}  # fmt: skip
    # Steps of 1 and q tokens only: prepare compiles those (every count up to max_tokens at
    # every tile for 64 requests took ~170 s of the H200 at rank 128, the unrolled per-head
    # projections making each variant's PTX ~4x the plain one's).
    op = KdaDecode(**w, max_tokens=q, **gates)
    assert op.low_rank == bool(rank)
    op.tile = tile
    op.prepare([requests * q])
    r, slots = requests, 2 + requests * q + q
    conv = randn(slots, W - 2 + q, c).bfloat16()
    rec = randn(slots, heads, V, K, scale=0.1)
    caches = {"kernel": (conv.clone(), rec.clone()), "ref": (conv.clone(), rec.clone())}
    owned = torch.randperm(slots - 1, generator=gen, device="cuda")[: r * q].view(r, q) + 1
    current = torch.zeros(r, dtype=torch.int64, device="cuda")
    for step in range(64):
        if step == 32:  # a request joins: fresh state slots, zeroed like vLLM's
            for cache in (*caches["kernel"], *caches["ref"]):
                cache[owned[-1]] = 0
            current[-1] = 0
        verify = q > 1 and step % 2 == 1
        t = q if verify else 1
        read = owned[torch.arange(r, device="cuda"), current]
        if verify:
            write = owned[:, :t]
        else:
            write = torch.full((r, t), -1, device="cuda", dtype=torch.int64)
            write[:, -1] = read
        place = dict(conv_slots=owned[:, 0], conv_offset=current, read_slots=read,
                     write_slots=write, keep=verify)  # fmt: skip
        wide = randn(r, t, c + 7).bfloat16()  # q | k | v, then other projections' columns
        x = (wide[..., :c], randn(r, t, heads * K).bfloat16(), randn(r, t, heads).bfloat16(),
             randn(r, t, heads * V).bfloat16())  # fmt: skip
        given = x
        if rank:  # f_a and g_a as strided rows of one tensor, as the fused in_proj's
            halves = randn(r, t, 2 * rank + 5).bfloat16()
            f_a, g_a = halves[..., :rank], halves[..., rank + 5 :]
            given = (x[0], f_a, x[2], g_a)
            x = (x[0], _up(f_a, gates["f_b"]), x[2], _up(g_a, gates["g_b"]))
        want = kda_decode_ref(*x, *caches["ref"], **w, **place)
        out = torch.full((r, t, heads * V), float("nan"), device="cuda").bfloat16()
        got = op(*given, *caches["kernel"], **place, out=out)
        assert not got.isnan().any(), step
        assert_outputs_close(got, want, step)
        assert_states_close(caches["kernel"][1], caches["ref"][1], step)
        assert torch.equal(caches["kernel"][0], caches["ref"][0]), step
        if verify:  # accept 1..q tokens: resume from that token's state and conv column
            current = torch.randint(0, q, (r,), generator=gen, device="cuda")


def test_a_captured_step_replays_like_eager():
    """prepare(), then a verify step captured in a CUDA graph: replays update the caches as
    the eager call does."""
    gen = torch.Generator("cuda").manual_seed(7)
    heads, r, q = 16, 4, 4
    c = heads * (2 * K + V)
    zeros = torch.zeros(heads * K, device="cuda")
    conv_w, norm = torch.randn(c, W, generator=gen, device="cuda") / 2, torch.ones(V, device="cuda")
    op = KdaDecode(conv_w, zeros, zeros[:heads], norm, lower_bound=-5.0, eps=1e-5, max_tokens=q)
    op.prepare()
    conv = torch.randn(1 + r * q, W - 2 + q, c, generator=gen, device="cuda").bfloat16()
    rec = torch.randn(1 + r * q, heads, V, K, generator=gen, device="cuda") * 0.1
    owned = torch.arange(1, 1 + r * q, device="cuda").view(r, q)
    place = dict(conv_slots=owned[:, 0], conv_offset=torch.zeros(r, dtype=torch.int64,
                 device="cuda"), read_slots=owned[:, 0], write_slots=owned, keep=True)  # fmt: skip
    x = [torch.randn(r, q, n, generator=gen, device="cuda").bfloat16()
         for n in (c, heads * K, heads, heads * V)]  # fmt: skip
    start = (conv.clone(), rec.clone())
    eager = op(*x, conv, rec, **place)
    after = (conv.clone(), rec.clone())
    conv.copy_(start[0])
    rec.copy_(start[1])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = op(*x, conv, rec, **place)
    for _ in range(3):
        conv.copy_(start[0])
        rec.copy_(start[1])
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, eager)
        assert torch.equal(conv, after[0]) and torch.equal(rec, after[1])
