"""The sparse MLA decode on the GPU at GLM-5.3-Flash's shapes: latent 512, value dim 256,
16 heads (a TP-4 rank) and 64 (TP 1), blocks of 64 tokens scattered in the cache, the
top-2048 tokens + the 15-token tail selected (-1-padded for short contexts), 1 to 64 query
rows of several requests, NaN-poisoned outputs; against `sparse_mla_decode_ref` within
test_dsa_attn.py's tolerance, and a captured call replays like the eager one."""

import pytest
import torch

from glm5_kernels.dsa import SparseMlaDecode, sparse_mla_decode_ref

pytestmark = pytest.mark.gpu

L, VD, BS, SELECTED = 512, 256, 64, 2048 + 15


def _case(heads, rows, requests, context, seed):
    gen = torch.Generator("cuda").manual_seed(seed)
    per = -(-context // BS)
    blocks = requests * per + 5
    cache = torch.randn(blocks, BS, L, generator=gen, device="cuda").bfloat16()
    table = torch.randperm(blocks, generator=gen, device="cuda")[: requests * per]
    table = table.view(requests, per).int()
    request = torch.randint(0, requests, (rows,), generator=gen, device="cuda").int()
    width = min(SELECTED, context)
    picks = [torch.randperm(context, generator=gen, device="cuda")[:width] for _ in range(rows)]
    indices = torch.full((rows, SELECTED), -1, dtype=torch.int32, device="cuda")
    indices[:, :width] = torch.stack(picks).int()
    q = torch.randn(rows, heads, L, generator=gen, device="cuda").bfloat16()
    w_uv = (torch.randn(heads, VD, L, generator=gen, device="cuda") / L**0.5).bfloat16()
    return q, cache, table, request, indices, w_uv


@pytest.mark.parametrize("heads", [16, 64])
@pytest.mark.parametrize("rows, requests, context", [(1, 1, 16384), (8, 3, 4096), (64, 16, 1000)])
def test_matches_the_reference(heads, rows, requests, context):
    q, cache, table, request, indices, w_uv = _case(heads, rows, requests, context, rows + heads)
    scale = 256**-0.5
    op = SparseMlaDecode(w_uv, scale, max_rows=64)
    op.prepare()
    out = torch.full((rows, heads, VD), float("nan"), device="cuda").bfloat16()
    got = op(q, cache, table, request, indices, out=out)
    want = sparse_mla_decode_ref(q, cache, table, request, indices, w_uv, scale)
    assert not got.isnan().any()
    bound = 2**-6 * want.float().abs().amax(dim=-1, keepdim=True)
    assert ((got.float() - want.float()).abs() <= bound).all()


def test_a_captured_call_replays_like_eager():
    q, cache, table, request, indices, w_uv = _case(16, 4, 2, 8192, 1)
    op = SparseMlaDecode(w_uv, 256**-0.5, max_rows=64)
    op.prepare()
    eager = op(q, cache, table, request, indices).clone()
    out = torch.empty_like(eager)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        op(q, cache, table, request, indices, out=out)
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)


@pytest.mark.parametrize("heads", [16, 8])
def test_absorb_at_the_real_shapes(heads):
    """The query absorption (nope 256 -> latent 512 per head, a TP-4 / TP-8 rank's heads) as
    the block-diagonal skinny GEMM, q a column slice of q_b | wq_b's output as the MLA
    sublayer leaves it, 1..64 rows: within one BF16 rounding of the FP64 product, NaN
    nowhere, and a captured call replays like the eager one."""
    gen = torch.Generator("cuda").manual_seed(heads)
    nope = 256
    w_uk = (torch.randn(heads, nope, L, generator=gen, device="cuda") / nope**0.5).bfloat16()
    w_uv = (torch.randn(heads, VD, L, generator=gen, device="cuda") / L**0.5).bfloat16()
    op = SparseMlaDecode(w_uv, 0.1, max_rows=64, w_uk=w_uk)
    assert op._absorb is not None
    op.prepare()
    for rows in (1, 2, 5, 16, 64):
        wide = torch.randn(rows, heads * nope + 4096, generator=gen, device="cuda").bfloat16()
        q = wide[:, : heads * nope].view(rows, heads, nope)
        got = op.absorb(q)
        want = torch.einsum("nhp,hpl->nhl", q.double(), w_uk.double())
        scale = want.abs().amax(-1, keepdim=True)
        assert not got.isnan().any()
        assert ((got.double() - want).abs() <= 2**-8 * want.abs() + 2**-20 * scale).all(), rows
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = op.absorb(q)
    wide.copy_(torch.randn(wide.shape, generator=gen, device="cuda").bfloat16())
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, op.absorb(q))
