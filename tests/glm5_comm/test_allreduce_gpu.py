"""The one-shot all-reduce across the host's GPUs (NVLink peer pointers of torch symmetric
memory; multicast stays off): every rank's rows equal `all_reduce_ref` (NCCL gather, FP32
rank-order sum) bit for bit over consecutive calls of sizes 1..64, eager and as a CUDA graph
replayed with fresh inputs, into NaN-poisoned outputs; `AllReduceNorm` on the same
mailbox, `EmbedNorm`; `LogitsGather` of FP32 vocab shards."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from glm5_comm import (
    AllReduce,
    AllReduceNorm,
    EmbedNorm,
    LogitsGather,
    Mailbox,
    all_reduce_norm_ref,
    all_reduce_ref,
    embed_norm_ref,
    logits_gather_ref,
)

pytestmark = pytest.mark.multi_gpu

D, MAX_TOKENS = 4096, 64


def _worker(rank: int, world: int, port: int, failures) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0",
                      TORCH_SYMM_MEM_DISABLE_MULTICAST="1")  # fmt: skip
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device(rank))
    try:
        reduce = AllReduce(Mailbox.symmetric(D, MAX_TOKENS))
        reduce.prepare()
        gen = torch.Generator("cuda").manual_seed(rank)
        for step, m in enumerate((1, 3, 8, 64, 17, 2, 33)):
            x = torch.randn(m, D, generator=gen, device="cuda").bfloat16()
            out = torch.full_like(x, float("nan"))
            assert torch.equal(reduce(x, out=out), all_reduce_ref(x)), (rank, step, m)
        x = torch.zeros(8, D, dtype=torch.bfloat16, device="cuda")
        out = torch.empty_like(x)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            reduce(x, out=out)
        for step in range(5):
            x.copy_(torch.randn(8, D, generator=gen, device="cuda"))
            out.fill_(float("nan"))
            graph.replay()
            assert torch.equal(out, all_reduce_ref(x)), (rank, "replay", step)
        # The MTP layer's boundary on the same mailbox: the residual bit for bit, the normed
        # row within one BF16 rounding of the reference's.
        weight = torch.ones(D, device="cuda").bfloat16()
        norm = AllReduceNorm(reduce.mailbox, weight, 1e-5)
        norm.prepare()
        for m in (1, 7, 64):
            x = torch.randn(m, D, generator=gen, device="cuda").bfloat16()
            residual = torch.randn(m, D, generator=gen, device="cuda").bfloat16()
            got_res, got = norm(x, residual)
            want_res, want = all_reduce_norm_ref(x, residual, weight, 1e-5)
            assert torch.equal(got_res, want_res), (rank, "norm", m)
            assert ((got.float() - want.float()).abs() <= 2**-7 * want.float().abs()).all()
        # The MTP eh_proj input: a vocab-parallel embedding's rows (one rank holds each).
        embed = EmbedNorm(reduce.mailbox, weight, weight, 1e-5)
        embed.prepare()
        x = torch.randn(5, D, generator=gen, device="cuda").bfloat16() * (rank == 0)
        positions = torch.arange(5, device="cuda")
        hidden = torch.randn(5, D, generator=gen, device="cuda").bfloat16()
        got = embed(x, positions, hidden)
        want = embed_norm_ref(x, positions, hidden, weight, weight, 1e-5)
        assert ((got.float() - want.float()).abs() <= 2**-7 * want.float().abs()).all()
        # The logits gather (a TP-4 rank's vocab shard of 154880 / 4, FP32).
        gather = LogitsGather(Mailbox.symmetric(38720, 64, dtype=torch.int32))
        gather.prepare()
        for m in (1, 9, 64):
            shard = torch.randn(m, 38720, generator=gen, device="cuda")
            assert torch.equal(gather(shard), logits_gather_ref(shard)), (rank, "gather", m)
    except BaseException as e:
        failures.put(f"rank {rank}: {type(e).__name__}: {e}")
        raise
    finally:
        dist.destroy_process_group()


def test_gpus_hold_the_rank_order_sum():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world = torch.cuda.device_count()
    failures = mp.get_context("spawn").SimpleQueue()
    try:
        mp.spawn(_worker, args=(world, port, failures), nprocs=world, join=True)
    finally:
        reasons = []
        while not failures.empty():
            reasons.append(failures.get())
        assert not reasons, reasons
