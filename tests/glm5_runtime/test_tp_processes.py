"""TP ranks in separate processes, on CPU under gloo (2 processes, one rank each).

The reference model across processes (`ReferenceModel(group=...)`) equals the one-process
simulation holding both shards, bit for bit: every sum is glm5-comm's reference all-reduce
(FP32 in rank order, one rounding) and the logits its gather.

The specialized decode over it leaves every sublayer's output TP-partial and reduces it in
the fused boundary (glm5-comm's `AllReduceBoundary`, under the Triton interpreter, the two
processes' mailboxes in shared memory standing in for symmetric memory's peer pointers):
planned decode and verify steps stay within the stock BF16 model's own noise of the stock
step (test_decode's per-row bound, where the routing and selection agree), each stage call
within its bound of the stock op on the same input and each MoE routing route_ref's on the
stage's own logits (test_decode's per-call checks, on this rank's shard), no stock
all-reduce runs (the embedding's partial is summed in the first boundary), and both ranks
hold bit-identical hidden states (each sums the same partials in the same order). The
logits' vocab shards are gathered through mailboxes too (glm5-comm's `LogitsGather`), bit
for bit the reference gather of the skinny head's shards."""

import os

import pytest
import torch
import torch.distributed as dist
from decode_cases import ALL_STAGES, Yardstick, check_calls, rel, shadow
from gloo_ranks import spawn_gloo

from glm5_comm import ExchangeTimeout, Mailbox, logits_gather_ref
from glm5_comm.allreduce import SENTINELS
from glm5_policy import DecodeConfig
from glm5_runtime.decode import SpecializedDecode
from glm5_runtime.draft import SpecializedDraft
from glm5_runtime.reference import ReferenceModel, geometry
from glm5_runtime.reference.backbone import ReferenceBackbone
from glm5_runtime.reference.weights import random_rank

WORLD, Q, SEED = 2, 2, 7
MIN_COMPARED = 1 / 8  # of the rows, whose choices agree with stock (test_decode's)
SIZES = [1, Q, Q * Q]  # capture sizes: Q (decode) and Q * Q (verify) are planned
KW = dict(max_requests=Q, max_context=64, block_size=16, q=Q, fp8_activations=True)
POLICY = {**ALL_STAGES, "logits_gather": {"1-64": "nvlink"}}


def _geometry(ranks):
    """test_decode's four layers (every stage and layer kind) at TP 2, whole FP8 blocks per
    shard, routing for real (4 of 16 experts by score + correction bias, 2 pools of up to 5
    selected): the end-to-end checks compare the requests whose choices agree (Yardstick)."""
    return geometry(
        "tiny", hidden_size=128, intermediate_size=256, moe_intermediate_size=256,
        num_hidden_layers=4, tp_size=WORLD, ranks=ranks,
        layer_types=("linear_attention",) + ("deepseek_sparse_attention",) * 2
        + ("linear_attention",),
        mlp_layer_types=("dense", "sparse", "sparse", "sparse"),
        indexer_types=("full", "full", "shared", "full"),
    )  # fmt: skip


def _model(rank, dtype=torch.bfloat16, group=None, device="cpu"):
    """This process's rank of the model (with `group`), or every rank in one process."""
    g = _geometry((rank,) if group is not None else tuple(range(WORLD)))
    shards = [dict(random_rank(g, r, SEED, dtype=dtype, device=device)) for r in g.ranks]
    return ReferenceModel(g, shards, dtype=dtype, group=group, device=device, **KW)


def _steps(models, gen, g, run, before=None):
    """A prefill (stock), then decode, verify (keep 1), decode, verify (keep 2) on every
    model alike, each model's steps through its `run` (None: stock), `before()` before each
    step; yields each step's hidden states, model by model, then the first model's Step."""
    requests = list(range(Q))
    for m in models:
        assert [m.add() for _ in requests] == requests
    device = models[0].device
    prompt = torch.randint(0, g.vocab_size, (Q, 9), generator=gen).to(device)
    for m in models:
        m.forward(requests, prompt)
    for i in range(4):
        verify = i % 2 == 1
        tokens = torch.randint(0, g.vocab_size, (Q, Q if verify else 1), generator=gen)
        tokens = tokens.to(device)
        if before is not None:
            before()
        step = models[0].step(requests, tokens.shape[1], verify=verify)
        out = [
            m.forward(requests, tokens, verify=verify, run=r, step=step if m is models[0] else None)
            for m, r in zip(models, run, strict=True)
        ]
        if verify:
            for m in models:
                for r in requests:
                    m.accept(r, 1 + i // 2)
        yield *out, step


def check_stock(rank: int, device: str) -> None:
    """This rank's stock steps across the processes equal one process's holding both."""
    mine = _model(rank, group=dist.group.WORLD, device=device)
    whole = _model(rank, device=device)
    gen = torch.Generator().manual_seed(1)
    for a, b, _ in _steps([mine, whole], gen, mine.g, run=[None, None]):
        assert torch.equal(a, b), rel(a, b)
        assert torch.equal(mine.logits(a), whole.logits(b))
    for layer in mine.g.kda_layers:  # the rank's caches are the simulation's rank's
        assert torch.equal(mine.ranks[0].c.recurrent[layer], whole.ranks[rank].c.recurrent[layer])


def _check_fused_on_cpu(rank: int, buffers: dict) -> None:
    taken = dict.fromkeys(buffers, 0)

    def mailbox(hidden, max_tokens, dtype):  # each call its own buffers, in call order
        sets = buffers[dtype]
        taken[dtype] += 1
        return Mailbox.of_tensors(sets[taken[dtype] - 1], rank, hidden, max_tokens, dtype)

    def all_read():
        for dtype, sets in buffers.items():
            for mine in (b[rank] for b in sets):
                assert (mine[:, 1 - rank] == SENTINELS[dtype]).all(), dtype  # read, cleared

    check_fused_draft(rank, "cpu", mailbox)
    check_fused_boundaries(rank, "cpu", mailbox, all_read)


def check_fused_draft(rank: int, device: str, mailbox=None) -> None:
    """The MTP draft layer with its sums in glm5-comm's fused exchanges (EmbedNorm, then
    AllReduceNorm twice): a draft prefill and two draft decodes within test_decode's draft
    bound of the stock draft (per row, against the FP32 draft's yardstick), no stock
    all-reduce, bit-equal across the ranks."""
    group = dist.group.WORLD
    stock, spec = (_model(rank, group=group, device=device) for _ in range(2))
    fp32 = _model(rank, torch.float32, group=group, device=device)
    config = DecodeConfig.build(max_context=64, q=Q, capture_sizes=SIZES, policy=POLICY)
    draft = SpecializedDraft(ReferenceBackbone(spec, mailbox=mailbox), config)
    assert draft.prepare() == set()
    pairs = []
    shadow(draft, spec, pairs)
    assert set(draft.exchange) == {0} and draft.exchange_tokens == set(SIZES)
    sums = []
    spec_reduce = spec.reduce
    spec.reduce = lambda partials: sums.append(1) or spec_reduce(partials)
    gen = torch.Generator().manual_seed(4)
    requests = list(range(Q))
    for m in (stock, spec, fp32):
        assert [m.add() for _ in requests] == requests
    yardstick = Yardstick(stock, spec, fp32, [draft])
    hidden = torch.randn(Q, Q, spec.g.hidden_size, generator=gen).bfloat16().to(device)
    for t, start in ((Q, 5), (1, 5 + Q), (1, 6 + Q)):  # a draft prefill, then two decodes
        tokens = torch.randint(0, spec.g.vocab_size, (Q, t), generator=gen).to(device)
        positions = (start + torch.arange(Q, device=device).expand(Q, Q))[:, :t]
        yardstick.start()
        at = stock.place(requests, positions)
        ref, _ = stock.draft_hidden(tokens, hidden[:, :t], at)
        h32, _ = fp32.draft_hidden(tokens, hidden[:, :t].float(), fp32.place(requests, positions))
        placement = spec.place(requests, positions)
        decision = draft.plan(placement, capturing=True)
        assert decision.step is not None, decision.reason
        sums.clear()
        out = draft.run(decision.step, 0, tokens, hidden[:, :t], placement)
        assert not sums, len(sums)  # every sum in the exchanges
        ref, h32 = (ref[:, -1:], h32[:, -1:]) if t > 1 else (ref, h32)
        assert out.shape == ref.shape
        yardstick.compare(ref, out, h32, step=at)
        check_calls(pairs)
        pairs.clear()
        peers = [torch.empty_like(out) for _ in range(WORLD)]
        dist.all_gather(peers, out)
        assert all(torch.equal(p, out) for p in peers)
    yardstick.check(MIN_COMPARED)


def check_fused_boundaries(rank: int, device: str, mailbox=None, all_read=None) -> None:
    """This rank's planned steps (partial outputs, fused all-reduce boundaries) against its
    stock steps, within the stock BF16 model's noise, and bit-equal across the ranks. Then
    (after `all_read()`, a check of the mailboxes) rank 1 a step ahead of rank 0: each
    rank's exchange waits its poll budget for the other in vain, the step is NaN, and the
    next logits raise `ExchangeTimeout` naming the peer. `mailbox`: the backbone's
    (default: symmetric memory, on GPUs)."""
    group = dist.group.WORLD
    stock, spec = (_model(rank, group=group, device=device) for _ in range(2))
    fp32 = _model(rank, torch.float32, group=group, device=device)
    g = spec.g
    config = DecodeConfig.build(max_context=64, q=Q, capture_sizes=SIZES, policy=POLICY)
    decode = SpecializedDecode(ReferenceBackbone(spec, mailbox=mailbox), config)
    assert decode.prepare() == set()
    assert decode.exchange is not None and decode.partial(Q) and decode.partial(Q * Q)
    assert decode.logits_gather is not None and decode.gather_tokens == {Q, Q * Q}
    pairs = []  # every stage call beside the stock op on the same input (test_decode's)
    shadow(decode, spec, pairs)
    sums = []
    spec_reduce = spec.reduce
    spec.reduce = lambda partials: sums.append(1) or spec_reduce(partials)

    def planned(tokens, step):
        decision = decode.plan(step, capturing=True)
        assert decision.step is not None, decision.reason
        sums.clear()
        out = decode.run(decision.step, tokens, step)
        assert not sums, len(sums)  # the embedding's and every sublayer's: in the boundaries
        return out

    yardstick = Yardstick(stock, spec, fp32, [decode])
    gen = torch.Generator().manual_seed(2)
    runs = [None, planned, None]
    steps = _steps([stock, spec, fp32], gen, g, runs, yardstick.start)
    for h_stock, h_spec, h_fp32, step in steps:
        peers = [torch.empty_like(h_spec) for _ in range(WORLD)]
        dist.all_gather(peers, h_spec)
        assert all(torch.equal(p, h_spec) for p in peers)  # one sum on every rank
        gathers = int(decode.logits_gather.mailbox.step)
        logits = decode.compute_logits(h_spec)
        assert int(decode.logits_gather.mailbox.step) == gathers + 1  # through the mailboxes
        x = h_spec.reshape(-1, g.hidden_size)
        shard = decode.head[x.shape[0]][0](x).float()
        assert torch.equal(logits.view(x.shape[0], -1), logits_gather_ref(shard, group))
        logits = logits, stock.logits(h_stock), fp32.logits(h_fp32)
        yardstick.compare(h_stock, h_spec, h_fp32, logits, step)
        check_calls(pairs)  # this rank's shard of each call, per row; routing route_ref's
        pairs.clear()
    yardstick.check(MIN_COMPARED)
    if all_read is not None:
        all_read()
    decode.exchange.mailbox.polls.fill_(4)
    if rank == 1:
        decode.exchange.mailbox.step.add_(1)  # out of step: pushes into the next slot
    tokens = torch.randint(0, g.vocab_size, (Q, 1), generator=gen).to(device)
    h = spec.forward(list(range(Q)), tokens, run=planned)
    assert h.isnan().all(), rank  # every boundary after the first waits in vain
    with pytest.raises(ExchangeTimeout, match=f"rank {rank}: rank {1 - rank}'s values never"):
        decode.compute_logits(h)


def test_stock_step_across_processes_equals_one_process():
    spawn_gloo(check_stock, WORLD, "cpu")


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton on CPU needs TRITON_INTERPRET=1"
)
def test_fused_boundaries_all_reduce_partial_outputs():
    g, max_tokens = _geometry((0,)), Q * Q
    # The boundaries' BF16 rows and the logits' FP32 vocab shards, each rank's mailbox.
    # The boundaries' and the draft's BF16 rows, the logits' FP32 vocab shards: each
    # mailbox's buffers (one a rank), as many as the decodes ask for.
    widths = {torch.int16: (g.hidden_size, 2), torch.int32: (g.vocab_size // WORLD, 1)}
    buffers = {
        dtype: [[torch.full(Mailbox.shape(WORLD, width, max_tokens), SENTINELS[dtype],
                            dtype=dtype).share_memory_() for _ in range(WORLD)]
                for _ in range(n)]
        for dtype, (width, n) in widths.items()
    }  # fmt: skip
    spawn_gloo(_check_fused_on_cpu, WORLD, buffers)


def test_a_process_holds_its_own_rank():
    """A group the geometry does not fit is one error naming each problem."""

    class Group:  # stands in for a 3-process group in which this process is rank 1
        pass

    g = _geometry((0,))
    shards = [dict(random_rank(g, 0, SEED))]
    from unittest import mock

    with (
        mock.patch.object(dist, "is_initialized", return_value=True),
        mock.patch.object(dist, "get_world_size", return_value=3),
        mock.patch.object(dist, "get_rank", return_value=1),
        pytest.raises(ValueError) as e,
    ):
        ReferenceModel(g, shards, group=Group(), **KW)
    assert "a group of 3 processes for tp_size=2" in str(e.value)
    assert "ranks=(0,) in the process of group rank 1" in str(e.value)
