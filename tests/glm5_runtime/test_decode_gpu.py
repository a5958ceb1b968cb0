"""The specialized decode on the GPU at GLM-5.3-Flash TP-4 rank shapes, every stage on, each
step captured in one FULL CUDA graph per token count (as vLLM captures them) and replayed
against the stock reference's graph of the same step:

- every q in 1..8 and every capture size 1..64 that is a multiple of q, with the MTP draft
  (draft prefill of q tokens per request, then a draft decode) on each step, over four layers
  (KDA x3 and MLA+DSA, dense and MoE MLPs) and the MTP layer: SWEEP_STEPS replays a size
  (from a 9-token prompt: a pool completes and the indexer's ring — 16 slots at q = 1, 32
  above — wraps at every q; the KDA state over 64 steps is test_kda_gpu.py's). 64 replays a
  size made q = 1 alone take over 5 minutes of a 10-minute GPU call; the sweep runs in chunks
  of at most 16 sizes (`_sweep_chunks`), so that pytest-xdist spreads q = 1 over processes
  (~30 GiB each: three fit the H200, `-n 3`);
- the full 45-layer depth at the smallest and largest sizes of q = 1 and q = 4, DEPTH_STEPS
  replays each.

The two models share their weights (the specialized one reads them, never writes). The MoE
routes for real: 8 of the 288 experts by sigmoid score + correction bias (the checkpoint's
shapes; random weights). Over four layers the indexer keeps its top 16 tokens (one pool of
16 and the tail: from q = 2 a context holds two or more complete pools, so the selection
chooses); at 45 layers the model's top-2048 keeps every pool at these contexts.

Checks per replay: every stage op's worst row against the stock op it replaced on the same
input (the per-call bounds of decode_cases.py, FP8 MMA included) and each MoE layer's routing
against route_ref on the kernel's own logits (tie-tolerant). End to end, a near tie resolved
differently by the two sides' rounding moves a token's output O(1), so every replay starts
the specialized side from the stock side's caches, and only the tokens whose choices and
whose request's earlier tokens' choices agree (every MoE layer's experts, every selection:
decode_cases.agreeing_tokens) are compared, per row: each token's hidden state and logits;
the draft hidden states of the requests whose draft choices agree; every cache slot (KDA
states, latent KV, indexer key rings) of the requests whose every token agrees.
The bound, over four layers: a noise yardstick measured in the same run, as the CPU suite's
(decode_cases.Yardstick) — the stock model in FP32 (the same random draws, unrounded),
following the stock graph's choices replay by replay, its per-row errors against stock on
every row; each kind's worst specialized row within MARGIN x its worst yardstick row.
At 45 layers the FP32 copy does not fit beside the two models (77 GiB each): there the
relative L2 over the compared rows stays within BOUND, the yardstick measured on CPU (0.11),
scaled by sqrt(L / 4) as rounding perturbations add up over the layers (measured: 0.029 at 4
layers, 0.10 at 45, all-experts routing). FP8 re-quantization flips codes once inputs differ
by an ulp, so the end-to-end bound is loose by nature; the per-call checks are the tight ones,
and a semantic slip (a missed route, a wrong weight or row) moves these by O(1)."""

import gc
import math
from types import SimpleNamespace

import pytest
import torch
from decode_cases import (
    ALL_STAGES,
    SLOT_DIMS,
    Yardstick,
    agreeing_logs,
    agreeing_tokens,
    check_calls,
    choices,
    clear_choices,
    copy_caches,
    follow_choices,
    record_choices,
    record_stage_choices,
    rel,
    rel_rows,
    shadow,
    written,
)

from glm5_policy import DecodeConfig
from glm5_runtime.decode import SpecializedDecode
from glm5_runtime.draft import SpecializedDraft
from glm5_runtime.reference import ReferenceModel, geometry
from glm5_runtime.reference.backbone import ReferenceBackbone

pytestmark = pytest.mark.gpu

SWEEP_STEPS, DEPTH_STEPS = 16, 32  # replays a capture size (module docstring)
QUICK_STEPS = 8  # the quick selection's: 9 + 8 x 4 tokens still wrap the 32-slot ring
PROMPT = 9
BOUND = 0.1  # at 4 layers, where no yardstick runs (module docstring)
MARGIN = Yardstick.MARGIN  # the CPU suite's: two roundings apart where the yardstick has one


@pytest.fixture(autouse=True)
def _free_the_models():
    """A test's models (77 GiB of weights at full depth) live in reference cycles (the choice
    logs' closures over their ranks) until a collection: free them before the next test builds
    its own, or it finds the GPU half full (the full-depth cases after the first failed so)."""
    yield
    gc.collect()
    torch.cuda.empty_cache()


def _geometry(full_depth=False):
    if full_depth:
        kw = {}
    else:
        kw = dict(
            num_hidden_layers=4,
            layer_types=("linear_attention",) * 3 + ("deepseek_sparse_attention",),
            mlp_layer_types=("dense", "dense", "sparse", "sparse"),
            indexer_types=("full",) * 4,
            index_topk=16,  # one pool of 16 kept: the selection chooses (module docstring)
        )
    return geometry("flash-tp4-rank", **kw)  # 288 experts, top-8


def _copy_step(dst, src):
    for name, value in vars(src).items():
        if isinstance(value, torch.Tensor):
            getattr(dst, name).copy_(value)


class Captured:
    """One side's step of a fixed shape as a CUDA graph over static inputs; calling it with
    (*inputs, step) replays it and returns a copy of its first output. `log`: the choices
    (decode_cases.record_choices) the capture recorded, which each replay refreshes."""

    def __init__(self, model, fn, *args):
        *inputs, self.step = args
        self.inputs = [x.clone() for x in inputs]
        fn(*self.inputs, self.step)  # warm-up, outside the capture: stock, as in vLLM
        clear_choices(model)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = fn(*self.inputs, self.step)
        self.log = choices(model)
        clear_choices(model)

    def __call__(self, *args):
        *inputs, step = args
        for dst, src in zip(self.inputs, inputs, strict=True):
            dst.copy_(src)
        _copy_step(self.step, step)
        self.graph.replay()
        return self.out[0].clone()


class Sides:
    """The stock and specialized models (shared weights), their decode and draft."""

    def __init__(self, g, q, sizes, max_requests, with_draft, steps, yardstick=True):
        self.g, self.q, self.steps = g, q, steps
        self.max_context = 64 * math.ceil((PROMPT + (steps + 2) * q) / 64)
        kw = dict(
            device="cuda", max_requests=max_requests, max_context=self.max_context,
            block_size=64, q=q, fp8_activations=True,
        )  # fmt: skip
        self.stock = ReferenceModel.random(g, seed=1, **kw)
        self.spec = ReferenceModel(g, [rank.w for rank in self.stock.ranks], **kw)
        config = DecodeConfig.build(
            max_context=self.max_context, q=q, capture_sizes=sizes, policy=ALL_STAGES
        )
        backbone = ReferenceBackbone(self.spec)
        self.decode = SpecializedDecode(backbone, config)
        assert self.decode.batches == [b for b in sizes if b % q == 0]
        assert self.decode.prepare() == set()
        self.pairs, self.draft_pairs = [], []
        shadow(self.decode, self.spec, self.pairs)
        record_choices(self.stock)
        record_choices(self.spec)
        record_stage_choices(self.decode, self.spec)
        self.compared = self.rows = 0
        self.draft = None
        if with_draft:
            self.draft = SpecializedDraft(backbone, config)
            assert self.draft.prepare() == set()
            shadow(self.draft, self.spec, self.draft_pairs)
            record_stage_choices(self.draft, self.spec)
        self.gen = torch.Generator("cuda").manual_seed(q)
        # One held rank of TP 4 embeds only its quarter of the vocabulary (the other ranks'
        # rows would arrive through the all-reduce): ids from it keep every hidden state live.
        self.vocab = g.vocab_size // g.tp_size
        self.worst: dict[str, float] = {}  # per call (check_calls)
        # End to end, per kind: the worst row of the specialized side and of the yardstick,
        # and the specialized side's relative L2 over its compared rows.
        self.e2e: dict[str, dict[str, float]] = {"spec": {}, "noise": {}, "l2": {}}
        self.fp32 = None
        if yardstick:  # the stock model in FP32, led by the stock graphs' logs (handed over)
            self.fp32 = ReferenceModel.random(g, seed=1, dtype=torch.float32, **kw)
            self.lead = SimpleNamespace(choices=[])
            follow_choices(self.fp32, SimpleNamespace(ranks=[self.lead]))

    def ids(self, requests, tokens):
        return torch.randint(0, self.vocab, (requests, tokens), device="cuda", generator=self.gen)

    def _main(self, model):
        if model is self.stock:

            def fn(ids, step):
                h = model.backbone(ids, step)
                return h, model.logits(h)

            return fn

        def planned(ids, step):
            decision = self.decode.plan(step, capturing=torch.cuda.is_current_stream_capturing())
            if decision.step is None:  # the warm-up outside the capture
                h = model.backbone(ids, step)
                return h, model.logits(h)
            h = self.decode.run(decision.step, ids, step)
            return h, self.decode.compute_logits(h)

        return planned

    def _draft(self, model):
        if model is self.stock:
            return lambda ids, hidden, step: model.draft_hidden(ids, hidden, step)[:1]

        def planned(ids, hidden, step):
            decision = self.draft.plan(step, capturing=torch.cuda.is_current_stream_capturing())
            if decision.step is None:  # the warm-up outside the capture
                h = model.draft_hidden(ids, hidden, step)[0]
                return (h[:, -1:] if ids.shape[1] > 1 else h,)
            return (self.draft.run(decision.step, 0, ids, hidden, step),)

        return planned

    def _worse(self, side, kind, got, want, row_dims=1):
        """Record `side`'s worst row of `kind` (got vs want), and for the specialized side
        its relative L2 over these rows."""
        if got.numel():
            e = self.e2e[side]
            e[kind] = max(e.get(kind, 0.0), rel_rows(got, want, row_dims).max().item())
            if side == "spec":
                self.e2e["l2"][kind] = max(self.e2e["l2"].get(kind, 0.0), rel(got, want))

    def check(self, what: str, min_compared: float):
        """The end-to-end bound (module docstring); at least `min_compared` of the tokens
        compared."""
        spec, noise, l2 = (self.e2e[k] for k in ("spec", "noise", "l2"))
        summary = {k: f"{v:.2e} (l2 {l2[k]:.2e}, noise {noise.get(k, float('nan')):.2e})"
                   for k, v in spec.items()}  # fmt: skip
        print(f"{what}: worst per row, specialized vs stock {summary}; per call {self.worst}; "
              f"tokens compared {self.compared} of {self.rows}")  # fmt: skip
        assert self.compared >= min_compared * self.rows, (self.compared, self.rows)
        assert not min_compared or {"hidden", "logits"} <= set(spec), summary
        if self.fp32 is not None:
            for kind, err in spec.items():
                assert err <= MARGIN * noise[kind], (kind, summary)
        else:
            # Rounding perturbations add up like a random walk over the layers: worst
            # hidden distance 0.029 at 4 layers, 0.10 at 45 (ratio ~ sqrt(45 / 4)).
            bound = BOUND * math.sqrt(max(1.0, self.g.num_hidden_layers / 4))
            for kind, err in l2.items():
                assert err < bound, (kind, summary, bound)

    def run(self, requests):
        """`steps` planned steps of `requests` x q tokens (verifies when q > 1), each followed
        by the draft; then the caches."""
        q, D = self.q, self.g.hidden_size
        models = (self.stock, self.spec)
        every = models if self.fp32 is None else (*models, self.fp32)
        rows = [self.stock.add() for _ in range(requests)]
        assert all([m.add() for _ in range(requests)] == rows for m in every[1:])
        prompt = self.ids(requests, PROMPT)
        for m in models:
            m.forward(rows, prompt)  # prefill: stock on both sides
        if self.fp32 is not None:  # its caches come from stock's before each step: only
            self.fp32.forward(rows, prompt, run=lambda tokens, step: None)  # its lengths
        verify = q > 1
        # The warm-ups run (and write the caches) eagerly: the same inputs on both sides.
        ids = self.ids(requests, q)
        main = [Captured(m, self._main(m), ids, m.step(rows, q, verify)) for m in models]
        drafts = []
        if self.draft is not None:
            at = torch.zeros(requests, q, dtype=torch.long, device="cuda")
            h = torch.zeros(requests, q, D, dtype=torch.bfloat16, device="cuda")
            shapes = [(q, at, h)] + ([(1, at[:, :1], h[:, :1])] if q > 1 else [])
            for t, pos, hid in shapes:
                ids = self.ids(requests, t)
                drafts.append(
                    [Captured(m, self._draft(m), ids, hid, m.place(rows, pos)) for m in models]
                )
        for i in range(self.steps):
            ids = self.ids(requests, q)
            start = torch.tensor([self.stock.lengths[r] for r in rows], device="cuda")
            for m in every[1:]:
                copy_caches(m, self.stock)  # each replay from the same state
            h = [
                m.forward(rows, ids, verify=verify, run=c)
                for m, c in zip(models, main, strict=True)
            ]
            check_calls(self.pairs, self.worst)
            assert torch.isfinite(h[1]).all(), i
            ok = agreeing_tokens(main[0].log, main[1].log, requests, q).cuda()
            self.rows, self.compared = self.rows + ok.numel(), self.compared + int(ok.sum())
            logits = [c.out[1].reshape(requests, q, -1) for c in main]
            self._worse("spec", "hidden", h[1][ok], h[0][ok])
            self._worse("spec", "logits", logits[1][ok], logits[0][ok])
            if self.fp32 is not None:  # every row: it made the stock graph's choices
                self.lead.choices[:] = main[0].log
                clear_choices(self.fp32)
                h32 = self.fp32.forward(rows, ids, verify=verify)
                self._worse("noise", "hidden", h32, h[0])
                self._worse("noise", "logits", self.fp32.logits(h32).view_as(logits[0]),
                            logits[0])  # fmt: skip
                self.check_caches(main[0].step, range(requests), "noise", self.fp32)
            # A request's cache slots hold all its tokens: compared where every one agrees.
            if (whole := ok.all(1)).any():
                self.check_caches(main[0].step, whole.nonzero()[:, 0].tolist())
            # The draft on the stock side's hidden states (the same input on both sides):
            # a draft prefill at the step's positions, then a draft decode one past them.
            hidden, positions = h[0], start[:, None] + torch.arange(q, device="cuda")
            for graphs in drafts:
                t = graphs[0].inputs[0].shape[1]
                d_ids, pos = self.ids(requests, t), positions[:, -t:] + (t == 1 and q > 1)
                out = [
                    c(d_ids, hidden, m.place(rows, pos))
                    for m, c in zip(models, graphs, strict=True)
                ]
                ref = out[0][:, -1:] if t > 1 else out[0]
                assert out[1].shape == ref.shape
                ok = agreeing_logs(graphs[0].log, graphs[1].log, requests).cuda()
                self._worse("spec", "draft", out[1][ok], ref[ok])
                if self.fp32 is not None:
                    self.lead.choices[:] = graphs[0].log
                    clear_choices(self.fp32)
                    d32 = self.fp32.draft_hidden(d_ids, hidden.float(),
                                                 self.fp32.place(rows, pos))[0]  # fmt: skip
                    self._worse("noise", "draft", d32[:, -1:] if t > 1 else d32, ref)
                hidden = ref
            if drafts:
                check_calls(self.draft_pairs, self.worst)
            if verify:
                n = int(torch.randint(1, q + 1, (), generator=self.gen, device="cuda"))
                for m in every:
                    for r in rows:
                        m.accept(r, n)
        for m in every:
            for r in rows:
                m.release(r)

    def check_caches(self, step, picked, side="spec", model=None):
        """Every cache slot the `picked` requests (rows of `step`) wrote in the replay, of
        `model` (default: the specialized one) against stock's."""
        a, b = self.stock.ranks[0].c, (model or self.spec).ranks[0].c
        for kind in ("recurrent", "latent", "tail"):
            rows = torch.cat([written(step, kind, r) for r in picked])
            for layer, cache in getattr(a, kind).items():
                other = getattr(b, kind)[layer]
                if kind == "latent":
                    other, cache = other.flatten(0, 1), cache.flatten(0, 1)
                self._worse(side, kind, other[rows], cache[rows], SLOT_DIMS[kind])


def _sweep_chunks(per_chunk=16):
    """(q, request counts) for the sweep, at most `per_chunk` capture sizes a test: q = 1's
    64 sizes take ~11 minutes in one process (160-176 s a chunk on the H200), past a 10-minute
    GPU call; in chunks pytest-xdist spreads them over processes (each builds its own models
    and yardstick)."""
    for q in range(1, 9):
        n = 64 // q
        for lo in range(1, n + 1, per_chunk):
            hi = min(lo + per_chunk - 1, n)
            yield pytest.param(q, range(lo, hi + 1), id=f"q{q}-{lo * q}..{hi * q}tokens")


@pytest.mark.parametrize("q, counts", list(_sweep_chunks()))
def test_every_capture_size_with_draft_equals_stock(q, counts):
    sizes = list(range(1, 65))  # vLLM's capture sizes may be any; q-multiples are planned
    sides = Sides(_geometry(), q, sizes, 64 // q, with_draft=True, steps=SWEEP_STEPS)
    for requests in counts:
        sides.run(requests)
        # This size's graphs are gone: drop the stage outputs they recorded.
        sides.pairs.clear()
        sides.draft_pairs.clear()
    sides.check(f"q={q} at {counts[0] * q}..{counts[-1] * q} tokens", 1 / 8)  # test_decode's share


def test_three_capture_sizes_with_draft_equal_stock():
    """The quick selection's whole step: q = 4 (three MTP drafts) at its smallest, a middle
    and its largest capture size (4, 12, 64 tokens), QUICK_STEPS replays each, as the sweep
    checks each (the sweep of all 16 sizes ran past 7 minutes of the H200, the quick
    selection's whole budget; q = 1, and the fused_gates KDA step it runs at 1-2 tokens, are
    the sweep's)."""
    q, requests = 4, (1, 3, 16)
    sides = Sides(_geometry(), q, [q * r for r in requests], max(requests), with_draft=True,
                  steps=QUICK_STEPS)  # fmt: skip
    for r in requests:
        sides.run(r)
        sides.pairs.clear()
        sides.draft_pairs.clear()
    sides.check(f"q={q} at {[q * r for r in requests]} tokens", 1 / 8)


@pytest.mark.parametrize("q, tokens", [(1, 1), (1, 64), (4, 4), (4, 64)])
def test_full_depth_equals_stock(q, tokens):
    sides = Sides(_geometry(full_depth=True), q, [tokens], tokens // q, with_draft=False,
                  steps=DEPTH_STEPS, yardstick=False)  # fmt: skip
    sides.run(tokens // q)
    sides.check(f"45 layers, q={q} tokens={tokens}", 0.0)
    # Through 42 MoE layers a token rarely keeps every choice of stock's: the per-call
    # checks (every op, every replay) are what this depth must pass; the hidden states are
    # compared where a token did.
