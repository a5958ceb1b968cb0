"""glm5-comm's one-shot all-reduce (`AllReduce`) on CPU under the Triton interpreter, at 2 and
4 processes whose mailboxes are shared memory (the peer pointers of symmetric memory stand-in):
over consecutive calls (every mailbox slot used twice, sizes off the tile grid, a -0.0 in a
partial) every rank's rows equal `all_reduce_ref`'s math bit for bit — FP32 sum in rank
order, one rounding — into NaN-poisoned outputs, and every mailbox value received is the
sentinel again once read. World size 1 is the identity; bad input is one error."""

import os

import pytest
import torch
import torch.multiprocessing as mp

from glm5_comm import AllReduce, Mailbox
from glm5_comm.allreduce import SENTINEL

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton on CPU needs TRITON_INTERPRET=1"
)

D, MAX_TOKENS = 96, 8  # hidden off the column tile (64 here); rows 1..8
SIZES = (3, 1, 8, 5, 2, 7, 4)  # one call each, in order: slots 0, 1, 2, 0, 1, 2, 0


def _partials(world: int, step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * world + step)
    parts = [torch.randn(SIZES[step], D, generator=gen).bfloat16() for _ in range(world)]
    parts[-1][0, 0] = -0.0  # sent as +0.0: never the sentinel
    return parts


def _worker(rank: int, buffers: list, failures) -> None:
    torch.set_num_threads(1)
    world = len(buffers)
    try:
        reduce = AllReduce(Mailbox.of_tensors(buffers, rank, D, MAX_TOKENS), block_cols=64)
        for step in range(len(SIZES)):
            parts = _partials(world, step)
            want = parts[0].float()
            for p in parts[1:]:
                want = want + p.float()
            out = torch.full_like(parts[rank], float("nan"))
            got = reduce(parts[rank], out=out)
            assert got is out and torch.equal(got, want.bfloat16()), (rank, step)
        mine = buffers[rank]
        peers = [p for p in range(world) if p != rank]
        # Every value received was cleared once read: all slots are the sentinel again.
        assert (mine[:, peers] == SENTINEL).all(), rank
        assert int(reduce.mailbox.step) == len(SIZES) and int(reduce.mailbox.arrive) == 0
    except BaseException as e:  # report, so the parent fails with the reason
        failures.put(f"rank {rank}: {type(e).__name__}: {e}")
        raise


@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_holds_the_rank_order_sum(world):
    buffers = [torch.full(Mailbox.shape(world, D, MAX_TOKENS), SENTINEL, dtype=torch.int16)
               for _ in range(world)]  # fmt: skip
    for b in buffers:
        b.share_memory_()
    failures = mp.get_context("spawn").SimpleQueue()
    try:
        mp.spawn(_worker, args=(buffers, failures), nprocs=world, join=True)
    finally:
        reasons = []
        while not failures.empty():
            reasons.append(failures.get())
        assert not reasons, reasons


def test_world_size_one_is_the_identity_and_bad_input_is_one_error():
    buffer = torch.full(Mailbox.shape(1, D, MAX_TOKENS), SENTINEL, dtype=torch.int16)
    reduce = AllReduce(Mailbox.of_tensors([buffer], 0, D, MAX_TOKENS))
    x = torch.randn(3, D).bfloat16()
    assert reduce(x) is x and torch.equal(reduce(x, out=torch.empty_like(x)), x)
    with pytest.raises(ValueError) as e:
        reduce(torch.randn(MAX_TOKENS + 1, D), out=torch.empty(2, D))
    assert "x:" in str(e.value) and "out:" in str(e.value)
    with pytest.raises(ValueError, match=r"M=9 rows, outside 1\.\.8"):
        reduce(torch.randn(MAX_TOKENS + 1, D).bfloat16())
    with pytest.raises(ValueError) as e:
        Mailbox.of_tensors([buffer, buffer.float()], 2, D, MAX_TOKENS)
    assert "buffer 1:" in str(e.value) and "rank 2 outside" in str(e.value)
