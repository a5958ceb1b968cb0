"""The reference backbone on a GPU: the same numbers as on CPU, and a CUDA-graph replay of
a decode step equal to the eager step (what the benchmark times)."""

import pytest
import torch
from conftest import relative

from glm5_runtime.reference import ReferenceModel, geometry, random_state_dict

pytestmark = pytest.mark.gpu


def pair(dtype):
    g = geometry("tiny")
    sd = random_state_dict(g, seed=9)
    kw = dict(max_requests=4, max_context=96, q=4, block_size=16, dtype=dtype)
    return (
        ReferenceModel.from_state_dict(g, sd, device="cpu", **kw),
        ReferenceModel.from_state_dict(g, sd, device="cuda", **kw),
    )


def test_cuda_matches_cpu_through_prefill_decode_and_verify():
    torch.backends.cuda.matmul.allow_tf32 = False
    cpu, gpu = pair(torch.float32)
    ids = torch.randint(0, 512, (2, 29), generator=torch.Generator().manual_seed(0))
    errors = []
    for model in (cpu, gpu):
        model.add(), model.add()
    h_cpu = cpu.forward([0, 1], ids)
    h_gpu = gpu.forward([0, 1], ids.cuda())
    errors.append(relative(h_gpu.cpu(), h_cpu))
    for t in range(3):
        step = ids[:, t : t + 1]
        errors.append(relative(gpu.forward([0, 1], step.cuda()).cpu(), cpu.forward([0, 1], step)))
    block = ids[:, :4]
    errors.append(
        relative(
            gpu.forward([0, 1], block.cuda(), verify=True).cpu(),
            cpu.forward([0, 1], block, verify=True),
        )
    )
    assert max(errors) < 1e-4, errors


def test_graph_replay_equals_the_eager_step():
    _, gpu = pair(torch.bfloat16)
    r = [gpu.add(), gpu.add()]
    gpu.forward(r, torch.randint(0, 512, (2, 21), device="cuda"))
    tokens = torch.randint(0, 512, (2, 1), device="cuda")
    step = gpu.step(r, 1)
    snapshot = [
        c.clone() for rank in gpu.ranks for c in (*rank.c.conv.values(), *rank.c.recurrent.values())
    ]

    def restore():
        caches = [
            c for rank in gpu.ranks for c in (*rank.c.conv.values(), *rank.c.recurrent.values())
        ]
        for c, s in zip(caches, snapshot, strict=True):
            c.copy_(s)

    with torch.no_grad():
        eager = gpu.logits(gpu.backbone(tokens, step)).clone()
        restore()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = gpu.logits(gpu.backbone(tokens, step))
        restore()
        out.fill_(float("nan"))
        graph.replay()
    torch.cuda.synchronize()
    assert not out.isnan().any()
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
