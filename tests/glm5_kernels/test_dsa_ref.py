"""DSA indexer references: Hadamard + FP8 keys/queries, k-pool pages, pool logits, and the
pool compression against transformers' Glm5NextTextIndexer.

Tolerances, derived from the roundings: the rotated vector r = x H (H orthonormal) is rounded
to BF16 (2^-9 of each element, FP32 matmul error aside) and then to e4m3 at a power-of-two
scale (normal codes: 2^-4 of the element; subnormals: half a 2^-9 step, times the scale), so
each dequantized element is within e = (2^-9 + 2^-4 (1 + 2^-9)) |r| + 2^-10 scale (+ FP32
slack) of r -- checked per element, so a lost scale or a one-sided rotation fails there. The
pool logits are then checked on those codes: exact but for their FP32 sums (gamma_n bounds:
(128 + heads + 4) 2^-24 of the absolute terms' mass), and since H is orthonormal, r_q . r_k
is the BF16 vectors' own dot product: nothing between the codes and the exact logits is left
unchecked."""

import pytest
import torch

from glm5_kernels.dsa import (
    index_logits_fp8_ref,
    kpool_compress_ref,
    pack_kpool_pages_ref,
    rotate_quant_fp8_ref,
    unpack_kpool_pages_ref,
)
from glm5_kernels.dsa.reference import _hadamard

SHAPES = [(1,), (3, 7), (64, 32), (5, 17)]  # (tokens,), (tokens, heads): off-grid and real


def test_hadamard_is_orthonormal_and_symmetric():
    h = _hadamard(128, "cpu").double()
    torch.testing.assert_close(
        h @ h, torch.eye(128, dtype=torch.float64), rtol=0, atol=1e-6
    )  # FP32 entries
    assert torch.equal(h, h.T)


@pytest.mark.parametrize("lead", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("magnitude", [1e-3, 1.0, 300.0])
def test_rotate_quant_round_trips_within_the_fp8_bound(lead, magnitude):
    x = (torch.randn(*lead, 128) * magnitude).to(torch.bfloat16)
    q, scale = rotate_quant_fp8_ref(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and scale.shape == lead
    mantissa, _ = torch.frexp(scale)
    assert torch.all(mantissa == 0.5)  # powers of two
    assert q.float().abs().max() <= 448 and not q.float().isnan().any()
    # In the rotated domain: FP8 error <= amax/14 (see above) plus BF16's 2^-9 of the
    # rotation's own rounding, elementwise.
    y = x.double() @ _hadamard(128, "cpu").double()
    err = (q.double() * scale[..., None].double() - y).abs().amax(-1)
    amax = y.abs().amax(-1)
    assert torch.all(err <= amax * (1 / 14 + 2**-8))


def test_pages_round_trip_exactly_with_keys_before_scales():
    q = (torch.randn(6, 4, 128) * 100).to(torch.float8_e4m3fn)
    scale = torch.rand(6, 4) + 0.5
    pages = pack_kpool_pages_ref(q, scale)
    assert pages.shape == (6, 4, 132) and pages.dtype == torch.uint8
    row = pages.reshape(6, -1)
    assert torch.equal(row[:, : 4 * 128], q.view(torch.uint8).reshape(6, -1))
    assert torch.equal(row[:, 4 * 128 :].contiguous().view(torch.float32), scale)
    q2, s2 = unpack_kpool_pages_ref(pages)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s2, scale)


@pytest.mark.parametrize("tokens, heads, pools", [(1, 32, 128), (3, 4, 7), (9, 32, 300)])
def test_fp8_logits_match_the_exact_logits(tokens, heads, pools):
    qb = torch.randn(tokens, heads, 128).to(torch.bfloat16)
    kb = torch.randn(pools, 128).to(torch.bfloat16)
    w = torch.randn(tokens, heads)
    q, qs = rotate_quant_fp8_ref(qb)
    k, ks = rotate_quant_fp8_ref(kb)
    got = index_logits_fp8_ref(q, qs, w, k.expand(tokens, -1, -1), ks.expand(tokens, -1))
    assert got.shape == (tokens, pools)
    h = _hadamard(128, "cpu").double()
    deq = []
    for code, scale, x in ((q, qs, qb), (k, ks, kb)):  # the codes: r to e4m3's rounding
        r = x.double() @ h  # the exact rotation
        e = (2**-9 + 2**-4 * (1 + 2**-9)) * r.abs() + 2**-10 * scale.double()[..., None]
        e = e + 2**-20 * r.norm(dim=-1, keepdim=True)  # the FP32 rotation's rounding
        deq.append(code.double() * scale.double()[..., None])
        assert bool(((deq[-1] - r).abs() <= e).all())
    # The logits: exact on those codes but for FP32 sums (gamma_n bounds of the head dot
    # products over 128 dims and of the heads' sum).
    c = w.double() * 128**-0.5 * heads**-0.5
    on_codes = torch.einsum("th,thp->tp", c, torch.relu(torch.einsum("thd,pd->thp", *deq)))
    terms = torch.einsum("thd,pd->thp", *(x.abs() for x in deq))
    bound = (128 + heads + 4) * 2**-24 * torch.einsum("th,thp->tp", c.abs(), terms) + 1e-30
    assert bool(((got.double() - on_codes).abs() <= bound).all())


def test_pool_compression_matches_transformers_indexer():
    transformers = pytest.importorskip("transformers")
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextIndexer

    cfg = transformers.Glm5NextTextConfig(
        hidden_size=64,
        index_head_dim=128,
        index_kpool=16,
        index_topk=32,
        q_lora_rank=32,
        num_hidden_layers=1,
        pad_token_id=None,
    )
    indexer = Glm5NextTextIndexer(cfg, 0)
    with torch.no_grad():
        indexer.index_kpool_compress_ape.normal_(0, 0.5)
    keys = torch.randn(2, 48, 128)
    gates = torch.randn(2, 48, 128)
    packed = torch.cat([keys, gates, torch.ones(2, 48, 1)], -1)
    want, indices, valid = indexer.get_pooled_states(packed)
    got = kpool_compress_ref(
        keys.view(2, 3, 16, 128), gates.view(2, 3, 16, 128), indexer.index_kpool_compress_ape
    )
    assert valid.all() and indices.shape == (2, 3, 16)
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-5)
