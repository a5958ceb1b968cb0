"""The one-shot all-reduce: every rank's TP-partial rows exchanged through peer mailboxes in
one launch (`triton_exchange.one_shot_all_reduce_kernel`), summed in FP32 in rank order and
rounded once — bit-equal to `all_reduce_ref` on every rank.

    mailbox = Mailbox.symmetric(hidden=4096, max_tokens=64)  # torch symmetric memory
    reduce = AllReduce(mailbox)
    y = reduce(x)  # x [M, hidden] BF16, M <= max_tokens; capturable

`Mailbox` holds this rank's view of every rank's buffer (3 slots x world x max_tokens *
hidden BF16 bits, the sentinel until written) and its state words: the step, the arrival
counter, the failure code and the poll budget. On GPUs the buffers are torch symmetric
memory, read and written through peer pointers (no multicast); `Mailbox.of_tensors` takes
buffers another way made visible to every rank (shared CPU memory under the Triton
interpreter, in the tests). World size 1 is the identity: no exchange, no launch.

A peer that never arrives (its process died, or it is out of step) does not hang the GPU:
a rank waits at most the poll budget for each tile, then hands the missing values on as
NaN and marks its mailbox failed; every later exchange on it is NaN at once, and
`Mailbox.check()` raises `ExchangeTimeout` naming the rank, the peer and the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from glm5_kernels.exchange import SENTINEL, SENTINEL32
from glm5_kernels.launch import capturing, interpreting, use_pdl

__all__ = [
    "SENTINEL",
    "SENTINEL32",
    "AllReduce",
    "ExchangeTimeout",
    "Mailbox",
    "MailboxWatch",
    "TiledExchange",
]

SENTINELS = {torch.int16: SENTINEL, torch.int32: SENTINEL32}  # a value not yet written

# A tile's wait for a peer, in polls of the mailbox (a volatile load of the tile each):
# seconds on a GPU (an estimate at ~0.5 us a poll, not yet timed there), beyond any launch
# skew between the ranks, so that only a peer that is gone or out of step trips it.
POLL_BUDGET = 1 << 24


class ExchangeTimeout(RuntimeError):
    """A peer's values never arrived in this rank's mailbox within the poll budget: its
    process is gone or out of step. The exchange's outputs since are NaN."""


@dataclass
class Mailbox:
    """This rank's handle on the ranks' mailboxes: `peers` [world] int64, every rank's buffer
    address in this process; `state` [4] int32, this rank's words: the step (it picks the
    slot; every rank steps alike), the call's CTA arrivals, the failure code (0, or the
    first timed-out wait's 1 + peer + world * step) and the poll budget; `dtype`: the values'
    bits, int16 for BF16 rows (the all-reduces), int32 for FP32 rows (the logits gather).
    `buffers`: what keeps the memory alive."""

    rank: int
    world: int
    hidden: int
    max_tokens: int
    peers: Tensor
    state: Tensor
    buffers: list = field(default_factory=list, repr=False)
    dtype: torch.dtype = torch.int16

    @staticmethod
    def new_state(device, polls: int = POLL_BUDGET) -> Tensor:
        return torch.tensor([0, 0, 0, polls], dtype=torch.int32, device=device)

    # The state words as [1] int32 device views, in the order the kernels index `state`.
    step = property(lambda self: self.state[0:1])
    arrive = property(lambda self: self.state[1:2])
    failed = property(lambda self: self.state[2:3], doc="0, or the first timed-out wait's code")
    polls = property(lambda self: self.state[3:4], doc="a tile's poll budget (set before capture)")

    def check(self, code: int | None = None) -> None:
        """Raise `ExchangeTimeout` if a wait on this mailbox timed out (`code`: the failure
        word, read already; default: read it, a device sync)."""
        code = int(self.failed) if code is None else int(code)
        if code:
            peer, step = (code - 1) % self.world, (code - 1) // self.world
            raise ExchangeTimeout(
                f"rank {self.rank}: rank {peer}'s values never arrived in this rank's "
                f"{self.dtype} mailbox at exchange step {step} (waited {int(self.polls)} "
                "polls a tile): that process is gone or out of step. Every exchange on "
                "this mailbox since gave NaN; a new one is needed.")  # fmt: skip

    @staticmethod
    def shape(world: int, hidden: int, max_tokens: int) -> tuple[int, int, int]:
        """A rank's buffer: 3 slots x `world` sources x max_tokens * hidden values."""
        return (3, world, max_tokens * hidden)

    @classmethod
    def of_tensors(cls, buffers: list[Tensor], rank: int, hidden: int, max_tokens: int,
                   dtype: torch.dtype = torch.int16) -> Mailbox:  # fmt: skip
        """Every rank's buffer (`dtype`, `shape(...)`, the sentinel throughout), as tensors
        of this process whose addresses every rank's kernel may use."""
        world = len(buffers)
        want = cls.shape(world, hidden, max_tokens)
        problems = [f"buffer {r}: {tuple(b.shape)} {b.dtype}, expected {want} {dtype} "
                    "contiguous" for r, b in enumerate(buffers)
                    if tuple(b.shape) != want or b.dtype != dtype
                    or not b.is_contiguous()]  # fmt: skip
        if not 0 <= rank < world:
            problems.append(f"rank {rank} outside 0..{world - 1}")
        if problems:
            raise ValueError("Mailbox: " + "; ".join(problems))
        device = buffers[rank].device
        peers = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64, device=device)
        return cls(rank, world, hidden, max_tokens, peers, cls.new_state(device), list(buffers),
                   dtype)  # fmt: skip

    @classmethod
    def symmetric(cls, hidden: int, max_tokens: int, group=None, device=None,
                  dtype: torch.dtype = torch.int16) -> Mailbox:  # fmt: skip
        """The mailboxes on torch symmetric memory over `group` (default: the world), filled
        with the sentinel, every rank past a barrier before the first exchange."""
        import torch.distributed._symmetric_memory as symm_mem

        group = group or dist.group.WORLD
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        device = device or torch.device("cuda", torch.cuda.current_device())
        buffer = symm_mem.empty(cls.shape(world, hidden, max_tokens), dtype=dtype,
                                device=device)  # fmt: skip
        buffer.fill_(SENTINELS[dtype])
        handle = symm_mem.rendezvous(buffer, group.group_name)
        peers = torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64, device=device)
        state = cls.new_state(device)
        torch.cuda.synchronize(device)
        dist.barrier(group)
        return cls(rank, world, hidden, max_tokens, peers, state, [buffer, handle], dtype)


class MailboxWatch:
    """Mailboxes' failure words seen from the host without a device sync: `record()` after
    a step's exchanges copies them into host memory on the stream (capturable: a CUDA graph
    replays the copy), `check()` before a later step raises `ExchangeTimeout` for the first
    failed one. A failure surfaces a step late at most: by then the step that recorded it
    has finished (the caller read its sampled tokens)."""

    def __init__(self, mailboxes):
        self.mailboxes = [mb for mb in mailboxes if mb is not None and mb.world > 1]
        device = self.mailboxes[0].state.device if self.mailboxes else torch.device("cpu")
        self.host = torch.zeros(len(self.mailboxes), dtype=torch.int32,
                                pin_memory=device.type == "cuda")  # fmt: skip

    def record(self) -> None:
        for i, mb in enumerate(self.mailboxes):
            self.host[i : i + 1].copy_(mb.failed, non_blocking=True)

    def check(self) -> None:
        for mb, code in zip(self.mailboxes, self.host.tolist(), strict=True):
            mb.check(code)


class TiledExchange:
    """What the ops exchanging [M, hidden] rows tile by tile share (`AllReduce`,
    `LogitsGather`): the mailbox of the dtype their rows need, tiles of up to block_rows x
    block_cols, each row tile compiled before CUDA-graph capture (`prepare`: an exchange of
    zeros each, every rank alike), the launch. Subclasses name their kernel and row dtype."""

    kernel_name: str = ""
    rows_dtype: torch.dtype = torch.bfloat16

    def __init__(self, mailbox: Mailbox, *, block_rows: int = 16, block_cols: int = 512):
        want = torch.int16 if self.rows_dtype == torch.bfloat16 else torch.int32
        if mailbox.dtype != want:
            raise ValueError(f"{type(self).__name__}: a mailbox of {mailbox.dtype}, "
                             f"{self.rows_dtype} rows need {want}")  # fmt: skip
        self.mailbox = mailbox
        self.bm, self.bd = block_rows, min(block_cols, 1 << (mailbox.hidden - 1).bit_length())
        self._interp, self._pdl = interpreting(), use_pdl(mailbox.peers.device)
        if mailbox.world > 1:
            from glm5_comm import triton_exchange  # Triton: an extra

            self._kernel = getattr(triton_exchange, self.kernel_name)
        self._ready: set[int] = set()  # row tiles compiled

    def supports(self, m: int) -> bool:
        return 1 <= m <= self.mailbox.max_tokens

    def prepare(self, tokens=None) -> None:
        """Compile every row tile the step sizes `tokens` (default 1..max_tokens) use."""
        if self.mailbox.world == 1:
            return
        sizes = {self._tile(m): m for m in tokens or range(1, self.mailbox.max_tokens + 1)}
        for m in sorted(sizes.values()):
            self(torch.zeros(m, self.mailbox.hidden, dtype=self.rows_dtype,
                             device=self.mailbox.peers.device))  # fmt: skip

    def _tile(self, m: int) -> int:
        return min(self.bm, 1 << (m - 1).bit_length())

    def _launch(self, x: Tensor, out: Tensor, **meta) -> Tensor:
        mb, m = self.mailbox, x.shape[0]
        bm = self._tile(m)
        if bm not in self._ready:
            if capturing():
                raise RuntimeError(f"{type(self).__name__}: {m} rows not prepared before "
                                   "CUDA-graph capture")  # fmt: skip
            self._ready.add(bm)
        self._kernel[(-(-m // bm), -(-mb.hidden // self.bd))](
            x, out, mb.peers, mb.state,
            m, mb.hidden, x.stride(0), out.stride(0), mb.max_tokens * mb.hidden, mb.rank,
            WORLD=mb.world, BM=bm, PDL=self._pdl, num_warps=4, launch_pdl=self._pdl, **meta,
        )  # fmt: skip
        return out


class AllReduce(TiledExchange):
    """The one-shot all-reduce of [M, hidden] BF16 rows, M <= the mailbox's max_tokens."""

    kernel_name = "one_shot_all_reduce_kernel"

    def __call__(self, x: Tensor, out: Tensor | None = None) -> Tensor:
        mb = self.mailbox
        m = x.shape[0] if x.dim() == 2 else -1
        problems = []
        if x.dim() != 2 or x.shape[1] != mb.hidden or x.dtype != torch.bfloat16 or x.stride(1) != 1:
            problems.append(f"x: {tuple(x.shape)} {x.dtype}, expected [M, {mb.hidden}] bfloat16 "
                            "rows")  # fmt: skip
        elif not self.supports(m):
            problems.append(f"M={m} rows, outside 1..{mb.max_tokens} (the mailbox's max_tokens)")
        if out is not None and (tuple(out.shape) != tuple(x.shape) or out.dtype != x.dtype
                                or out.stride(-1) != 1):  # fmt: skip
            problems.append(f"out: {tuple(out.shape)} {out.dtype}, expected x's shape and dtype")
        if problems:
            raise ValueError("AllReduce: " + "; ".join(problems))
        if mb.world == 1:  # the sum of one partial: no exchange
            return x if out is None else out.copy_(x)
        out = torch.empty_like(x) if out is None else out
        return self._launch(x, out, BD=self.bd, INTERPRETER=self._interp)
