"""The reference backbone implements every member of the backbone protocol, with the layer
list and row counts a GLM-5.3-Flash geometry implies."""

import inspect

import torch

from glm5_runtime.protocol import Backbone, Layer
from glm5_runtime.reference import ReferenceModel, geometry
from glm5_runtime.reference.backbone import ReferenceBackbone


def test_reference_backbone_is_a_backbone():
    g = geometry("tiny")
    model = ReferenceModel.random(g, max_requests=2, max_context=32, block_size=16, q=2)
    backbone = ReferenceBackbone(model)
    assert isinstance(backbone, Backbone)
    members = {n for n, _ in inspect.getmembers(Backbone) if not n.startswith("_")}
    members |= set(Backbone.__annotations__)
    assert all(hasattr(backbone, n) for n in members), members - set(dir(backbone))
    assert backbone.layers[3] == Layer(3, "mla", "moe") and backbone.layers[0].mlp == "dense"
    assert [x.index for x in backbone.draft_layers] == [g.num_hidden_layers]
    r = [model.add(), model.add()]
    decode, verify = model.step(r, 1), model.step(r, 2, verify=True)
    rows = backbone.rows(decode)
    assert set(rows) >= {f"layers.{i}.self_attn" for i in range(g.num_hidden_layers)}
    assert rows["layers.0.self_attn"].decodes == 2 and rows["layers.0.self_attn"].spec_decodes == 0
    v = backbone.rows(verify)["layers.0.self_attn"]
    assert (v.spec_decodes, v.spec_decode_tokens, v.spec_state_rows) == (2, 4, 2)
    assert backbone.rows(verify)["layers.3.self_attn.indexer"].indexer
    assert backbone.tokens(verify) == 4
    x = torch.randn(2, 1, g.hidden_size).bfloat16()
    assert backbone.norm("norm.weight", x).shape == x.shape
