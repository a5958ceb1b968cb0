"""The MLA input norms and latent write on the GPU at GLM-5.3-Flash's widths (q_a 1536,
kv_a 512 of the fused q_a | kv_a output, 2112 wide): decode and verify steps of 1..64 rows
into scattered slots of a NaN-poisoned latent cache, against `latent_write_ref` (bounds:
test_dsa_latent.py's); a captured call replays like the eager one."""

import pytest
import torch
from test_dsa_latent import assert_bf16_close

from glm5_kernels.dsa import LatentWrite, latent_write_ref

pytestmark = pytest.mark.gpu

Q, L = 1536, 512


def _case(n, seed):
    gen = torch.Generator("cuda").manual_seed(seed)
    x = torch.randn(n, Q + L, generator=gen, device="cuda").bfloat16() * 3
    norms = [(1 + 0.1 * torch.randn(d, generator=gen, device="cuda")).bfloat16() for d in (Q, L)]
    slots = torch.randperm(8 * n, generator=gen, device="cuda")[:n]
    return x, norms, slots


@pytest.mark.parametrize("n", [1, 3, 8, 17, 64])
def test_matches_the_reference(n):
    x, (qn, kvn), slots = _case(n, n)
    latent = torch.full((8 * n, L), float("nan"), device="cuda").bfloat16()
    want_latent = latent.clone()
    want = latent_write_ref(x[:, :Q], x[:, Q:], qn, kvn, 1e-5, want_latent, slots)
    op = LatentWrite(qn, kvn, 1e-5)
    op.prepare()
    got = op(x[:, :Q], x[:, Q:], latent, slots)
    assert not got.isnan().any()
    assert_bf16_close(got, want)
    assert_bf16_close(latent[slots], want_latent[slots])
    assert latent.isnan().any(-1).sum().item() == 8 * n - n  # only the rows' slots written


def test_a_captured_call_replays_like_eager():
    x, (qn, kvn), slots = _case(8, 0)
    op = LatentWrite(qn, kvn, 1e-5)
    op.prepare()
    latent = torch.zeros(64, L, device="cuda").bfloat16()
    eager = op(x[:, :Q], x[:, Q:], latent, slots).clone()
    written = latent.clone()
    latent.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op(x[:, :Q], x[:, Q:], latent, slots)
    latent.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager) and torch.equal(latent, written)
