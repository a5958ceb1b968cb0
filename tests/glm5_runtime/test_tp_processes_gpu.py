"""test_tp_processes on two GPUs of one host (NCCL; the fused boundaries' mailboxes on torch
symmetric memory, peer pointers, multicast off): the reference model across the processes
equals one process holding both ranks, and the specialized decode's partial outputs reduced
in its fused boundaries stay within the stock BF16 model's noise, bit-equal across ranks, and
so does the MTP draft with its sums in the fused exchanges."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_tp_processes import WORLD, check_fused_boundaries, check_fused_draft, check_stock

pytestmark = pytest.mark.multi_gpu


def _worker(rank: int, port: int, failures) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0",
                      TORCH_SYMM_MEM_DISABLE_MULTICAST="1")  # fmt: skip
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=WORLD, device_id=torch.device(rank))
    try:
        check_stock(rank, "cuda")
        check_fused_draft(rank, "cuda")
        check_fused_boundaries(rank, "cuda")
    except BaseException as e:
        failures.put(f"rank {rank}: {type(e).__name__}: {e}")
        raise
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason=f"needs {WORLD} GPUs")
def test_tp2_across_gpus():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    failures = mp.get_context("spawn").SimpleQueue()
    try:
        mp.spawn(_worker, args=(port, failures), nprocs=WORLD, join=True)
    finally:
        reasons = []
        while not failures.empty():
            reasons.append(failures.get())
        assert not reasons, reasons
