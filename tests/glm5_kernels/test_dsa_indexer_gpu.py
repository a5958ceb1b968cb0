"""The indexer's selection on the GPU at GLM-5.3-Flash's shapes: 32 heads of 128, pools of
16 tokens in vLLM's FP8 pages (blocks of 64 tokens scattered), the top 2048 tokens + the
15-token tail, 1 to 64 query rows of requests at different positions (contexts shorter than
top-k too), against `index_topk_ref`; a captured call replays like the eager one.

The FP8 tensor-core dot rounds its FP32 sums differently from the reference's FP32 einsum,
so two pools whose reference scores lie within that rounding of the selection's boundary
may trade places: the selected sets must be equal except for such pools (the tolerance:
2^-9 of the row's largest |score|, above the MMA's ~2^-13 relative error on 128-term sums
of 2^-13-relative FP8 products); the tail and the layout are exact."""

import pytest
import torch

from glm5_kernels.dsa import (
    IndexerTopk,
    index_logits_fp8_ref,
    index_topk_ref,
    pack_kpool_pages_ref,
    rotate_quant_fp8_ref,
    unpack_kpool_pages_ref,
)

pytestmark = pytest.mark.gpu

H, HD, KP, TOPK, BS = 32, 128, 16, 2048, 64
S = BS // KP


def _case(rows, requests, context, seed):
    gen = torch.Generator("cuda").manual_seed(seed)
    per = -(-context // BS)
    blocks = requests * per + 3
    k8, ks = rotate_quant_fp8_ref(torch.randn(blocks, S, HD, generator=gen, device="cuda"))
    pages = pack_kpool_pages_ref(k8, ks)
    table = torch.randperm(blocks, generator=gen, device="cuda")[: requests * per]
    table = table.view(requests, per).int()
    request = torch.randint(0, requests, (rows,), generator=gen, device="cuda").int()
    positions = torch.randint(0, context, (rows,), generator=gen, device="cuda").int()
    q8, q_scale = rotate_quant_fp8_ref(torch.randn(rows, H, HD, generator=gen, device="cuda"))
    weights = torch.randn(rows, H, generator=gen, device="cuda")
    return q8, q_scale, weights, pages, table, request, positions


def _check(got, args):
    want = index_topk_ref(*args, topk=TOPK, kpool=KP, tail=True, width=TOPK + KP - 1)
    got = got.long()
    q8, q_scale, weights, pages, table, request, _ = args
    n = min(TOPK // KP, table.shape[1] * S) * KP  # the selected pools' tokens, then the tail
    assert torch.equal(got[:, n:], want[:, n:])  # the tail and the padding
    keys, scales = unpack_kpool_pages_ref(pages)
    rows = table[request.long()].long()
    scores = index_logits_fp8_ref(q8, q_scale, weights, keys[rows].flatten(1, 2),
                                  scales[rows].flatten(1))  # fmt: skip
    for r in range(got.shape[0]):
        a = set((got[r, :n][got[r, :n] >= 0] // KP).tolist())
        b = set((want[r, :n][want[r, :n] >= 0] // KP).tolist())
        assert len(a) == len(b), r
        if a != b:
            chosen = scores[r, sorted(b)]
            edge = chosen.min()
            tol = 2**-9 * scores[r].abs().max()
            for p in a ^ b:
                assert (scores[r, p] - edge).abs() <= tol, (r, p, scores[r, p], edge, tol)
        layout = got[r, :n].view(-1, KP)
        ok = layout[:, 0] >= 0
        assert torch.equal(layout[ok], (layout[ok, :1] + torch.arange(KP, device="cuda")))
        assert (layout[~ok] == -1).all() and bool((ok[:-1].long() >= ok[1:].long()).all())
        starts = layout[ok, 0]
        assert bool((starts[1:] > starts[:-1]).all())  # pool order


@pytest.mark.parametrize(
    "rows, requests, context",
    [(1, 1, 131072), (4, 2, 16384), (8, 3, 4096), (64, 16, 3000), (64, 64, 900)],
)
def test_matches_the_reference(rows, requests, context):
    args = _case(rows, requests, context, rows + context)
    pools = args[4].shape[1] * S
    op = IndexerTopk(H, HD, kpool=KP, topk=TOPK, tail=True, max_rows=64, max_pools=pools)
    op.prepare()
    out = torch.full((rows, op.width), 123456789, dtype=torch.int32, device="cuda")
    _check(op(*args, out=out), args)
    eager = out.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        op(*args, out=out)
    out.fill_(123456789)
    for _ in range(3):  # the counters reset themselves: every replay the same
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
    assert (op._count == 0).all()
