"""The MTP draft layer: its caches, the position-0 rule and index sharing across steps."""

import torch
from conftest import relative

from glm5_runtime.reference import ReferenceModel, geometry

TOL = 1e-5


def make(seed=0, **kw):
    return ReferenceModel.random(
        geometry("tiny", **kw),
        seed,
        max_requests=2,
        max_context=64,
        q=4,
        block_size=16,
        dtype=torch.float32,
    )


def sequence(n, seed):
    return torch.randint(0, 512, (1, n), generator=torch.Generator().manual_seed(seed))


def test_mtp_over_a_prompt_equals_the_mtp_token_by_token():
    model = make()
    ids = sequence(20, 1)
    a, b = model.add(), model.add()
    hidden = model.forward([a, b], torch.cat([ids, ids]))[:1]
    pairs = ids[:, 1:], hidden[:, :-1]  # (token i + 1, h_i) at target position i
    whole, _ = model.draft_hidden(*pairs, model.place([a], torch.arange(19)[None]))
    for i in range(19):
        last, _ = model.draft_hidden(
            pairs[0][:, i : i + 1], pairs[1][:, i : i + 1], model.place([b], torch.tensor([[i]]))
        )
    assert relative(last[:, -1], whole[:, -1]) < TOL


def test_the_embedding_is_ignored_at_position_0():
    model = make()
    r = model.add()
    h = torch.randn(1, 1, model.g.hidden_size)
    at = model.place([r], torch.tensor([[0]]))
    one, _ = model.draft_hidden(torch.tensor([[5]]), h, at)
    two, _ = model.draft_hidden(torch.tensor([[77]]), h, at)
    torch.testing.assert_close(one, two, rtol=0, atol=0)
    three, _ = model.draft_hidden(torch.tensor([[77]]), h, model.place([r], torch.tensor([[1]])))
    assert relative(three, one) > 1e-2


def test_drafts_are_greedy_over_recycled_hidden_states():
    model = make()
    ids = sequence(18, 2)
    r = model.add()
    hidden = model.forward([r], ids)
    drafts = model.draft([r], ids[:, 1:], hidden[:, :-1], 0, 3)
    assert drafts.shape == (1, 3)
    # Recompute by hand: step 0's last output, then each draft fed back one position later.
    other = model.add()
    model.forward([other], ids)
    h, _ = model.draft_hidden(
        ids[:, 1:], hidden[:, :-1], model.place([other], torch.arange(17)[None])
    )
    h = h[:, -1:]
    expect = [model.logits(h).argmax(-1)]
    for j in range(1, 3):
        h, _ = model.draft_hidden(expect[-1], h, model.place([other], torch.tensor([[16 + j]])))
        expect.append(model.logits(h).argmax(-1))
    assert torch.equal(drafts, torch.cat(expect, dim=1))


def test_shared_index_steps_reuse_step_0_selection_and_write_no_indexer_cache():
    model = make(index_topk=8)
    ids = sequence(33, 3)
    r = model.add()
    hidden = model.forward([r], ids)
    tail = model.ranks[0].c.tail[model.mtp_layers[0]]  # [requests + 1, 2, ring, hd]
    ring = tail.shape[2]
    # Step 0 pairs (token i + 1, h_i) at positions 0..31; steps 1..3 sit at 32..34.
    later = torch.tensor([32, 33, 34]) % ring
    model.draft([r], ids[:, 1:], hidden[:, :-1], 0, 4, share_index=True)
    shared = tail[r + 1, :, later].clone()
    step0 = tail[r + 1, :, torch.tensor([29, 30, 31]) % ring].clone()
    # Without sharing, the same steps run the indexer and stash their keys in the ring.
    model.draft([r], ids[:, 1:], hidden[:, :-1], 0, 4, share_index=False)
    assert not torch.equal(tail[r + 1, :, later], shared)
    assert torch.equal(tail[r + 1, :, torch.tensor([29, 30, 31]) % ring], step0)
