"""The indexer's pool write on the GPU at GLM-5.3-Flash's shapes: 32 heads of 128, pools of
16 tokens in blocks of 64, rings of 32 (16 + drafts), decode and verify steps of up to 64
rows whose tokens complete pools from the step's rows and from the ring; against
`kpool_write_ref`, and a captured call replays like the eager one.

The ring holds raw copies (exact). The pool keys and the queries pass a Hadamard matmul in
FP32 and, for the pools, a softmax whose exp differs from torch's in the last bits; the BF16
rounding after them may then land on a neighbour, and the FP8 code after that: each
dequantized vector within 2^-4 of the reference's (half an e4m3 step), the scales equal on
all but a few rows (a power of two moves only where the amax sits on the boundary).
`sums`: the keys and gate scores as the indexer's one FP32 projection gives them (columns of
[rows, 2 * 128 + 32]), normed and rounded inside the write against `index_keys_ref`: the
gate half of the ring exact, a key element a BF16 step off where the LayerNorm's sum order
moved its rounding."""

import pytest
import torch

from glm5_kernels.dsa import KpoolWrite, index_keys_ref, kpool_write_ref, unpack_kpool_pages_ref

pytestmark = pytest.mark.gpu

H, HD, KP, BS, RING = 32, 128, 16, 64, 32


def _case(requests, t, seed):
    gen = torch.Generator("cuda").manual_seed(seed)
    per = 2048 // BS
    blocks = 1 + requests * per
    tail = torch.randn(requests + 1, 2, RING, HD, generator=gen, device="cuda").bfloat16()
    pages = torch.zeros(blocks, BS // KP, HD + 4, dtype=torch.uint8, device="cuda")
    table = 1 + torch.randperm(blocks - 1, generator=gen, device="cuda").view(requests, per)
    first = torch.randint(0, 2048 - t, (requests,), generator=gen, device="cuda")
    first[: requests // 2] = KP - 1 - torch.arange(requests // 2, device="cuda") % t  # complete
    positions = (first[:, None] + torch.arange(t, device="cuda")).int()
    tail_rows = torch.randperm(requests + 1, generator=gen, device="cuda")[:requests].int()
    k = torch.randn(requests, t, HD, generator=gen, device="cuda").bfloat16()
    gate = torch.randn(requests, t, HD, generator=gen, device="cuda").bfloat16()
    q = torch.randn(requests, t, H, HD, generator=gen, device="cuda").bfloat16()
    ape = (torch.randn(KP, HD, generator=gen, device="cuda") * 0.5).bfloat16()
    return k, gate, q, tail, pages, ape, table.int(), positions, tail_rows


def _close(a, b):
    """Per vector: relative L2 within 2^-4."""
    err = (a - b).norm(dim=-1) / b.norm(dim=-1).clamp(min=1e-30)
    assert bool((err <= 2**-4).all()), err.max()


@pytest.mark.parametrize("sums", [False, True], ids=["keys", "sums"])
@pytest.mark.parametrize("requests, t", [(1, 1), (8, 1), (64, 1), (2, 4), (16, 4)])
def test_matches_the_reference(requests, t, sums):
    k, gate, q, tail, pages, ape, table, positions, rows = _case(requests, t, requests * t)
    norm = None
    if sums:  # the projection's FP32 sums, vLLM's FP32 key norm
        gen = torch.Generator("cuda").manual_seed(t)
        out = torch.randn(requests, t, 2 * HD + 32, generator=gen, device="cuda") * 3 + 0.5
        k, gate = out[..., :HD], out[..., HD : 2 * HD]
        norm = (torch.rand(HD, generator=gen, device="cuda") + 0.5,
                torch.randn(HD, generator=gen, device="cuda") * 0.1, 1e-6)  # fmt: skip
    op = KpoolWrite(H, HD, ape, kpool=KP, block_size=BS, max_rows=64, key_norm=norm)
    op.prepare()
    tail_ref, pages_ref, tail0, pages0 = tail.clone(), pages.clone(), tail.clone(), pages.clone()
    q8, qs = op(k, gate, q, tail, pages, table, positions, rows)
    keys = index_keys_ref(k, gate, *norm) if sums else (k, gate)
    q8_ref, qs_ref = kpool_write_ref(*keys, q, tail_ref, pages_ref, ape, table, positions,
                                     rows, BS)  # fmt: skip
    if sums:
        assert torch.equal(tail[:, 1], tail_ref[:, 1])
        step = (tail[:, 0].float() - tail_ref[:, 0].float()).abs()
        assert bool((step <= tail_ref[:, 0].float().abs() * 2**-8).all())
        assert (step == 0).float().mean() > 0.98
    else:
        assert torch.equal(tail, tail_ref)
    _close(q8.float() * qs[..., None], q8_ref.float() * qs_ref[..., None])
    assert (qs != qs_ref).float().mean() <= 0.01
    got, want = (unpack_kpool_pages_ref(x[1:]) for x in (pages, pages_ref))
    _close(got[0].float() * got[1][..., None], want[0].float() * want[1][..., None])
    # A captured call replays like the eager one (from the same caches).
    eager = (tail.clone(), pages.clone(), q8.clone())
    tail.copy_(tail0)
    pages.copy_(pages0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op(k, gate, q, tail, pages, table, positions, rows)
    tail.copy_(tail0)
    pages.copy_(pages0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(tail, eager[0]) and torch.equal(pages, eager[1])
    assert torch.equal(out[0].view(torch.uint8), eager[2].view(torch.uint8))
