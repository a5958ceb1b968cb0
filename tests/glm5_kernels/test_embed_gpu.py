"""The vocab-parallel embedding on the GPU at GLM-5.3-Flash's shapes (4096-wide rows of a TP-4
rank's 38720-token shard): 1..64 ids inside and outside the shard into NaN-poisoned
outputs, bit-equal to `embed_ref` (a copy); a captured call replays like the eager one."""

import pytest
import torch

from glm5_kernels.embed import Embedding, embed_ref

pytestmark = pytest.mark.gpu

D, ROWS = 4096, 154880 // 4


@pytest.mark.parametrize("n, rank", [(1, 0), (3, 1), (17, 2), (64, 3)])
def test_matches_the_reference(n, rank):
    gen = torch.Generator("cuda").manual_seed(n)
    table = torch.randn(ROWS, D, generator=gen, device="cuda").bfloat16()
    ids = torch.randint(0, 4 * ROWS, (n,), generator=gen, device="cuda")
    ids[: n // 2] = rank * ROWS + ids[: n // 2] % ROWS  # half of them this shard's
    op = Embedding(table, rank * ROWS)
    op.prepare()
    out = torch.full((n, D), float("nan"), device="cuda").bfloat16()
    assert torch.equal(op(ids, out=out), embed_ref(ids, table, rank * ROWS))


def test_a_captured_call_replays_like_eager():
    table = torch.randn(ROWS, D, device="cuda").bfloat16()
    op = Embedding(table, ROWS)
    op.prepare()
    ids = torch.tensor([ROWS, 5, 2 * ROWS - 1, 2 * ROWS], device="cuda")
    eager = op(ids).clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op(ids)
    out.fill_(float("nan"))
    ids.copy_(torch.tensor([ROWS + 1, 2 * ROWS - 2, 0, ROWS], device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, embed_ref(ids, table, ROWS)) and not torch.equal(out, eager)
