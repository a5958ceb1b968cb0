"""IndexerTopk (Triton, under the interpreter on CPU) against index_topk_ref: rows of several
requests over scattered blocks of packed pages (vLLM's block stride), positions at every
tail length, contexts shorter than top-k (every visible pool selected, -1 picks after them),
tied scores (the earlier pool wins), several scoring splits and one, head weights at a row
stride of their own, outputs poisoned; bad input is one error."""

import pytest
import torch

from glm5_kernels.dsa import IndexerTopk, index_topk_ref, pack_kpool_pages_ref, rotate_quant_fp8_ref

POISON = 123456789


def _packed(pages):
    """The pages as vLLM lays them out: each block's page, then other layers' bytes (0xFF: an
    FP8 NaN, never read) before the next block's."""
    blocks, s, width = pages.shape
    packed = torch.full((blocks, s * width + 8), 0xFF, dtype=torch.uint8)
    view = packed[:, : s * width].view(blocks, s, width)
    view.copy_(pages)
    return view


def _case(gen, heads, hd, s, blocks, requests, rows, positions, tie=False):
    keys = torch.randn(blocks, s, hd, generator=gen)
    if tie:  # one key for every pool: equal scores wherever visible
        keys[:] = keys[0, 0]
    k8, ks = rotate_quant_fp8_ref(keys)
    pages = _packed(pack_kpool_pages_ref(k8, ks))
    per = blocks // requests
    table = torch.randperm(blocks, generator=gen)[: requests * per].view(requests, per).int()
    q8, q_scale = rotate_quant_fp8_ref(torch.randn(rows, heads, hd, generator=gen))
    # The head weights as the decode hands them: columns of the indexer's one projection
    # (wk | gate | weights_proj sums), a row stride of their own.
    weights = torch.randn(rows, 24 + heads, generator=gen)[:, 24:]
    request = torch.arange(rows) % requests
    return q8, q_scale, weights, pages, table, request.int(), torch.tensor(positions).int()


@pytest.mark.parametrize(
    "heads, hd, kpool, topk, s, blocks, requests, positions, splits",
    [
        (8, 16, 4, 8, 4, 12, 2, [3, 17, 30, 45, 46, 47], None),  # short: every visible pool
        (8, 32, 4, 16, 4, 40, 2, [160, 161, 79, 158], None),  # top 4 of up to 80 pools
        (20, 16, 4, 12, 2, 210, 3, [559, 300, 133, 400, 559, 5], 3),  # heads off 16, splits
        (8, 16, 4, 8, 4, 12, 1, [40, 47], 1),  # one split: all pools in one CTA
    ],
    ids=["short-contexts", "selection", "odd-heads-splits", "one-split"],
)
def test_matches_the_reference(heads, hd, kpool, topk, s, blocks, requests, positions, splits):
    gen = torch.Generator().manual_seed(heads + hd + len(positions))
    rows = len(positions)
    args = _case(gen, heads, hd, s, blocks, requests, rows, positions)
    pools = args[4].shape[1] * s
    op = IndexerTopk(heads, hd, kpool=kpool, topk=topk, tail=True, max_rows=8, max_pools=pools,
                     device="cpu")  # fmt: skip
    op.prepare()
    if splits:
        op.splits = lambda rows, pools: splits
        assert pools > (splits - 1) * 64  # each split a whole scoring step or more
    for _ in range(2):  # the counters reset themselves: a second call is the same
        out = torch.full((rows, op.width), POISON, dtype=torch.int32)
        got = op(*args, out=out)
        assert got is out
        want = index_topk_ref(*args, topk=topk, kpool=kpool, tail=True, width=op.width)
        assert torch.equal(got.long(), want), (got, want)
    assert (op._count == 0).all()


def test_ties_go_to_the_earlier_pool():
    gen = torch.Generator().manual_seed(7)
    heads, hd, kpool, topk, s = 8, 16, 4, 8, 4
    positions = [47, 40, 31]
    args = _case(gen, heads, hd, s, 12, 1, 3, positions, tie=True)
    op = IndexerTopk(heads, hd, kpool=kpool, topk=topk, tail=True, max_rows=4, max_pools=48,
                     device="cpu")  # fmt: skip
    got = op(*args)
    want = index_topk_ref(*args, topk=topk, kpool=kpool, tail=True, width=op.width)
    assert torch.equal(got.long(), want)
    # Every score equal: the first two pools of the request's table (tokens 0..7), then the
    # tail (the position's incomplete pool) and -1.
    for row, pos in enumerate(positions):
        filled = (pos + 1) % kpool
        tail = [pos + 1 - filled + j if j < filled else -1 for j in range(kpool - 1)]
        assert got[row, :8].tolist() == list(range(8)) and got[row, 8:11].tolist() == tail


def test_bad_input_names_every_problem():
    gen = torch.Generator().manual_seed(3)
    args = list(_case(gen, 8, 16, 4, 12, 2, 2, [5, 9]))
    op = IndexerTopk(8, 16, kpool=4, topk=8, tail=True, max_rows=4, max_pools=64, device="cpu")
    bad = [args[0].float(), args[1], args[2][:, :3], args[3][..., :10], args[4].float(),
           args[5], args[6]]  # fmt: skip
    with pytest.raises(ValueError) as e:
        op(*bad)
    for name in ("q:", "weights:", "pages:", "block_table:"):
        assert name in str(e.value), e.value
    args[4] = args[4] + 100  # blocks outside the pages
    with pytest.raises(ValueError, match="block_table: a block outside"):
        op(*args)
    with pytest.raises(ValueError, match="head_dim=12"):
        IndexerTopk(8, 12, kpool=4, topk=8, tail=True, device="cpu")
