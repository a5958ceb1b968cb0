import sys, torch
sys.path.insert(0, "tests/glm5_runtime")
from test_decode_gpu import _geometry, ALL_STAGES, Shadow, _rel
from glm5_policy import DecodeConfig
from glm5_runtime.decode import SpecializedDecode
from glm5_runtime.reference import ReferenceModel
from glm5_runtime.reference.backbone import ReferenceBackbone
g = _geometry()
kw = dict(device="cuda", max_requests=1, max_context=320, block_size=64, q=1)
stock, spec = [ReferenceModel.random(g, seed=1, fp8_activations=True, **kw) for _ in range(2)]
config = DecodeConfig.build(max_context=320, q=1, capture_sizes=[1], policy=ALL_STAGES)
decode = SpecializedDecode(ReferenceBackbone(spec), config)
decode.prepare()
pairs = []
decode.routes[1] = [(s, n, Shadow(op, spec.ranks[s], n, pairs)) for s, n, op in decode.routes[1]]
gen = torch.Generator("cuda").manual_seed(1)
prompt = torch.randint(0, g.vocab_size, (1, 9), device="cuda", generator=gen)
for m in (stock, spec):
    m.add()
    m.forward([0], prompt)
print("after prefill latent rel", _rel(spec.ranks[0].c.latent[3], stock.ranks[0].c.latent[3]))
ids = torch.randint(0, g.vocab_size, (1, 1), device="cuda", generator=gen)
step_a, step_b = stock.step([0], 1), spec.step([0], 1)
h_a = stock.backbone(ids, step_a)
# eager specialized run (no graph)
d = decode.plan(step_b, capturing=True)
h_b = decode.run(d.step, ids, step_b)
print("eager spec vs stock", _rel(h_b, h_a))
for kind, name, y, ref in pairs:
    print(kind, name, f"{_rel(y, ref):.2e}", y.isnan().any().item(), ref.isnan().any().item(), ref.norm().item(), tuple(y.shape))
# eager stock on spec model with routes off equals stock?
