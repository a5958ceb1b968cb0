"""A peer that never arrives, under the Triton interpreter in one process: rank 0 of a world of
2 whose rank 1 never runs. Each exchange (the all-reduce, the all-reduce + norm, the logits
gather) waits its poll budget, then hands the missing values on as NaN and marks the
mailbox failed with the first wait's peer and step; every later call on it is NaN at once
(the code stays the first), and `Mailbox.check` raises one error naming rank, peer, step.
Where the peer's values are in the mailbox already (written as its push would), the same
single process sums them exactly and nothing fails."""

import os

import pytest
import torch

from glm5_comm import AllReduce, AllReduceNorm, ExchangeTimeout, LogitsGather, Mailbox
from glm5_comm.allreduce import SENTINELS

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton on CPU needs TRITON_INTERPRET=1"
)

D, MAX_TOKENS, POLLS = 96, 8, 3  # hidden off the column tile; a budget the test waits out


def _mailbox(dtype=torch.int16, polls=POLLS) -> Mailbox:
    buffers = [torch.full(Mailbox.shape(2, D, MAX_TOKENS), SENTINELS[dtype], dtype=dtype)
               for _ in range(2)]  # fmt: skip
    mb = Mailbox.of_tensors(buffers, 0, D, MAX_TOKENS, dtype)
    mb.polls.fill_(polls)
    return mb


def _push_from_peer(mb: Mailbox, rows: torch.Tensor, step: int) -> None:
    """Rank 1's push of `rows` into rank 0's mailbox at `step`, as its kernel stores it."""
    bits = rows.contiguous().view(mb.dtype).flatten()
    mb.buffers[0][step % 3, 1, : bits.numel()] = bits


def test_the_all_reduce_gives_nan_and_raises_after_its_budget():
    mb = _mailbox()
    reduce = AllReduce(mb, block_cols=64)
    mb.check()  # nothing failed yet
    x = torch.randn(5, D).bfloat16()
    # The peer's rows in the mailbox already: the exact sum, within the budget.
    peer = torch.randn(5, D).bfloat16()
    _push_from_peer(mb, peer, step=0)
    got = reduce(x, out=torch.full_like(x, float("nan")))
    assert torch.equal(got, (x.float() + peer.float()).bfloat16())
    mb.check()
    assert (mb.buffers[0][0, 1] == SENTINELS[torch.int16]).all()  # read, cleared
    # The peer never pushes step 1: every row NaN after the budget, the mailbox failed.
    got = reduce(x, out=torch.zeros_like(x))
    assert got.isnan().all() and int(mb.step) == 2
    with pytest.raises(ExchangeTimeout) as e:
        mb.check()
    assert "rank 0: rank 1's values never arrived" in str(e.value)
    assert "at exchange step 1 (waited 3 polls a tile)" in str(e.value)
    # Failed stays failed: the peer's values arriving late change nothing, NaN at once.
    _push_from_peer(mb, peer, step=2)
    mb.polls.fill_(1 << 30)  # a wait now would outlast the test: there is none
    assert reduce(x).isnan().all() and int(mb.step) == 3
    assert int(mb.failed) == 1 + 1 + 2 * 1  # the first failure's code


def test_the_norm_and_the_gather_fail_alike():
    mb = _mailbox()
    norm = AllReduceNorm(mb, torch.randn(D).bfloat16(), 1e-5)
    x = torch.randn(3, D).bfloat16()
    res, normed = norm(x, torch.randn(3, D).bfloat16())
    assert res.isnan().all() and normed.isnan().all()
    with pytest.raises(ExchangeTimeout, match="at exchange step 0"):
        mb.check()

    mb = _mailbox(torch.int32)
    gather = LogitsGather(mb, block_cols=64)
    shard = torch.randn(4, D)
    got = gather(shard)
    # Its own columns are its shard's; the peer's never came: NaN.
    assert torch.equal(got[:, :D], shard) and got[:, D:].isnan().all()
    with pytest.raises(ExchangeTimeout, match=r"torch.int32 mailbox at exchange step 0"):
        mb.check()
