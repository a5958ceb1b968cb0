"""glm5-kernels' indexer pool write (`KpoolWrite`) and selection layout against vLLM 0.33's
own kernels for the same step: the query rotation + FP8 cast (`fwht128_quant_fp8`), the
decode / verify pool write (`kpool_decode_update_and_maybe_write_cache_batched`: the tail
ring stash, each completed pool's gated softmax, Hadamard rotation and FP8 cast into the
paged pool cache) and the selected pools' token list (`expand_pools_and_append_tail`). Both
run under the Triton interpreter on CPU. vLLM's CPU platform turns its Triton off
(placeholder kernels), so its kernel module is loaded here once more against the real
Triton.

The interpreter's own FP32 -> e4m3 cast rounds ties up and drops the carry of a mantissa
that rounds over into the next binade (31.9 -> 16), and its FP32 -> BF16 cast is not the
GPU's round-to-nearest-even either. Our kernel rounds before its casts for that reason;
vLLM's does not, so here the interpreter's two casts are torch's (round to nearest even, as
the GPU's cvt.rn) while vLLM's kernels run.

What must agree: the ring (raw BF16 copies, exact), where each pool lands (vLLM's
pool-granular slot vs the block table and position), the power-of-two scales (exact) and the
FP8 codes — all but a few: vLLM's FWHT butterflies and our MMA sum in different orders
before the BF16 rounding, so a value at a BF16 rounding boundary may land one code over.
Slots no pool completes stay untouched."""

from __future__ import annotations

import importlib.util
import sys
import types

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.vllm

HD, KP, BS, RING, HEADS = 128, 16, 64, 32, 32
S = BS // KP  # pools a page


@pytest.fixture(scope="module")
def vllm_kpool(monkeypatch_module):
    """vllm.models.glm5next.nvidia.ops.kpool_compress, its kernels real Triton JIT
    functions (run by the interpreter: TRITON_INTERPRET=1, as the session sets), with the
    interpreter's FP32 -> e4m3 / BF16 casts rounding as the GPU's."""
    import triton
    import triton.language as tl
    import triton.runtime.interpreter as interpreter
    import vllm.triton_utils as placeholder

    convert = interpreter._convert_float

    narrow = {tl.float8e4nv: (torch.float8_e4m3fn, torch.uint8),
              tl.bfloat16: (torch.bfloat16, torch.int16)}  # fmt: skip

    def rounded(values, src, dst, mode):
        if src == tl.float32 and dst in narrow:
            to, bits = narrow[dst]
            x = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
            return x.to(to).view(bits).numpy().view(f"uint{bits.itemsize * 8}").reshape(
                values.shape)  # fmt: skip
        return convert(values, src, dst, mode)

    monkeypatch_module.setattr(interpreter, "_convert_float", rounded)

    real = types.ModuleType("vllm.triton_utils")
    real.__dict__.update(placeholder.__dict__)
    real.triton, real.tl, real.HAS_TRITON = triton, tl, True
    name = "vllm.models.glm5next.nvidia.ops.kpool_compress"
    spec = importlib.util.find_spec(name)
    module = importlib.util.module_from_spec(spec)
    sys.modules["vllm.triton_utils"] = real
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules["vllm.triton_utils"] = placeholder
    return module


def _step_within_one_code(got8, got_scale, want8, want_scale):
    """FP8 vectors [..., HD] with scales [...]: scales equal, every value within one e4m3
    step of the other (2^-3 relative in the normal range, 2^-9 absolute below it), and all
    but ~1 % of the codes equal."""
    assert torch.equal(got_scale, want_scale)
    a, b = got8.float(), want8.float()
    step = torch.maximum(b.abs() * 2**-3, torch.full_like(b, 2**-9))
    assert ((a - b).abs() <= step).all()
    assert (got8.view(torch.uint8) == want8.view(torch.uint8)).float().mean() > 0.99


def test_query_rotation_matches_vllms(vllm_kpool):
    from glm5_kernels.dsa import KpoolWrite

    gen = torch.Generator().manual_seed(1)
    r, t = 3, 2
    q = torch.randn(r, t, HEADS, HD, generator=gen).bfloat16()
    q[0, 0, 0] *= 1e-3  # a small head: its scale well below the others
    want8, want_scale = vllm_kpool.fwht128_quant_fp8(q.reshape(-1, HD).contiguous())
    op = KpoolWrite(HEADS, HD, torch.zeros(KP, HD).bfloat16(), kpool=KP, block_size=BS)
    keys = torch.randn(r, t, HD, generator=gen).bfloat16()
    tail = torch.zeros(r, 2, RING, HD).bfloat16()
    pages = torch.zeros(1 + r, S, HD + 4, dtype=torch.uint8)
    table = (1 + torch.arange(r)).view(r, 1).int()
    positions = torch.tensor([[1, 2], [5, 6], [9, 10]]).int()  # complete no pool
    q8, q_scale = op(keys, keys, q, tail, pages, table, positions, torch.arange(r).int())
    _step_within_one_code(q8.reshape(-1, HD), q_scale.reshape(-1), want8,
                          want_scale.reshape(-1))  # fmt: skip


@pytest.mark.parametrize("t", [1, 3], ids=["decode", "verify"])
def test_pool_write_matches_vllms(vllm_kpool, t):
    """Two requests' steps of `t` tokens, each completing a pool: one from the ring and the
    step (verify), one from the ring alone (decode); rings and pages in scattered rows."""
    from glm5_kernels.dsa import KpoolWrite, unpack_kpool_pages_ref

    gen = torch.Generator().manual_seed(2 + t)
    r, blocks = 2, 6
    last = torch.tensor([2 * KP + KP - 1, BS + 3 * KP + KP - 1])  # each request's last token
    positions = (last[:, None] - t + 1 + torch.arange(t)).int()
    table = torch.tensor([[4, 1, 5], [2, 3, 0]]).int()  # blocks of BS tokens, scattered
    tail_rows = torch.tensor([3, 0]).int()
    tail = torch.randn(5, 2, RING, HD, generator=gen).bfloat16()
    pages = torch.zeros(blocks, S, HD + 4, dtype=torch.uint8)
    keys = torch.randn(r, t, HD, generator=gen).bfloat16()
    gate = torch.randn(r, t, HD, generator=gen).bfloat16()
    q = torch.randn(r, t, HEADS, HD, generator=gen).bfloat16()
    ape = (torch.randn(KP, HD, generator=gen) * 0.5).bfloat16()

    # vLLM's placement: a pool-granular cache slot on the token that completes a pool (-1
    # elsewhere), a token-granular ring slot (the request's tail block x ring + pos % ring).
    done = (positions + 1) % KP == 0
    block = table.gather(1, (positions // BS).long())
    slot = torch.where(done, block * S + (positions % BS) // KP, -1).int()
    tail_slot = (tail_rows[:, None] * RING + positions % RING).int()
    tail_v, pages_v = tail.clone(), pages.clone()
    vllm_kpool.kpool_decode_update_and_maybe_write_cache_batched(
        pages_v, tail_v, tail_slot, keys, gate, ape.float(), slot, positions, KP, HD,
        round_scale=True,
    )  # fmt: skip
    op = KpoolWrite(HEADS, HD, ape, kpool=KP, block_size=BS, max_rows=8)
    op(keys, gate, q, tail, pages, table, positions, tail_rows)

    assert torch.equal(tail, tail_v)
    written = torch.zeros(blocks, S, dtype=torch.bool)
    written.view(-1)[slot[done].long()] = True
    assert int(written.sum()) == r  # one pool a request
    # A page: S FP8 keys, then S FP32 scales (vLLM's layout; the [S, HD + 4] shape is only
    # the page's size).
    (keys, scales), (keys_v, scales_v) = (unpack_kpool_pages_ref(x) for x in (pages, pages_v))
    for k8, sc in ((keys, scales), (keys_v, scales_v)):  # nothing else written
        assert (k8[~written].view(torch.uint8) == 0).all() and (sc[~written] == 0).all()
    _step_within_one_code(keys[written], scales[written], keys_v[written], scales_v[written])


def test_selection_layout_matches_vllms(vllm_kpool):
    """The selection's token list as vLLM lays it out (`expand_pools_and_append_tail`: each
    selected pool's kpool tokens, -1 for a pool id of -1, then the always-selected tail from
    the incomplete pool's first token to the position): equal to `select_tokens_ref`'s (the
    list `IndexerTopk` writes) for the same pools in pool order, at every tail length and
    for a context with fewer visible pools than top-k."""
    from glm5_kernels.dsa import select_tokens_ref

    gen = torch.Generator().manual_seed(4)
    topk, pools = 8 * KP, 40
    # Tails of 1..15 tokens and none; a context of 3 visible pools.
    positions = torch.tensor([KP * 20 + t for t in range(KP)] + [3 * KP + 5])
    scores = torch.randn(len(positions), pools, generator=gen)
    want = select_tokens_ref(scores, positions, topk, KP, True, topk + KP - 1)
    # The pools the reference chose, in pool order (-1: a pick beyond the visible pools).
    pool_ids = torch.where(want[:, :topk:KP] >= 0, want[:, :topk:KP] // KP, -1).int()
    got = vllm_kpool.expand_pools_and_append_tail(pool_ids, (positions + 1).int(), KP)
    assert torch.equal(got.long(), want)
    assert (want[-1, : 3 * KP] >= 0).all() and (want[-1, 3 * KP : topk] == -1).all()
