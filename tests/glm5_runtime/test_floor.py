"""The step's floor (`glm5_runtime.floor`): the routed experts by what the step's routing
selected, caches once per request, and the split by owner adding up to it."""

import pytest

from glm5_runtime.bench import _fill_caches, _step, _token_ids
from glm5_runtime.floor import expert_hits, floor_bytes, touched_experts
from glm5_runtime.reference import ReferenceModel, geometry


@pytest.fixture(scope="module")
def model():
    model = ReferenceModel.random(geometry("tiny"), max_requests=4, max_context=64, q=2)
    for _ in range(4):
        model.add()
    _fill_caches(model)
    return model


def _moe_layers(model):
    return [i for i, t in enumerate(model.g.mlp_layer_types) if t != "dense"]


def _forward(model, requests: int, q: int):
    _, step = _step(model, requests * q, q, 48)
    ids = _token_ids(model, requests, q)
    return lambda: model.logits(model.backbone(ids, step))


def test_one_token_touches_exactly_its_top_k_and_the_stage_is_put_back(model):
    rank = model.ranks[0]
    touched = touched_experts(model, _forward(model, 1, 1))
    assert touched == {i: model.g.num_experts_per_tok for i in _moe_layers(model)}
    assert "experts" not in vars(rank)  # the rank's own method again


def test_touched_experts_are_the_routing_a_stage_sees(model):
    """Against the routing itself: the ids every `experts` call is handed, read by a wrapper
    of this test's own, then counted unique per layer."""
    rank, seen = model.ranks[0], {}
    method = type(rank).experts

    def spy(self, prefix, x, ids, weights):
        seen.setdefault(int(prefix.split(".")[1]), set()).update(ids.flatten().tolist())
        return method(self, prefix, x, ids, weights)

    with pytest.MonkeyPatch.context() as mp:  # one run: a step moves the caches it reads
        mp.setattr(type(rank), "experts", spy)
        touched = touched_experts(model, _forward(model, 4, 2))
    assert touched == {i: len(s) for i, s in seen.items()}
    assert all(model.g.num_experts_per_tok < n <= model.g.n_routed_experts
               for n in touched.values())  # fmt: skip


def test_the_floor_reads_the_touched_experts(model):
    g, layers = model.g, _moe_layers(model)
    mtp = tuple(f"layers.{i}." for i in model.mtp_layers)
    w = model.ranks[0].w
    experts = sum(t.nbytes for n, t in w.items() if ".experts." in n and not n.startswith(mtp))
    every = floor_bytes(model, 4, 48, touched=dict.fromkeys(layers, g.n_routed_experts))
    none = floor_bytes(model, 4, 48, touched=dict.fromkeys(layers, 0))
    assert every - none == experts
    half = floor_bytes(model, 4, 48, touched=dict.fromkeys(layers, g.n_routed_experts // 2))
    assert half - none == pytest.approx(experts / 2, rel=1e-12)
    # No routing read: the uniform expectation E(1 - (1 - k/E)^B) of every layer.
    expected = 1 - (1 - g.num_experts_per_tok / g.n_routed_experts) ** 4
    assert expert_hits(model, 4) == dict.fromkeys(layers, expected)
    assert floor_bytes(model, 4, 48) == pytest.approx(none + expected * experts, rel=1e-12)


def test_caches_count_once_per_request(model):
    """A verify step's tokens share their request's caches: the floor grows with requests,
    not tokens, by each request's KDA states (read and written: the recurrent cache's bytes
    twice) and its MLA latents and pool keys."""
    g = model.g
    touched = dict.fromkeys(_moe_layers(model), 3)  # the experts fixed: caches alone move
    by_tokens = floor_bytes(model, 8, 48, 2, touched) - floor_bytes(model, 4, 48, 2, touched)
    assert by_tokens == 0
    per_request = floor_bytes(model, 8, 48, 3, touched) - floor_bytes(model, 8, 48, 2, touched)
    c = model.ranks[0].c
    states = sum(2 * c.recurrent[i][0].nbytes for i in g.kda_layers)
    latents = min(48 + 1, g.index_topk + g.index_kpool - 1) * g.kv_lora_rank * 2
    pools = (48 // g.index_kpool) * c.kpool[g.mla_layers[0]][0, 0].nbytes
    assert per_request == states + len(g.mla_layers) * (latents + pools)
