"""The sparse MLA decode (`SparseMlaDecode`) on CPU under the Triton interpreter against
`sparse_mla_decode_ref`: rows of different requests with their own block tables (blocks
scattered in the cache), selections of -1-padded width off the token tile, one split and many
(a selection shorter than one split, and one across several), a row with nothing selected,
heads off the head tile, NaN-poisoned outputs; bad input is one error.

Tolerance, from the rounding: the kernel feeds the tensor cores BF16 (the softmax weights p,
and the merged latent before the value-up) where the reference stays in FP32: each is one
BF16 rounding (2^-9 relative) of a sum's terms, so the output is within a few BF16 ulps:
2^-6 of the row's largest value."""

import os

import pytest
import torch

import glm5_kernels.dsa.attention as attention
from glm5_kernels.dsa import SparseMlaDecode, sparse_mla_decode_ref

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton on CPU needs TRITON_INTERPRET=1"
)

L, VD, BS = 64, 48, 16  # latent, value dim (off the 64-column tile), block size


def _case(gen, heads, rows, requests, width, context):
    blocks = requests * (-(-context // BS)) + 3
    # vLLM packs the layers' caches block by block: a block's rows, then other layers' (NaN
    # here: never read).
    packed = torch.full((blocks, BS * L + 3 * L), float("nan")).bfloat16()
    cache = packed[:, : BS * L].view(blocks, BS, L)
    cache.copy_(torch.randn(blocks, BS, L, generator=gen).bfloat16())
    table = torch.randperm(blocks, generator=gen)[: requests * (-(-context // BS))]
    table = table.view(requests, -1).int()
    request = torch.randint(0, requests, (rows,), generator=gen).int()
    picks = [torch.randperm(context, generator=gen)[:width] for _ in range(rows)]
    indices = torch.stack(picks).int()
    indices[:, width - width // 3 :] = -1  # a short selection: padded with -1
    q = torch.randn(rows, heads, L, generator=gen).bfloat16()
    w_uv = (torch.randn(heads, VD, L, generator=gen) / L**0.5).bfloat16()
    return q, cache, table, request, indices, w_uv


def _close(got, want):
    assert not got.isnan().any()
    scale = want.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-6)
    assert ((got.float() - want.float()).abs() <= 2**-6 * scale).all()


@pytest.mark.parametrize(
    "heads, rows, requests, width, context",
    [(3, 2, 2, 40, 50), (20, 5, 3, 150, 200), (16, 1, 1, 7, 7), (4, 1, 1, 600, 700)],
    ids=["few-heads", "two-head-tiles", "short-context", "merge-groups"],
)
@pytest.mark.parametrize("rowwise", [False, True], ids=["tiled-merge", "rowwise-merge"])
def test_matches_the_reference(heads, rows, requests, width, context, rowwise, monkeypatch):
    """`rowwise`: every step merges row at a time, or none does."""
    monkeypatch.setattr(attention, "rowwise", lambda rows, heads: rowwise)
    gen = torch.Generator().manual_seed(heads + rows)
    q, cache, table, request, indices, w_uv = _case(gen, heads, rows, requests, width, context)
    if rows > 1:
        indices[1] = -1  # nothing selected: zero
    op = SparseMlaDecode(w_uv, scale=L**-0.5, max_rows=8)
    op.prepare()
    if width > 8 * 32:  # more splits than the merge unrolls: groups, the last one partial
        assert op.splits(rows, width) % 8 != 0 and op.splits(rows, width) > 16
    for splits in (None, 1):  # the plan's splits (many), then one split for everything
        if splits:
            op.splits = lambda rows, selected: 1
        out = torch.full((rows, heads, VD), float("nan")).bfloat16()
        got = op(q, cache, table, request, indices, out=out)
        assert got is out
        _close(got, sparse_mla_decode_ref(q, cache, table, request, indices, w_uv, L**-0.5))
    if rows > 1:
        assert (got[1] == 0).all()


def test_bad_input_names_every_problem():
    gen = torch.Generator().manual_seed(3)
    q, cache, table, request, indices, w_uv = _case(gen, 4, 2, 1, 20, 30)
    op = SparseMlaDecode(w_uv, scale=0.1, max_rows=8)
    with pytest.raises(ValueError) as e:
        op(q.float(), cache[..., :32], table.float(), request, indices)
    for name in ("q_lat:", "cache:", "block_table:"):
        assert name in str(e.value), e.value
    bad = indices.clone()
    bad[0, 0] = 10_000
    with pytest.raises(ValueError, match="indices: a position past the block table"):
        op(q, cache, table, request, bad)
    with pytest.raises(ValueError, match=r"L=48: a power of two"):
        SparseMlaDecode(torch.zeros(2, 8, 48).bfloat16(), scale=1.0)


@pytest.mark.parametrize("heads, rows", [(16, 1), (4, 7)])
def test_absorb_of_adjacent_heads_is_one_skinny_gemm(heads, rows):
    """Each row's heads adjacent (q_b's output, rows strided as a column slice of a wider
    projection): the absorption is one block-diagonal skinny GEMM, within one BF16 rounding
    of the FP64 product as the batched GEMM is (and NaN nowhere); a view of other heads'
    layout takes the batched GEMM."""
    gen = torch.Generator().manual_seed(heads + rows)
    nope = 64
    w = torch.randn(heads, nope + VD, L, generator=gen).bfloat16() / 8
    wide = torch.randn(rows, heads * nope + 64, generator=gen).bfloat16()
    q = wide[:, : heads * nope].view(rows, heads, nope)  # row stride heads * nope + 64
    op = SparseMlaDecode(w[:, nope:], 0.1, max_rows=8, w_uk=w[:, :nope])
    assert op._absorb is not None
    op.prepare([rows])
    got = op.absorb(q)
    want = torch.einsum("nhp,hpl->nhl", q.double(), w[:, :nope].double())
    assert got.shape == (rows, heads, L) and not got.isnan().any()
    scale = want.abs().amax(-1, keepdim=True)
    assert ((got.double() - want).abs() <= 2**-8 * want.abs() + 2**-20 * scale).all()
    gaps = torch.randn(rows, heads, nope + 8, generator=gen).bfloat16()[..., :nope]
    want = torch.einsum("nhp,hpl->nhl", gaps.double(), w[:, :nope].double())
    got = op.absorb(gaps)  # heads not adjacent: the batched GEMM
    assert ((got.double() - want).abs() <= 2**-8 * want.abs() + 2**-20 * scale.max()).all()


@pytest.mark.parametrize("heads, rows", [(16, 1), (5, 7)])
def test_absorb_is_one_rounding_of_the_fp32_product(heads, rows):
    """The query absorption q . W_uk (the nope parts, a strided view as the fused projection
    leaves them) against FP64: one BF16 rounding of an FP32-accumulated dot product of 192
    terms (2^-8 relative, a few FP32 ulps of the sum besides); W_uk in any layout."""
    gen = torch.Generator().manual_seed(heads * rows)
    nope = 192
    w = torch.randn(heads, nope + VD, L, generator=gen).bfloat16() / 8  # kv_b's rows per head
    q = torch.randn(rows, heads, nope + 8, generator=gen).bfloat16()[..., :nope]
    op = SparseMlaDecode(w[:, nope:], 0.1, max_rows=8, w_uk=w[:, :nope].transpose(1, 2)
                         .contiguous().transpose(1, 2))  # fmt: skip
    got = op.absorb(q)
    want = torch.einsum("nhp,hpl->nhl", q.double(), w[:, :nope].double())
    assert got.shape == (rows, heads, L) and got.dtype == torch.bfloat16
    scale = want.abs().amax(-1, keepdim=True)
    assert ((got.double() - want).abs() <= 2**-8 * want.abs() + 2**-20 * scale).all()
    with pytest.raises(ValueError, match="w_uk"):
        SparseMlaDecode(w[:, nope:], 0.1, w_uk=w[:2, :nope])
