"""The specialized decode on the GPU at GLM-5.3-Flash TP-4 rank shapes (four layers: KDA x3
and MLA+DSA, dense and MoE MLPs), every stage on, each step captured in one CUDA graph per
token count and replayed for 64 steps against the stock reference's graph. The MoE routes
every token to all of 16 experts (the real 288 choose 8, which flips under any rounding and
then moves the output O(1); the router's real shape is covered by glm5-kernels' GPU tests);
the indexer's top-2048 already keeps every pool at these contexts.

Checks per replay: every stage op's output against the stock op it replaced on the same input
(the per-call bounds of test_decode.py, FP8 MMA included), and the end-to-end hidden states,
logits, KDA states and latent KV within 0.1 relative L2 of stock (the BF16 / FP8 noise
yardstick measured on CPU is 0.11: FP8 re-quantization flips codes once inputs differ by an
ulp, so the end-to-end bound is loose by nature; the per-call checks are the tight ones)."""

import pytest
import torch
from decode_cases import ALL_STAGES, check_calls, rel, shadow

from glm5_policy import DecodeConfig
from glm5_runtime.decode import SpecializedDecode
from glm5_runtime.reference import ReferenceModel, geometry
from glm5_runtime.reference.backbone import ReferenceBackbone

pytestmark = pytest.mark.gpu

STEPS = 64


def _geometry():
    return geometry(
        "flash-tp4-rank", num_hidden_layers=4,
        layer_types=("linear_attention",) * 3 + ("deepseek_sparse_attention",),
        mlp_layer_types=("dense", "dense", "sparse", "sparse"), indexer_types=("full",) * 4,
        n_routed_experts=16, num_experts_per_tok=16,
    )  # fmt: skip


def _copy_step(dst, src):
    for name, value in vars(src).items():
        if isinstance(value, torch.Tensor):
            getattr(dst, name).copy_(value)


class Captured:
    """One side's step of a fixed shape as a CUDA graph over static inputs."""

    def __init__(self, fn, tokens, step):
        self.tokens, self.step = tokens.clone(), step
        fn(self.tokens, self.step)  # warm-up
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = fn(self.tokens, self.step)

    def __call__(self, tokens, step):
        self.tokens.copy_(tokens)
        _copy_step(self.step, step)
        self.graph.replay()
        return self.out[0].clone()


@pytest.mark.parametrize("q, tokens", [(1, 1), (1, 8), (1, 64), (4, 4), (4, 8), (4, 64)])
def test_graph_replays_equal_stock(q, tokens):
    g = _geometry()
    requests = tokens // q
    kw = dict(device="cuda", max_requests=requests, max_context=320, block_size=64, q=q)
    models = [ReferenceModel.random(g, seed=1, fp8_activations=True, **kw) for _ in range(2)]
    stock, spec = models
    config = DecodeConfig.build(max_context=320, q=q, capture_sizes=[tokens], policy=ALL_STAGES)
    decode = SpecializedDecode(ReferenceBackbone(spec), config)
    decode.prepare()
    pairs = []
    shadow(decode, spec, pairs)
    gen = torch.Generator("cuda").manual_seed(tokens + q)
    rows = list(range(requests))
    # One held rank of TP 4 embeds only its quarter of the vocabulary (the other ranks'
    # rows would arrive through the all-reduce): ids from it keep every hidden state live.
    vocab = g.vocab_size // g.tp_size
    prompt = torch.randint(0, vocab, (requests, 9), device="cuda", generator=gen)
    for m in models:
        assert [m.add() for _ in rows] == rows
        m.forward(rows, prompt)

    def stock_fn(ids, step):
        h = stock.backbone(ids, step)
        return h, stock.logits(h)

    def spec_fn(ids, step):
        decision = decode.plan(step, capturing=torch.cuda.is_current_stream_capturing())
        if decision.step is None:  # the warm-up outside the capture: stock, as in vLLM
            h = spec.backbone(ids, step)
            return h, spec.logits(h)
        h = decode.run(decision.step, ids, step)
        return h, decode.compute_logits(h)

    verify = q > 1
    graphs = {}
    worst = {}
    for i in range(STEPS):
        ids = torch.randint(0, vocab, (requests, q), device="cuda", generator=gen)
        for name, m, fn in (("stock", stock, stock_fn), ("spec", spec, spec_fn)):
            if name not in graphs:
                graphs[name] = Captured(fn, ids, m.step(rows, q, verify))
            m.forward(rows, ids, verify=verify, run=graphs[name])
        h_stock, h_spec = graphs["stock"].out[0], graphs["spec"].out[0]
        check_calls(pairs, worst)
        assert torch.isfinite(h_spec).all()
        assert rel(h_spec, h_stock) < 0.1, (i, rel(h_spec, h_stock))
        assert rel(graphs["spec"].out[1], graphs["stock"].out[1]) < 0.1
        if verify:
            n = int(torch.randint(1, q + 1, (), generator=gen, device="cuda"))
            for m in models:
                for r in rows:
                    m.accept(r, n)
    for layer in g.kda_layers:
        assert rel(spec.ranks[0].c.recurrent[layer], stock.ranks[0].c.recurrent[layer]) < 0.1
    for layer in g.mla_layers:
        assert rel(spec.ranks[0].c.latent[layer], stock.ranks[0].c.latent[layer]) < 0.1
    print(f"q={q} tokens={tokens}: worst per-call errors {worst}")
