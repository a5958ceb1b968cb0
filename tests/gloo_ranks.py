"""Run a check in `world` CPU processes under gloo, one rank each (torch.multiprocessing spawn).

Each process frees what it built (a reference model can sit in a reference cycle, holding the
process group), meets the others at a barrier, destroys its group, and on success ends with
`os._exit(0)`: nothing is left to check once the barrier is passed, and gloo's worker threads
torn down during interpreter finalization have aborted a passing process
("terminate called without an active exception", SIGABRT). A failing check raises as usual:
spawn reports its traceback and the parent fails."""

import gc
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from interpreter_calls import install as interpreter_calls


def spawn_gloo(check, world: int, *args) -> None:
    """`check(rank, *args)` in `world` processes under one gloo group; fails with a rank's
    traceback if any check raises."""
    mp.spawn(_worker, args=(world, _free_port(), check, args), nprocs=world, join=True)


def _worker(rank: int, world: int, port: int, check, args) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    interpreter_calls()  # as the parent's conftest does
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        check(rank, *args)
        gc.collect()
        dist.barrier()  # neither process tears its group down while the other still uses it
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
