"""glm5-comm's one-shot all-reduce (`AllReduce`) on CPU under the Triton interpreter, at 2 and
4 processes whose mailboxes are shared memory (the peer pointers of symmetric memory stand-in):
over consecutive calls (every mailbox slot used twice, sizes off the tile grid, a -0.0 in a
partial) every rank's rows equal `all_reduce_ref`'s math bit for bit — FP32 sum in rank
order, one rounding — into NaN-poisoned outputs, and every mailbox value received is the
sentinel again once read. `AllReduceBoundary` at 2 processes: the boundary (post -> pre ->
norm, and the head) above the summed partials, within the boundary kernel's tolerances of the
reference over the single-process sum. World size 1 is the identity; bad input is one error."""

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from glm5_comm import (
    AllReduce,
    AllReduceBoundary,
    AllReduceNorm,
    EmbedNorm,
    LogitsGather,
    Mailbox,
)
from glm5_comm.allreduce import SENTINEL, SENTINEL32
from glm5_kernels.mhc import MhcBoundary, hc_fused_post_pre_ref, hc_head_ref, hc_post_ref
from glm5_kernels.norm import rms_norm_ref

sys.path.insert(0, str(Path(__file__).parents[1] / "glm5_kernels"))
from mhc_cases import (  # the boundary kernel's tolerances
    assert_mix,
    assert_normed,
    assert_streams,
    boundary_inputs,
    config,
    site_weights,
)

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


def _rank_order_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """What every rank must hold: the partials summed in FP32 in rank order, rounded once."""
    return sum((p.float() for p in parts[1:]), parts[0].float()).bfloat16()


def _worker(rank: int, buffers: list, failures) -> None:
    torch.set_num_threads(1)
    world = len(buffers)
    try:
        reduce = AllReduce(Mailbox.of_tensors(buffers, rank, D, MAX_TOKENS), block_cols=64)
        for step in range(len(SIZES)):
            parts = _partials(world, step)
            want = _rank_order_sum(parts)
            out = torch.full_like(parts[rank], float("nan"))
            got = reduce(parts[rank], out=out)
            assert got is out
            if not torch.equal(got, want):  # what a rare failure needs to be read
                # A timed-out wait's code (its values NaN), else 0: a stale or torn value.
                failed = int(reduce.mailbox.failed)
                raise AssertionError(_mismatch(got, want, parts, rank, step, failed))
        mine = buffers[rank]
        peers = [p for p in range(world) if p != rank]
        # Every value received was cleared once read: all slots are the sentinel again.
        assert (mine[:, peers] == SENTINEL).all(), rank
        assert int(reduce.mailbox.step) == len(SIZES) and int(reduce.mailbox.arrive) == 0
    except BaseException as e:  # report, so the parent fails with the reason
        failures.put(f"rank {rank}: {type(e).__name__}: {e}")
        raise


def _mismatch(got, want, parts, rank: int, step: int, failed: int) -> str:
    """Where a rank's sum is wrong, and whether its values are a stale or partial sum: each
    wrong element's value beside the sum without each peer's partial and the sums of the
    steps sharing this one's slot (a value read from a slot before its peer rewrote it)."""
    where = (got != want).nonzero().tolist()  # a NaN included: want has none
    lines = [f"rank {rank} step {step}: {len(where)} of {got.numel()} wrong, "
             f"{int(got.isnan().sum())} NaN, mailbox failure code {failed}"]  # fmt: skip
    world = len(parts)
    without = [_rank_order_sum(parts[:drop] + parts[drop + 1 :]) for drop in range(world)]
    earlier = [_rank_order_sum(_partials(world, s)) for s in range(step % 3, step, 3)]
    for i, j in where[:4]:
        without_ij = [float(y[i, j]) for y in without]
        stale = [float(y[i, j]) for y in earlier if i < y.shape[0]]
        lines.append(
            f"  [{i}, {j}] got {float(got[i, j])} want {float(want[i, j])}; "
            f"without a peer {without_ij}; this slot's earlier sums {stale}"
        )
    return "\n".join(lines)


def _spawn(worker, world: int, dtype=torch.int16, sentinel=SENTINEL) -> None:
    """`worker(rank, buffers, failures)` in `world` processes sharing their mailboxes (every
    value the sentinel); fails with every rank's reason."""
    buffers = [torch.full(Mailbox.shape(world, D, MAX_TOKENS), sentinel, dtype=dtype)
               for _ in range(world)]  # fmt: skip
    for b in buffers:
        b.share_memory_()
    failures = mp.get_context("spawn").SimpleQueue()
    try:
        mp.spawn(worker, args=(buffers, failures), nprocs=world, join=True)
    finally:
        reasons = []
        while not failures.empty():
            reasons.append(failures.get())
        assert not reasons, reasons


@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_holds_the_rank_order_sum(world):
    _spawn(_worker, world)


def _boundary_worker(rank: int, buffers: list, failures) -> None:
    torch.set_num_threads(1)
    world, c = len(buffers), config(D)
    try:
        mailbox = Mailbox.of_tensors(buffers, rank, D, MAX_TOKENS)
        op = AllReduceBoundary(mailbox, MhcBoundary(c, max_tokens=MAX_TOKENS, device="cpu"))
        eps = {"rms_eps": c.rms_eps, "hc_eps": c.hc_eps, "sinkhorn_iters": c.sinkhorn_iters,
               "norm_eps": c.norm_eps}  # fmt: skip
        for step, m in enumerate((3, 1)):
            gen = torch.Generator().manual_seed(step)  # the same on every rank
            site = site_weights(c, "cpu", gen)
            _, streams, post, comb = boundary_inputs(c, m, "cpu", gen)
            parts = [torch.randn(m, D, generator=gen).bfloat16() for _ in range(world)]
            y = _rank_order_sum(parts)
            got = op.post_pre(parts[rank], streams, post, comb, *site)
            want = hc_fused_post_pre_ref(y, streams, post, comb, *site, **eps)
            assert_streams(got[0], want[0])
            assert_mix(got[1], got[2], want[1], want[2])
            assert_normed(got[3], want[3].bfloat16())
            head = op.head(parts[rank], streams, post, comb, site[3])
            want = rms_norm_ref(hc_head_ref(hc_post_ref(y, streams, post, comb)), site[3],
                                c.norm_eps)  # fmt: skip
            assert_normed(head, want.bfloat16())
    except BaseException as e:
        failures.put(f"rank {rank}: {type(e).__name__}: {e}")
        raise


def test_the_boundary_above_the_summed_partials():
    _spawn(_boundary_worker, 2)


def _norm_worker(rank: int, buffers: list, failures) -> None:
    torch.set_num_threads(1)
    world = len(buffers)
    try:
        mailbox = Mailbox.of_tensors(buffers, rank, D, MAX_TOKENS)
        gen = torch.Generator().manual_seed(7)  # the same on every rank
        weight = (1 + 0.1 * torch.randn(D, generator=gen)).bfloat16()
        op = AllReduceNorm(mailbox, weight, 1e-5)
        for step, m in enumerate((3, 1, 8, 2)):
            parts = [torch.randn(m, D, generator=gen).bfloat16() for _ in range(world)]
            residual = torch.randn(m, D, generator=gen).bfloat16()
            y = _rank_order_sum(parts)
            want_res = (y.float() + residual.float()).bfloat16()
            want = rms_norm_ref(want_res, weight, 1e-5)
            out = (torch.full_like(residual, float("nan")), torch.full_like(residual, float("nan")))
            got_res, got = op(parts[rank], residual, out=out)
            assert got_res is out[0] and torch.equal(got_res, want_res), (rank, step)
            assert_normed(got, want)
    except BaseException as e:
        if failures is not None:  # None: this process, world size 1
            failures.put(f"rank {rank}: {type(e).__name__}: {e}")
        raise


def _embed_worker(rank: int, buffers: list, failures) -> None:
    torch.set_num_threads(1)
    world = len(buffers)
    try:
        gen = torch.Generator().manual_seed(9)  # the same on every rank
        ew, hw = ((1 + 0.1 * torch.randn(D, generator=gen)).bfloat16() for _ in range(2))
        op = EmbedNorm(Mailbox.of_tensors(buffers, rank, D, MAX_TOKENS), ew, hw, 1e-5)
        vocab = 4 * world
        table = torch.randn(vocab, D, generator=gen).bfloat16()
        for step, m in enumerate((3, 1, 6)):
            ids = torch.randint(0, vocab, (m,), generator=gen)
            positions = torch.randint(0, 5, (m,), generator=gen)
            positions[0] = 0  # the first position's embedding is zeroed
            hidden = torch.randn(m, D, generator=gen).bfloat16()
            shard = vocab // world  # vocab-parallel: each row lives on one rank
            part = table[ids] * ((ids // shard) == rank)[:, None].bfloat16()
            got = op(part, positions, hidden)
            embedded = table[ids] * (positions != 0)[:, None].bfloat16()
            assert_normed(got[:, :D], rms_norm_ref(embedded, ew, 1e-5))
            assert_normed(got[:, D:], rms_norm_ref(hidden, hw, 1e-5))
            assert (got[0, :D] == 0).all(), (rank, step)
    except BaseException as e:
        if failures is not None:  # None: this process, world size 1
            failures.put(f"rank {rank}: {type(e).__name__}: {e}")
        raise


@pytest.mark.parametrize("world", [1, 2])
def test_the_mtp_input_above_the_embedding_partials(world):
    """EmbedNorm: the vocab-parallel embedding's rows summed (exact), zeroed at position 0
    and enorm'd, beside hnorm(hidden), within the norm's roundings of embed_norm_ref's."""
    if world == 1:
        _embed_worker(0, [torch.full(Mailbox.shape(1, D, MAX_TOKENS), SENTINEL,
                                     dtype=torch.int16)], None)  # fmt: skip
    else:
        _spawn(_embed_worker, world)


@pytest.mark.parametrize("world", [1, 2])
def test_the_norm_above_the_summed_partials(world):
    """AllReduceNorm (the MTP layer's boundaries): the residual bit for bit, the normed row
    within the norm's roundings; world size 1 is the add and the norm alone."""
    if world == 1:
        _norm_worker(0, [torch.full(Mailbox.shape(1, D, MAX_TOKENS), SENTINEL,
                                    dtype=torch.int16)], None)  # fmt: skip
    else:
        _spawn(_norm_worker, world)


def _gather_worker(rank: int, buffers: list, failures) -> None:
    torch.set_num_threads(1)
    world = len(buffers)
    try:
        gather = LogitsGather(Mailbox.of_tensors(buffers, rank, D, MAX_TOKENS, torch.int32),
                              block_cols=64)  # fmt: skip
        for step, m in enumerate((2, 8, 1, 5)):
            gen = torch.Generator().manual_seed(step)  # every rank draws every shard
            shards = [torch.randn(m, D, generator=gen) * 10 for _ in range(world)]
            shards[0][0, :3] = torch.tensor([float("-inf"), -0.0, float("nan")])
            shards[-1][-1, -1] = torch.tensor(SENTINEL32, dtype=torch.int32).view(torch.float32)
            out = torch.full((m, world * D), 7.0)
            got = gather(shards[rank], out=out)
            want = torch.cat(shards, dim=-1)
            assert got is out and torch.equal(got.isnan(), want.isnan()), (rank, step)
            ok = ~want.isnan()
            assert torch.equal(got[ok].view(torch.int32), want[ok].view(torch.int32)), (rank, step)
        peers = [p for p in range(world) if p != rank]
        assert (buffers[rank][:, peers] == SENTINEL32).all(), rank
    except BaseException as e:
        failures.put(f"rank {rank}: {type(e).__name__}: {e}")
        raise


@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_holds_the_full_logits(world):
    """LogitsGather: every rank's vocab shard in its columns of every rank's rows, bit for bit
    (inf, -0.0 and NaNs included; the sentinel's own NaN bits arrive as a NaN)."""
    _spawn(_gather_worker, world, torch.int32, SENTINEL32)


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
