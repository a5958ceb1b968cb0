"""glm5-kernels' `kda_decode_ref` (a KDA layer's decode / verify step from its projections'
outputs, caches in place: the fused KDA stage's spec) between the projections and o_proj is
the reference backbone's KDA layer bit for bit (the layer runs it; transformers checks the
layer, test_oracle.py): output and every cache it writes, for decodes, verifies with partial
acceptance and requests in arbitrary state slots."""

import torch

from glm5_kernels.kda import kda_decode_ref
from glm5_runtime.reference import ReferenceModel, geometry


def _kda_via_ref(rank, g, layer, x, step):
    a = f"layers.{layer}.self_attn"
    lin = rank.linear
    qkv = torch.cat([lin(x, f"{a}.{p}_proj.weight") for p in "qkv"], dim=-1)
    f = lin(lin(x, f"{a}.forget_gate.f_a_proj.weight"), f"{a}.forget_gate.f_b_proj.weight")
    gate = lin(lin(x, f"{a}.g_a_proj.weight"), f"{a}.g_b_proj.weight")
    out = kda_decode_ref(
        qkv, f, lin(x, f"{a}.b_proj.weight"), gate, rank.c.conv[layer], rank.c.recurrent[layer],
        rank.w[f"{a}.conv1d.weight"][:, 0], rank.w[f"{a}.forget_gate.dt_bias"],
        rank.w[f"{a}.forget_gate.A_log"], rank.w[f"{a}.o_norm.weight"],
        conv_slots=step.conv_slots, conv_offset=step.conv_offset, read_slots=step.read_slots,
        write_slots=step.write_slots, keep=step.keep_states and x.shape[1] > 1,
        lower_bound=g.linear_lower_bound, eps=g.rms_norm_eps,
    )  # fmt: skip
    return lin(out, f"{a}.o_proj.weight")


def test_kda_decode_ref_equals_the_reference_layer():
    g = geometry("tiny")
    model = ReferenceModel.random(g, seed=3, max_requests=4, max_context=64, block_size=16, q=3,
                                  dtype=torch.bfloat16)  # fmt: skip
    rank, layer = model.ranks[0], g.kda_layers[0]
    gen = torch.Generator().manual_seed(0)
    requests = [model.add() for _ in range(4)][1:]  # slots 1..3: not the first rows
    model.forward(requests, torch.randint(0, g.vocab_size, (3, 7), generator=gen))
    for i, (tokens, verify) in enumerate([(1, False), (3, True), (1, False), (3, True)]):
        step = model.step(requests, tokens, verify=verify)
        x = torch.randn(3, tokens, g.hidden_size, generator=gen).bfloat16()
        saved = (rank.c.conv[layer].clone(), rank.c.recurrent[layer].clone())
        want = rank.kda(layer, x, step)
        wrote = (rank.c.conv[layer].clone(), rank.c.recurrent[layer].clone())
        rank.c.conv[layer].copy_(saved[0])
        rank.c.recurrent[layer].copy_(saved[1])
        got = _kda_via_ref(rank, g, layer, x, step)
        assert torch.equal(got, want), i
        assert torch.equal(rank.c.conv[layer], wrote[0]), i
        assert torch.equal(rank.c.recurrent[layer], wrote[1]), i
        # Move the model on with a real step of the same shape, then accept part of a verify.
        model.forward(requests, torch.randint(0, g.vocab_size, (3, tokens), generator=gen),
                      verify=verify)  # fmt: skip
        if verify:
            for r, n in zip(requests, (1, 2, 3), strict=True):
                model.accept(r, n)
