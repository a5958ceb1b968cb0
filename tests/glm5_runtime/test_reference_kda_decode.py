"""The reference backbone's KDA layer over vLLM's caches (the conv window at the accepted
offset, one recurrent slot per verified token) against transformers' Glm5NextTextLinearAttention
run without a cache over each request's whole accepted sequence: a prefill, then decodes and
verifies with partial acceptance, requests in arbitrary state slots. Every step's output rows
must be transformers' rows at the same positions, so a misplaced read or write of either
cache (a wrong slot, window offset or kept state) shows in that step or a later one.

Bound, per row (a token's output): FP32 on both sides, transformers' chunked KDA being a
different factorization of the same sums (within 3e-7 absolute of the recurrence on outputs of
size ~0.3, test_kda_ref.py: ~1e-6 relative); 2^-16 a row leaves 15x. A wrong state or window
moves a row by O(1)."""

import torch
from conftest import build_pair, dense_geometry
from decode_cases import rel_rows

BOUND = 2**-16


def test_kda_layer_over_vllm_caches_equals_transformers_over_the_sequence():
    g = dense_geometry()  # a KDA layer first, the others only move the model on
    model, oracle, _ = build_pair(g, 3, max_context=64, q=3)
    rank, layer = model.ranks[0], g.kda_layers[0]
    attn = oracle.layers[layer].self_attn
    gen = torch.Generator().manual_seed(0)
    requests = [model.add() for _ in range(4)][1:]  # slots 1..3: not the first rows
    history = [torch.empty(0, g.hidden_size) for _ in requests]  # each request's accepted x
    steps = [(7, False), (1, False), (3, True), (1, False), (3, True), (3, True), (1, False)]
    keep = iter([(1, 2, 3), (3, 1, 2), (2, 3, 1)])  # tokens accepted of each verify
    worst = 0.0
    for i, (tokens, verify) in enumerate(steps):
        step = model.step(requests, tokens, verify=verify)
        x = torch.randn(len(requests), tokens, g.hidden_size, generator=gen)
        # The model's own step moves its lengths and slots on; the layer's caches are then
        # rewritten from the state before it, by this step's x.
        saved = (rank.c.conv[layer].clone(), rank.c.recurrent[layer].clone())
        model.forward(requests, torch.randint(0, g.vocab_size, (3, tokens), generator=gen),
                      verify=verify)  # fmt: skip
        rank.c.conv[layer].copy_(saved[0])
        rank.c.recurrent[layer].copy_(saved[1])
        with torch.no_grad():
            got = rank.kda(layer, x, step)
            for r in range(len(requests)):
                seq = torch.cat([history[r], x[r]])
                want = attn(seq[None])[0, -tokens:]
                err = rel_rows(got[r], want).max().item()
                assert err <= BOUND, (i, r, err)
                worst = max(worst, err)
        accepted = next(keep) if verify else (tokens,) * len(requests)
        for r, n in enumerate(accepted):
            history[r] = torch.cat([history[r], x[r, :n]])
            if verify:
                model.accept(requests[r], n)
    print(f"worst row vs transformers {worst:.2e}")
    assert min(len(h) for h in history) > 7 + 1 + 1  # partial acceptance carried on
