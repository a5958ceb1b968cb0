"""The vocab-parallel embedding (`Embedding`) on CPU under the Triton interpreter against
`embed_ref`, and the reference against torch's own embedding: ids on both sides of the
shard's bounds, a row width off the column block and GLM-5.3-Flash's (4096) at a TP-4
rank's vocab offset, int32 and int64 ids of any shape, NaN-poisoned outputs. A copy: the
rows must be bit-equal. Bad input is one error naming every problem."""

import os

import pytest
import torch
import torch.nn.functional as F

from glm5_kernels.embed import Embedding, embed_ref

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton on CPU needs TRITON_INTERPRET=1"
)

VOCAB_TP4 = 154880 // 4  # a TP-4 rank's shard of GLM-5.3-Flash's vocabulary


def test_the_reference_is_torch_s_masked_embedding():
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(40, 8, generator=gen).bfloat16()
    ids = torch.randint(0, 40, (3, 5), generator=gen)
    shards = [embed_ref(ids, full[s : s + 10], s) for s in range(0, 40, 10)]
    assert torch.equal(sum(x.float() for x in shards).bfloat16(), F.embedding(ids, full))
    for s, x in zip(range(0, 40, 10), shards, strict=True):  # each id in one shard only
        inside = (ids >= s) & (ids < s + 10)
        assert torch.equal(x[~inside], torch.zeros_like(x[~inside]))


@pytest.mark.parametrize("dim, start, rows, dtype", [
    (100, 0, 50, torch.int64), (4096, VOCAB_TP4, 300, torch.int64),
    (4096, 3 * VOCAB_TP4, 64, torch.int32), (2048 + 64, 7, 9, torch.int32),
])  # fmt: skip
def test_matches_the_reference(dim, start, rows, dtype):
    gen = torch.Generator().manual_seed(dim + start)
    table = torch.randn(rows, dim, generator=gen).bfloat16()
    # Ids inside, at both bounds, just past them, and far outside (other shards').
    edges = torch.tensor([start, start + rows - 1, start - 1, start + rows, 0, 154879])
    inside = start + torch.randint(0, rows, (10,), generator=gen)
    ids = torch.cat([edges[edges >= 0], inside])[:13].to(dtype)
    out = torch.full((ids.numel(), dim), float("nan")).bfloat16()
    got = Embedding(table, start)(ids, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(got, embed_ref(ids, table, start))  # a copy: bit-equal, zeros included
    two_d = Embedding(table, start)(ids[:12].view(3, 4))
    assert two_d.shape == (3, 4, dim) and torch.equal(two_d, embed_ref(ids[:12].view(3, 4),
                                                                       table, start))  # fmt: skip


def test_bad_input_names_every_problem():
    with pytest.raises(ValueError, match=r"table: .*float32.*start=-1"):
        Embedding(torch.zeros(4, 8), -1)
    op = Embedding(torch.zeros(4, 8).bfloat16(), 0, max_tokens=4)
    with pytest.raises(ValueError, match=r"ids: torch.float32.*5 ids: this op takes 1..4"):
        op(torch.zeros(5))
    with pytest.raises(ValueError, match=r"out: \(2, 4\)"):
        op(torch.zeros(2, dtype=torch.int64), out=torch.zeros(2, 4).bfloat16())
