"""Decode, verify and MTP rollback against prefill: one model, different step shapes."""

import torch
from conftest import dense_geometry, relative

from glm5_kernels.quant import dequantize_fp8_block_ref
from glm5_runtime.reference import ReferenceModel, geometry

TOL = 1e-5  # FP32: the same math batched differently


def tiny(seed, max_requests=4, max_context=96, q=1):
    """The tiny geometry in FP32, where the same math batched differently agrees to ~1e-6."""
    return ReferenceModel.random(
        geometry("tiny"),
        seed,
        max_requests=max_requests,
        max_context=max_context,
        q=q,
        block_size=16,
        dtype=torch.float32,
    )


def tokens(n, seed, vocab=512):
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def test_prefill_last_position_equals_token_by_token_decode(tiny_fp32):
    model = tiny_fp32
    prompt = tokens(23, 1)
    whole = model.forward([model.add()], prompt)
    r = model.add()
    for i in range(23):
        last = model.forward([r], prompt[:, i : i + 1])
    assert relative(last[:, -1], whole[:, -1]) < TOL
    assert relative(model.forward([r], prompt[:, :1]), model.forward([0], prompt[:, :1])) < TOL


def test_verify_of_q_tokens_equals_q_single_decodes():
    model = tiny(seed=4, max_requests=4, max_context=96, q=4)
    prompt, draft = tokens(18, 2), tokens(4, 3)
    a, b = model.add(), model.add()
    model.forward([a, b], torch.cat([prompt, prompt]))
    verified = model.forward([a], draft, verify=True)
    singles = torch.cat([model.forward([b], draft[:, i : i + 1]) for i in range(4)], dim=1)
    assert relative(verified, singles) < TOL


def conv_window(model, r):
    """Each KDA layer's conv window [W-1, C] that request r's next step reads."""
    step = model.step([r], 1)
    width = model.g.linear_conv_kernel_dim
    cols = step.conv_offset[0] + torch.arange(width - 1)
    return [
        rank.c.conv[layer][step.conv_slots[0], cols]
        for rank in model.ranks
        for layer in rank.c.conv
    ]


def test_accepting_n_of_q_restores_kda_state_exactly_and_continues_like_n_decodes():
    model = tiny(seed=5, max_requests=4, max_context=96, q=4)
    prompt, draft, after = tokens(15, 4), tokens(4, 5), tokens(1, 6)
    a, b = model.add(), model.add()
    model.forward([a, b], torch.cat([prompt, prompt]))
    step = model.step([a], 4, verify=True)
    model.forward([a], draft, verify=True, step=step)
    # What the verify stored after drafted token 2: its recurrent state and conv inputs.
    kept = model.state_slots[a, 1]
    recurrent = [
        rank.c.recurrent[layer][kept].clone() for rank in model.ranks for layer in rank.c.recurrent
    ]
    model.accept(a, 2)  # reject the last two drafted tokens
    assert model.step([a], 1).read_slots.tolist() == [kept.item()]
    restored = [rank.c.recurrent[layer][kept] for rank in model.ranks for layer in rank.c.recurrent]
    assert all(torch.equal(x, y) for x, y in zip(restored, recurrent, strict=True))
    for i in range(2):
        model.forward([b], draft[:, i : i + 1])
    assert model.lengths[a] == model.lengths[b] == 17
    # The conv window after accepting 2 holds the raw inputs of prompt[-1], draft[0], draft[1]:
    # the same window two single decodes leave (equal up to batched-matmul rounding).
    for wa, wb in zip(conv_window(model, a), conv_window(model, b), strict=True):
        torch.testing.assert_close(wa, wb, rtol=1e-5, atol=1e-5)
    slot_b = model.state_slots[b, model.current[b]]
    for rank in model.ranks:
        for rec in rank.c.recurrent.values():
            torch.testing.assert_close(rec[kept], rec[slot_b], rtol=1e-5, atol=1e-5)
    assert relative(model.forward([a], after), model.forward([b], after)) < TOL


def test_accept_all_then_verify_again_matches_decodes():
    """Two verify rounds with different accept counts against the same tokens decoded."""
    model = tiny(seed=8, max_requests=2, max_context=96, q=3)
    prompt, d1, d2 = tokens(10, 12), tokens(3, 13), tokens(3, 14)
    a, b = model.add(), model.add()
    model.forward([a, b], torch.cat([prompt, prompt]))
    model.forward([a], d1, verify=True)
    model.accept(a, 3)
    got = model.forward([a], d2, verify=True)
    model.accept(a, 1)
    for t in torch.cat([d1, d2[:, :1]], dim=1)[0]:
        want = model.forward([b], t.view(1, 1))
    assert relative(got[:, :1], want) < TOL
    nxt = tokens(1, 15)
    assert relative(model.forward([a], nxt), model.forward([b], nxt)) < TOL


def test_a_batch_decodes_like_its_requests_alone(tiny_fp32):
    model = tiny_fp32
    p1, p2 = tokens(9, 7), tokens(9, 8)
    a, b, c = model.add(), model.add(), model.add()
    model.forward([a, b], torch.cat([p1, p2]))
    model.forward([c], p2)
    step = torch.cat([tokens(1, 9), tokens(1, 10)])
    both = model.forward([a, b], step)
    alone = model.forward([c], step[1:])
    assert relative(both[1:], alone) < TOL


def test_tp2_simulation_equals_tp1():
    seed = 6
    one = ReferenceModel.random(
        geometry("tiny"), seed, max_requests=1, max_context=64, block_size=16, dtype=torch.float32
    )
    two = ReferenceModel.random(
        geometry("tiny", tp_size=2),
        seed,
        max_requests=1,
        max_context=64,
        block_size=16,
        dtype=torch.float32,
    )
    prompt = tokens(13, 11)
    h1, h2 = one.forward([one.add()], prompt), two.forward([two.add()], prompt)
    assert relative(h2, h1) < TOL
    assert relative(two.logits(h2), one.logits(h1)) < TOL


def test_ue8m0_scales_are_powers_of_two_and_change_little():
    # Dense MLPs only: through MoE layers any weight perturbation flips some routes.
    g = dense_geometry()
    kw = dict(max_requests=1, max_context=32, block_size=16, dtype=torch.float32)
    plain = ReferenceModel.random(g, 3, **kw)
    ue8m0 = ReferenceModel.random(g, 3, ue8m0=True, **kw)
    scales = [t for n, t in ue8m0.ranks[0].w.items() if n.endswith("_scale_inv")]
    assert scales and all(torch.all(torch.frexp(s)[0] == 0.5) for s in scales)
    prompt = tokens(9, 16)
    # Coarser scales round the FP8 weights differently: the hidden states move by no more than
    # those weights do, to first order each MLP's output by its linears' relative changes
    # (the gate's through SwiGLU at most doubled), summed over the layers the prompt passes
    # (a wrong scale or dropped weight moves them by O(1)).
    error = relative(ue8m0.forward([ue8m0.add()], prompt), plain.forward([plain.add()], prompt))
    a, b = plain.ranks[0].w, ue8m0.ranks[0].w

    def moved(name):
        x, y = (dequantize_fp8_block_ref(w[name], w[f"{name}_scale_inv"]) for w in (a, b))
        return relative(y, x)

    bound = sum(
        2 * moved(f"layers.{i}.mlp.gate_proj.weight")
        + moved(f"layers.{i}.mlp.up_proj.weight")
        + moved(f"layers.{i}.mlp.down_proj.weight")
        for i in range(g.num_hidden_layers)
    )
    assert 0 < error <= bound, (error, bound)


def test_a_single_rank_geometry_builds_its_shard_at_shard_size():
    g = geometry("tiny", tp_size=2, ranks=(1,))
    model = ReferenceModel.random(g, 0, max_requests=1, max_context=32, block_size=16)
    w = model.ranks[0].w
    assert model.ranks[0].rank == 1 and not g.full_tp
    assert w["layers.0.self_attn.q_proj.weight"].shape == (32, 64)  # half of 4 heads x 16
    assert w["layers.2.mlp.experts.gate_up_proj"].shape == (16, 256, 64)  # half of 2 x 256
    assert w["embed_tokens.weight"].shape == (256, 64)  # half the vocabulary
    h = model.forward([model.add()], tokens(5, 17))
    assert h.shape == (1, 5, 64) and torch.isfinite(h).all()


def test_a_pool_completed_by_a_rejected_draft_is_rebuilt_from_the_ring():
    # kpool 4: a verify at positions 14..17 completes pool 3 (12..15) with the drafted token
    # at 15; accepting 1 rejects it, and the real token at 15 must recompress pool 3 from the
    # ring (12..14) plus itself. Selection matters: 2 of up to 5 pools are picked.
    model = tiny(seed=9, max_requests=2, max_context=64, q=4)
    prompt, draft, real = tokens(14, 18), tokens(4, 19), tokens(6, 20)
    a, b = model.add(), model.add()
    model.forward([a, b], torch.cat([prompt, prompt]))
    model.forward([a], torch.cat([real[:, :1], draft[:, 1:]], dim=1), verify=True)
    model.accept(a, 1)
    model.forward([b], real[:, :1])
    for t in range(1, 6):
        step = real[:, t : t + 1]
        assert relative(model.forward([a], step), model.forward([b], step)) < TOL, t
