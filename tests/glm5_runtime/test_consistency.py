"""Decode, verify and MTP rollback against prefill: one model, different step shapes."""

import torch
from conftest import relative

from glm5_runtime.reference import ReferenceModel, geometry

TOL = 1e-5  # FP32: the same math batched differently


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
    g = geometry("tiny")
    model = ReferenceModel.random(
        g, seed=4, max_requests=4, max_context=96, q=4, block_size=16, dtype=torch.float32
    )
    prompt, draft = tokens(18, 2), tokens(4, 3)
    a, b = model.add(), model.add()
    model.forward([a, b], torch.cat([prompt, prompt]))
    verified = model.forward([a], draft, verify=True)
    singles = torch.cat([model.forward([b], draft[:, i : i + 1]) for i in range(4)], dim=1)
    assert relative(verified, singles) < TOL


def test_accepting_n_of_q_restores_kda_state_exactly_and_continues_like_n_decodes():
    g = geometry("tiny")
    model = ReferenceModel.random(
        g, seed=5, max_requests=4, max_context=96, q=4, block_size=16, dtype=torch.float32
    )
    prompt, draft, after = tokens(15, 4), tokens(4, 5), tokens(1, 6)
    a, b = model.add(), model.add()
    model.forward([a, b], torch.cat([prompt, prompt]))
    model.forward([a], draft, verify=True)
    # The state after drafted token 2, as the verify stored it.
    kept = model.state_slots[a, 1]
    snapshot = [
        (rank.c.recurrent[layer][kept].clone(), rank.c.conv[layer][kept].clone())
        for rank in model.ranks
        for layer in rank.c.recurrent
    ]
    model.accept(a, 2)  # reject the last two drafted tokens
    read = model.step([a], 1).read_slots
    assert read.tolist() == [kept.item()]
    restored = [
        (rank.c.recurrent[layer][kept], rank.c.conv[layer][kept])
        for rank in model.ranks
        for layer in rank.c.recurrent
    ]
    for (rec, conv), (rec0, conv0) in zip(restored, snapshot, strict=True):
        assert torch.equal(rec, rec0) and torch.equal(conv, conv0)
    for i in range(2):
        model.forward([b], draft[:, i : i + 1])
    assert model.lengths[a] == model.lengths[b] == 17
    slot_b = model.state_slots[b, model.current[b]]
    for rank in model.ranks:
        for _layer, rec in rank.c.recurrent.items():
            torch.testing.assert_close(rec[kept], rec[slot_b], rtol=1e-5, atol=1e-5)
    assert relative(model.forward([a], after), model.forward([b], after)) < TOL


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
