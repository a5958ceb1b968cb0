"""KpoolWrite (Triton, under the interpreter on CPU) against kpool_write_ref: decode and
verify steps of several requests whose tokens complete pools from members of the step and of
the ring (and complete none), rings in scattered rows, blocks scattered in packed pages (the
bytes between blocks untouched), heads off the MMA's 16. The ring equals the reference's;
the pages (but the null block 0, where the reference parks the writes of rows that complete
nothing) and the rotated FP8 queries within an FP8 code of it. Bad input is one error."""

import pytest
import torch

from glm5_kernels.dsa import (
    KpoolWrite,
    index_keys_ref,
    kpool_write_ref,
    unpack_kpool_pages_ref,
)

KP, BS = 4, 16


def _case(gen, heads, hd, requests, t, first):
    """Random caches and a step of `t` tokens a request starting at positions `first`."""
    ring = 8
    blocks = 1 + requests * 4
    tail = torch.randn(requests + 2, 2, ring, hd, generator=gen).bfloat16()
    width = BS // KP * (hd + 4)  # a block's page; vLLM packs other layers' bytes after it
    packed = torch.randint(0, 255, (blocks, width + 8), generator=gen, dtype=torch.uint8)
    pages = packed[:, :width].view(blocks, BS // KP, hd + 4)
    table = (1 + torch.randperm(blocks - 1, generator=gen)).view(requests, 4).int()
    positions = (torch.tensor(first)[:, None] + torch.arange(t)).int()
    tail_rows = torch.randperm(requests + 2, generator=gen)[:requests].int()
    k = torch.randn(requests, t, hd, generator=gen).bfloat16()
    gate = torch.randn(requests, t, hd, generator=gen).bfloat16()
    q = torch.randn(requests, t, heads, hd, generator=gen).bfloat16()
    ape = (torch.randn(KP, hd, generator=gen) * 0.5).bfloat16()
    return k, gate, q, tail, pages, ape, table, positions, tail_rows


@pytest.mark.parametrize(
    "heads, hd, t, first",
    [(8, 16, 1, [3, 7, 10, 40]), (20, 32, 3, [1, 6, 13, 45]), (8, 16, 3, [0, 2, 4, 9])],
    ids=["decode", "verify", "verify-early"],
)
@pytest.mark.parametrize("padding", [False, True], ids=["live", "a-padding-request"])
def test_matches_the_reference(heads, hd, t, first, padding):
    """`padding`: the second request's ring row is -1 (vLLM's padding requests): it writes
    neither its ring nor its pools (the other rings avoid the null row 0 it reads)."""
    gen = torch.Generator().manual_seed(heads + hd + t)
    k, gate, q, tail, pages, ape, table, positions, rows = _case(gen, heads, hd, 4, t, first)
    if padding:
        rows = (1 + torch.randperm(5, generator=gen)[:4]).int()
        rows[1] = -1
    untouched = tail[0].clone(), pages[table[1].long()].clone()
    done = ((positions + 1) % KP == 0).sum().item()
    assert done and done < positions.numel()  # rows that complete pools and rows that don't
    op = KpoolWrite(heads, hd, ape, kpool=KP, block_size=BS, max_rows=16)
    op.prepare()
    packed = pages.as_strided((pages.shape[0], pages.stride(0)), (pages.stride(0), 1))
    tail_ref, pages_ref, between = tail.clone(), pages.clone(), packed.clone()
    q8, qs = op(k, gate, q, tail, pages, table, positions, rows)
    assert torch.equal(packed[:, pages[0].numel() :], between[:, pages[0].numel() :])
    q8_ref, qs_ref = kpool_write_ref(k, gate, q, tail_ref, pages_ref, ape, table, positions,
                                     rows, BS)  # fmt: skip
    assert torch.equal(tail, tail_ref)  # raw copies
    if padding:  # the null ring row and the padding request's blocks as they were
        assert torch.equal(tail[0], untouched[0])
        assert torch.equal(pages[table[1].long()], untouched[1])
    # The rotation is an FP32 matmul whose sum order differs from torch's: where its BF16
    # rounding lands on the neighbour, so may an FP8 code (half an e4m3 step: 2^-4 of the
    # vector); everything else is equal.
    _close(q8.float() * qs[..., None], q8_ref.float() * qs_ref[..., None])
    assert (q8.view(torch.uint8) == q8_ref.view(torch.uint8)).float().mean() > 0.99
    _pools_close(pages, pages_ref, done)


def _pools_close(pages, pages_ref, done):
    """Pools (but the null block's) whose bytes differ are this step's, within _close."""
    got, want = (unpack_kpool_pages_ref(x[1:]) for x in (pages, pages_ref))
    codes = (got[0].view(torch.uint8) == want[0].view(torch.uint8)).all(-1)
    moved = ~(codes & (got[1] == want[1]))  # pools written on both sides whose bytes differ
    g, w = (x[0][moved].float() * x[1][moved][..., None] for x in (got, want))
    _close(g, w)
    assert moved.sum() <= done  # only this step's pools may differ (unwritten: same bytes)


@pytest.mark.parametrize("t, first", [(1, [3, 7, 10, 40]), (3, [1, 6, 13, 45])],
                         ids=["decode", "verify"])  # fmt: skip
def test_raw_sums_match_the_reference(t, first):
    """key_norm: the keys and gate scores as one projection's FP32 sums (column views of its
    [rows, hd + hd + 20] output, as the indexer's wk | gate | weights_proj projection gives
    them), normed and rounded inside the kernel, against index_keys_ref -> kpool_write_ref.
    The kernel's LayerNorm sums in another order than torch's: where the normed key's BF16
    rounding lands on the neighbour, a ring entry differs by one BF16 step (2^-8 of it)."""
    heads, hd, requests = 20, 32, 4
    gen = torch.Generator().manual_seed(t)
    _, _, q, tail, pages, ape, table, positions, rows = _case(gen, heads, hd, requests, t, first)
    sums = torch.randn(requests, t, 2 * hd + 20, generator=gen) * 3 + 0.5
    k_sums, gate_sums = sums[..., :hd], sums[..., hd : 2 * hd]
    w = torch.rand(hd, generator=gen) + 0.5  # vLLM's key norm: FP32 weight and bias
    b = torch.randn(hd, generator=gen) * 0.1
    op = KpoolWrite(heads, hd, ape, kpool=KP, block_size=BS, max_rows=16,
                    key_norm=(w, b, 1e-6))  # fmt: skip
    op.prepare()
    tail_ref, pages_ref = tail.clone(), pages.clone()
    q8, _ = op(k_sums, gate_sums, q, tail, pages, table, positions, rows)
    k, gate = index_keys_ref(k_sums, gate_sums, w, b, 1e-6)
    q8_ref, _ = kpool_write_ref(k, gate, q, tail_ref, pages_ref, ape, table, positions,
                                     rows, BS)  # fmt: skip
    assert torch.equal(q8.view(torch.uint8), q8_ref.view(torch.uint8))  # q is not RAW
    assert torch.equal(tail[:, 1], tail_ref[:, 1])  # gate scores: one rounding, exact
    step = (tail[:, 0].float() - tail_ref[:, 0].float()).abs()
    assert bool((step <= tail_ref[:, 0].float().abs() * 2**-8).all())
    assert (step == 0).float().mean() > 0.98
    _pools_close(pages, pages_ref, ((positions + 1) % KP == 0).sum().item())
    # A wrong norm is seen: the same sums through the BF16 path (no norm) differ by O(1).
    plain = KpoolWrite(heads, hd, ape, kpool=KP, block_size=BS, max_rows=16)
    tail_plain = tail_ref.clone()
    plain(k_sums.bfloat16(), gate_sums.bfloat16(), q, tail_plain, pages_ref.clone(), table,
          positions, rows)  # fmt: skip
    assert (tail_plain[:, 0].float() - tail[:, 0].float()).abs().max() > 0.5


def _close(a, b):
    err = (a - b).norm(dim=-1) / b.norm(dim=-1).clamp(min=1e-30)
    assert bool((err <= 2**-4).all()), err.max()


def test_bad_input_names_every_problem():
    gen = torch.Generator().manual_seed(1)
    k, gate, q, tail, pages, ape, table, positions, rows = _case(gen, 8, 16, 2, 1, [3, 5])
    op = KpoolWrite(8, 16, ape, kpool=KP, block_size=BS, max_rows=4)
    with pytest.raises(ValueError) as e:
        op(k.float(), gate, q[..., :8], tail[:, :, :2], pages[:, :2], table, positions, rows)
    for name in ("k:", "q:", "tail:", "pages:"):
        assert name in str(e.value), e.value
    with pytest.raises(ValueError, match="ape"):
        KpoolWrite(8, 16, ape[:2], kpool=KP, block_size=BS)
    raw = KpoolWrite(8, 16, ape, kpool=KP, block_size=BS, max_rows=4,
                     key_norm=(torch.ones(16), torch.zeros(16), 1e-6))  # fmt: skip
    with pytest.raises(ValueError, match="float32"):  # built for FP32 sums: BF16 refused
        raw(k, gate, q, tail, pages, table, positions, rows)
    with pytest.raises(ValueError) as e:
        KpoolWrite(8, 16, ape, kpool=KP, block_size=BS,
                   key_norm=(torch.ones(8), torch.zeros(16), 0))  # fmt: skip
    assert "key_norm weight" in str(e.value) and "eps=0" in str(e.value), e.value
