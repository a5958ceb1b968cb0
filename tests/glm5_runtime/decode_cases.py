"""Shared by the CPU and GPU specialized-decode tests: every stage on, the per-call bounds,
and `shadow`, which makes each stage op also run the stock op it replaces on the same input."""

import sys

import torch
from moe_routing import assert_routing, recording
from torch.utils._python_dispatch import TorchDispatchMode

from glm5_kernels.dsa import (
    index_keys_ref,
    index_topk_ref,
    kpool_write_ref,
    latent_write_ref,
    sparse_mla_decode_ref,
    unpack_kpool_pages_ref,
)
from glm5_kernels.kda import kda_decode_ref

# The MoE stage: per-route at 1-2 tokens, with the router GEMM inside the routing launch at
# 3, grouped at 5-16 and 33-64 (16-token groups cut there); at 4 and 17-32 the layer runs the
# router and shared expert stages beside the stock routing and experts (the CPU suites' q = 2
# steps: 2 and 4 tokens, q = 3: 3 and 9).
# The fused mHC boundaries everywhere but 17-20 tokens (the stock boundaries beside the
# stages there): the CuTe DSL kernel at 1-8 and 21-64 tokens (where it builds: a CUDA GPU;
# the Triton kernel otherwise) — at 1-4 and 33-64 with each comb deferred to the next
# boundary — the Triton one at 9-16. The fused KDA step with the gates'
# up-projections inside it at 1-2 tokens (fused_gates), after the stock f_b / g_b linears
# at 3-64.
ALL_STAGES = {
    "moe": {"1-2": "per_route", "3": "fused_router", "5-16": "grouped", "33-64": "grouped"},
    "boundary": {
        "1-4": "cute_deferred",
        "5-8": "cute",
        "9-16": "triton",
        "21-32": "cute",
        "33-64": "cute_deferred",
    },
    "kda": {"1-2": "fused_gates", "3-64": "fused"},
    "dsa_attn": {"1-64": "sparse"},
    "dsa_indexer": {"1-64": "fused"},
    "dsa_kpool": {"1-64": "fused"},
    **{
        stage: {"1-64": choice}
        for stage, choice in [
            ("dsa_proj", "split_k"),
            ("kda_proj", "gemm"),
            ("router", "split_k"),
            ("shared_expert", "gemv"),
            ("dense_mlp", "gemv"),
            ("logits_head", "skinny"),
            ("embed", "gather"),
        ]
    },
}

# Per-call bounds against the stock op on the same input, on every row (a token's output, a
# cache slot): the worst row's relative L2 error, so that one wrong row among 64 fails as
# surely as a wrong tensor. The same bounds on CPU and GPU, each the worst case of the
# rounding the op may do differently from stock:
# - Projection: BF16 outputs of the same FP32 sums in another order, each element at most one
#   BF16 ulp (<= 2^-7 of itself) from stock's: 2^-7 a row.
# - Router: exact BF16 products summed in FP32 in another order (split-K on the GPU), ~sqrt(K)
#   2^-24 of the row (2^-18 at K = 4096), 8x for a row's maximum over a step: 2^-15.
# - FP8 MLPs (SharedExpert, DenseMlp, the MoE layer's routed + shared sum on the kernel's
#   own routing): the BF16 intermediate is re-quantized, and where a one-ulp move flips an
#   e4m3 code the product moves by up to half a step (2^-4); at one token thousands of
#   replays reach 2.7e-2 on the H200. glm5-kernels' own tests check the GEMMs apart, tightly.
# - The fused KDA step against kda_decode_ref on the same caches: its BF16 rows round twice
#   (o, then the gated norm: ~2^-8.5 rms) and a conv output may land on the neighbouring
#   BF16 (the sums' order), which the state carries: 2^-7 for each row and state slot.
# - Sparse MLA: BF16 output of FP32 softmax-weighted sums, 2^-7; the pool write's FP8 keys
#   and queries as values, a code a step off where a BF16 rounding upstream was: 2^-4.
# - The MLA input norms (LatentWrite: the normed q_a, the latent rows it wrote): the sum of
#   squares in another order can move a normed value to the neighbouring BF16 and the weight
#   multiply rounds again, at most 2 ulps an element: 2^-7 a row.
# - The indexer's one projection (IndexerInputs: wk | gate | weights_proj, FP32 sums): as the
#   Router, 2^-15. The ring's keys where the write norms them (KpoolTailNormed): the LayerNorm
#   in another sum order may move an element to its neighbouring BF16: 2^-8 a slot.
# - The selection (IndexerTopk), the ring and the conv state (raw copies): exact.
# The MoE layer's routing ("Routing") is checked apart: route_ref's pick from the kernel's own
# logits, tie-tolerant (moe_routing.assert_routing), and those logits as a Router's.
CALL_BOUND = {
    "Projection": 2**-7, "Router": 2**-15, "SharedExpert": 2**-4, "DenseMlp": 2**-4,
    "MoeLayer": 2**-4, "KdaDecode": 2**-7, "KdaState": 2**-7, "SparseMlaDecode": 2**-7,
    "IndexerTopk": 0.0, "KpoolQueries": 2**-4, "KpoolPages": 2**-4, "LatentQuery": 2**-7,
    "LatentRows": 2**-7, "IndexerInputs": 2**-15, "KpoolTailNormed": 2**-8,
    "AbsorbedQuery": 2**-7,
}  # fmt: skip


def rel_tensor(a, b):
    """Relative L2 distance of a from b, in FP64, as a 0-d tensor (no device sync)."""
    num = (a.double() - b.double()).norm()
    return torch.where(num == 0, 0.0, num / b.double().norm())  # equal zeros: no error


def rel(a, b):
    """Relative L2 distance of a from b, in FP64."""
    return rel_tensor(a, b).item()


class Shadow:
    """A stage op that also runs the stock op on the same input; (kind, name, op output,
    stock output) go to `pairs` (tensors: a CUDA-graph replay refreshes them)."""

    def __init__(self, op, rank, name, pairs):
        self.op, self.rank, self.name, self.pairs = op, rank, name, pairs

    def __getattr__(self, name):  # everything else is the op's (its sizes, its flags)
        return getattr(self.op, name)

    def absorb(self, q):
        """The MLA query absorption (SparseMlaDecode's) against the FP32 product with the
        stock model's kv_b_proj key rows."""
        y = self.op.absorb(q)
        p = self.name.removesuffix("dsa_attn")
        heads, nope = q.shape[1], q.shape[2]
        kv_b = self.rank.w[p + "kv_b_proj.weight"].float()
        w_uk = kv_b.view(heads, -1, kv_b.shape[1])[:, :nope]
        ref = torch.einsum("nhp,hpl->nhl", q.float(), w_uk)
        self.pairs.append(("AbsorbedQuery", self.name, y, ref))
        return y

    def __call__(self, x, *args, **kw):
        if type(self.op).__name__ == "KdaDecode":
            return self._kda(x, *args, **kw)
        if type(self.op).__name__ == "KpoolWrite":
            return self._kpool(x, *args, **kw)
        if type(self.op).__name__ == "LatentWrite":
            return self._latent(x, *args)
        if type(self.op).__name__ == "IndexerTopk":  # the selection: the same tokens
            y = self.op(x, *args, **kw)
            op = self.op
            ref = index_topk_ref(x, *args, topk=op.topk, kpool=op.kpool, tail=op.tail,
                                 width=op.width)  # fmt: skip
            self.pairs.append(("IndexerTopk", self.name, y.long(), ref))
            return y
        if type(self.op).__name__ == "SparseMlaDecode":
            y = self.op(x, *args, **kw)
            ref = sparse_mla_decode_ref(x, *args, self.op.w_uv, self.op.scale)
            self.pairs.append(("SparseMlaDecode", self.name, y, ref))
            return y
        if type(self.op).__name__ == "MoeLayer":
            return self._moe(x)
        y = self.op(x)
        routes, self.rank.routes = self.rank.routes, {}  # the stock op, this once
        try:
            if self.name.endswith(".indexer.inputs"):  # wk | gate | weights_proj, FP32 sums
                p = self.name.removesuffix("inputs")
                parts = ("wk.weight", "index_kpool_compress_gate", "weights_proj.weight")
                ref = torch.cat([torch.nn.functional.linear(x.float(), self.rank.w[p + n].float())
                                 for n in parts], dim=-1)  # fmt: skip
                self.pairs.append(("IndexerInputs", self.name, y, ref))
                return y
            if self.name.endswith(".q_b_wq_b"):  # q_b | the indexer's wq_b, of one input
                p = self.name.removesuffix("q_b_wq_b")
                ref = torch.cat([self.rank.linear(x, p + n) for n in
                                 ("q_b_proj.weight", "indexer.wq_b.weight")], dim=-1)  # fmt: skip
            elif self.name.endswith(".f_b_g_b_proj"):  # two blocks: f_b on f_a, g_b on g_a
                p, k = self.name.removesuffix("f_b_g_b_proj"), self.op.k
                f = self.rank.linear(x[:, :k], p + "forget_gate.f_b_proj.weight")
                ref = torch.cat([f, self.rank.linear(x[:, k:], p + "g_b_proj.weight")], dim=-1)
            elif self.name.endswith(".gate.weight"):
                ref = torch.nn.functional.linear(x.float(), self.rank.w[self.name].float())
            elif self.name.endswith(".weight"):
                ref = self.rank.linear(x, self.name)
            else:
                ref = self.rank._swiglu_mlp(self.name, x)
        finally:
            self.rank.routes = routes
        self.pairs.append((type(self.op).__name__, self.name, y, ref))
        return y

    def _moe(self, x):
        """The whole MoE layer ("layers.{i}.mlp"). Its router's logits against the stock
        router's (Router), the experts it picked from them against route_ref's pick from the
        same logits and the weights' correction bias (Routing: tie-tolerant, as the kernel
        tests check it), and its output against the stock experts + shared expert on the
        kernel's own routing (MoeLayer), so that an expert chosen either way from a near tie
        is no error while a wrong pick, weight or row is."""
        seen, saved = [], {}
        for experts in set(self.op.experts.values()):  # the call's routing, as it ran
            saved[experts] = vars(experts).get("_run")
            experts._run = recording(experts._run, seen)
        try:
            y = self.op(x)
        finally:
            for experts, run in saved.items():
                if run is None:
                    del experts._run
                else:
                    experts._run = run
        ((logits, rows),) = seen
        rank, p = self.rank, self.name
        routes, rank.routes, rank.shadowing = rank.routes, {}, True  # the stock ops, this once
        try:
            stock_logits = torch.nn.functional.linear(x.float(), rank.w[f"{p}.gate.weight"].float())
            routed = rank.experts(f"{p}.experts", x, rows.ids.long(), rows.weights)
            ref = routed.to(x.dtype) + rank._swiglu_mlp(f"{p}.shared_experts", x)
        finally:
            rank.routes, rank.shadowing = routes, False
        bias, g = rank.w[f"{p}.gate.e_score_correction_bias"], rank.g
        self.pairs.append(("Router", p, logits, stock_logits))
        self.pairs.append(("Routing", p, (logits, rows.ids, rows.weights),
                           (bias, g.num_experts_per_tok, g.routed_scaling_factor)))  # fmt: skip
        self.pairs.append(("MoeLayer", p, y, ref))
        return y

    def _kpool(self, k, gate, q, tail, pages, block_table, positions, tail_rows):
        """The pool write on the caches, `kpool_write_ref` on copies taken before: the ring
        (raw copies: exact), the pool keys and the queries as values (an FP8 code may land
        on its neighbour where a BF16 rounding upstream did: 2^-4, as the FP8 MLPs)."""
        op, tail_ref, pages_ref = self.op, tail.clone(), pages.clone()
        q8, qs = op(k, gate, q, tail, pages, block_table, positions, tail_rows)
        ring = "KpoolTail"
        if op.key_norm is not None:  # the projection's sums: normed and rounded in the write
            k, gate = index_keys_ref(k, gate, *op.key_norm)
            ring = "KpoolTailNormed"
        q8_ref, qs_ref = kpool_write_ref(k, gate, q, tail_ref, pages_ref, op.ape, block_table,
                                         positions, tail_rows, op.block_size)  # fmt: skip
        self.pairs.append(("KpoolQueries", self.name, q8.float() * qs[..., None],
                           q8_ref.float() * qs_ref[..., None]))  # fmt: skip
        self.pairs.append((ring, self.name, tail.clone(), tail_ref))
        keys = [unpack_kpool_pages_ref(x[1:]) for x in (pages, pages_ref)]  # not the null block
        values = [kk.float() * sc[..., None] for kk, sc in keys]
        self.pairs.append(("KpoolPages", self.name, *values))
        return q8, qs

    def _latent(self, q_a, kv_a, latent, slots):
        """The input norms and latent write on the cache, `latent_write_ref` on a copy taken
        before: the normed q_a and the latent rows written."""
        op, latent_ref = self.op, latent.clone()
        y = op(q_a, kv_a, latent, slots)
        ref = latent_write_ref(q_a, kv_a, op.q_norm, op.kv_norm, op.eps, latent_ref, slots)
        self.pairs.append(("LatentQuery", self.name, y, ref))
        self.pairs.append(("LatentRows", self.name, latent[slots], latent_ref[slots]))
        return y

    def _kda(self, qkv, f, b, gate, conv, rec, **place):
        """The fused KDA step on the caches, `kda_decode_ref` on copies taken before: the
        rows and the recurrent state each wrote (the conv state moves raw inputs: exact)."""
        op, conv_ref, rec_ref = self.op, conv.clone(), rec.clone()
        out = place.pop("out", None)
        y = op(qkv, f, b, gate, conv, rec, **place, out=out)
        if op.low_rank:  # f_a and g_a: the reference takes the stock linears' up-projections
            f, gate = (
                torch.nn.functional.linear(f, op.f_b),
                torch.nn.functional.linear(gate, op.g_b),
            )
        ref = kda_decode_ref(qkv, f, b, gate, conv_ref, rec_ref, op.conv_weight, op.dt_bias,
                             op.A_log, op.norm_weight, **place, lower_bound=op.lower_bound,
                             eps=op.eps)  # fmt: skip
        self.pairs.append(("KdaDecode", self.name, y, ref))
        self.pairs.append(("KdaState", self.name, rec.clone(), rec_ref))
        self.pairs.append(("KdaConv", self.name, conv.clone(), conv_ref))
        return y


def record_choices(model) -> None:
    """From now on each rank of `model` logs the choices its steps make, in call order, to
    `rank.choices`: every MoE layer's expert set per token ("layers.{i}.mlp", ids sorted,
    from the stock router + route_ref or from the MoE stage's kernel) and every indexer's
    selection ("layers.{i}.indexer", token indices). Two models whose logs agree took the
    same discrete path through a step; only then are their outputs comparable: a near tie
    chosen either way by rounding moves a token's output O(1)."""
    for rank in model.ranks:
        rank.choices = []
        experts, indexer = rank.experts, rank.indexer

        def logged_experts(prefix, x, ids, weights, rank=rank, experts=experts):
            if not getattr(rank, "shadowing", False):  # not a Shadow's stock call
                rank.choices.append((prefix.rsplit(".", 1)[0], ids.long().sort(-1).values))
            return experts(prefix, x, ids, weights)

        def logged_indexer(layer, *args, rank=rank, indexer=indexer):
            topk = indexer(layer, *args)
            rank.choices.append((f"layers.{layer}.indexer", topk.long()))
            return topk

        rank.experts, rank.indexer = logged_experts, logged_indexer


def record_stage_choices(stages, model) -> None:
    """From now on each MoE stage op of `stages` (a LayerStages over `model`) logs the experts
    its kernel picked to its rank's `choices` (`record_choices`: the stock path's), under the
    layer's name, whether it finalizes or hands its rows to a boundary; each selection stage
    op the tokens it selected, under the layer's indexer's name."""
    done = set()
    for routes in stages.routes.values():
        for j, (s, name, op) in enumerate(routes):
            inner = getattr(op, "op", op)  # under a Shadow
            if type(inner).__name__ == "IndexerTopk":
                layer = name.removesuffix(".self_attn.indexer.topk")
                routes[j] = (s, name, _LoggedSelection(op, model.ranks[s], f"{layer}.indexer"))
            if type(inner).__name__ != "MoeLayer":
                continue
            for experts in inner.experts.values():
                if id(experts) not in done:
                    done.add(id(experts))
                    experts._run = _logged_run(experts._run, model.ranks[s], name)


class _LoggedSelection:
    """A selection stage op (or its Shadow) that logs each call's tokens to `rank.choices`."""

    def __init__(self, op, rank, name):
        self.op, self.rank, self.name = op, rank, name

    def __getattr__(self, name):
        return getattr(self.op, name)

    def __call__(self, *args, **kw):
        y = self.op(*args, **kw)
        if hasattr(self.rank, "choices"):
            self.rank.choices.append((self.name, y.long()))
        return y


def _logged_run(run, rank, name):
    def logged(x, m, logits, ids, weights, **kw):
        rows, out = run(x, m, logits, ids, weights, **kw)
        if hasattr(rank, "choices"):
            rank.choices.append((name, rows.ids.long().sort(-1).values))
        return rows, out

    return logged


def follow_choices(model, leader) -> None:
    """From now on `model`'s steps make the discrete choices `leader`'s last step logged
    (`record_choices`), call by call (leader's step first): each MoE layer's experts, with
    the route weights from `model`'s own logits as route_ref forms them, and each indexer's
    selection (the indexer still runs and writes its caches). For a noise yardstick: the
    same discrete path in another precision, all of its rounding and none of its ties."""
    for rank, lead in zip(model.ranks, leader.ranks, strict=True):
        rank.choices, seen = [], {}
        router, experts, indexer = rank.router, rank.experts, rank.indexer

        def led(name, rank=rank, lead=lead):
            i = sum(n == name for n, _ in rank.choices)
            picks = [x for n, x in lead.choices if n == name]
            assert i < len(picks), f"{name}: the leader made no such choice"
            rank.choices.append((name, picks[i]))
            return picks[i]

        def led_router(name, x, seen=seen, router=router):
            seen["logits"] = router(name, x)
            return seen["logits"]

        def led_experts(prefix, x, ids, weights, rank=rank, experts=experts, seen=seen, led=led):
            ids = led(prefix.rsplit(".", 1)[0]).to(ids.device)
            s = torch.sigmoid(seen["logits"].float()).gather(1, ids)
            weights = s / (s.sum(-1, keepdim=True) + 1e-20) * rank.g.routed_scaling_factor
            return experts(prefix, x, ids, weights)

        def led_indexer(layer, *args, indexer=indexer, led=led):
            topk = indexer(layer, *args)
            return led(f"layers.{layer}.indexer").to(topk.device, topk.dtype).view_as(topk)

        rank.router, rank.experts, rank.indexer = led_router, led_experts, led_indexer


def agreeing(a, b, requests: int) -> torch.Tensor:
    """[requests] bool: the requests for which two models' logged choices (`record_choices`)
    since the last `clear_choices` agree — the same experts for each of the request's tokens
    in every MoE layer, the same selection in every indexer. Requests are independent within
    a step (each reads only its own caches), so an agreeing request's rows are comparable
    even where another request's near tie went the other way. The same calls on both sides."""
    return agreeing_logs(*(choices(m) for m in (a, b)), requests)


def choices(model) -> list:
    """The model's logged choices (`record_choices`), its ranks' in rank order."""
    return [c for rank in model.ranks for c in rank.choices]


def agreeing_logs(a: list, b: list, requests: int) -> torch.Tensor:
    """`agreeing` on two logs (`choices`): under CUDA graphs, those a capture recorded,
    whose tensors each replay refreshes."""
    assert [n for n, _ in a] == [n for n, _ in b], "the models ran different calls"
    same = torch.ones(requests, dtype=torch.bool)
    for (_, x), (_, y) in zip(a, b, strict=True):
        # Per request, its tokens' rows; where one side ran fewer rows (an MTP draft prefill
        # passes only each request's last row past the attention), its last ones.
        x, y = (t.reshape(requests, -1, t.shape[-1]) for t in (x, y.to(x.device)))
        rows = min(x.shape[1], y.shape[1])
        same &= (x[:, -rows:] == y[:, -rows:]).flatten(1).all(-1).cpu()
    return same


def agreeing_tokens(a: list, b: list, requests: int, tokens: int) -> torch.Tensor:
    """[requests, tokens] bool: the tokens whose own and earlier tokens' (of the request)
    logged choices agree. Within a request a token reads only its own and the earlier
    tokens' rows (causal attention and key pools, per-token MoE and mHC), so such a token's
    hidden state is comparable even where a later one's near tie went the other way: at
    q = 8 a whole request agrees in every MoE layer of its 8 tokens in 3 % of the steps (the
    H200 sweep at 1f2c080), its first tokens far more often."""
    assert [n for n, _ in a] == [n for n, _ in b], "the models ran different calls"
    same = torch.ones(requests, tokens, dtype=torch.bool)
    for (_, x), (_, y) in zip(a, b, strict=True):
        x, y = (t.reshape(requests, -1, t.shape[-1]) for t in (x, y.to(x.device)))
        rows = min(x.shape[1], y.shape[1])  # fewer: the last tokens' rows (agreeing_logs)
        same[:, tokens - rows :] &= (x[:, -rows:] == y[:, -rows:]).all(-1).cpu()
    return same.cumprod(dim=1).bool()


def rel_rows(a, b, row_dims: int = 1) -> torch.Tensor:
    """Relative L2 distance of each row of a from b's (a row: the last `row_dims` dims; a
    token's hidden state, a cache slot), in FP64, flattened; equal zero rows: no error."""
    a, b = (t.double().flatten(end_dim=-row_dims - 1).flatten(1) for t in (a, b))
    num = (a - b).norm(dim=1)
    return torch.where(num == 0, 0.0, num / b.norm(dim=1))


def clear_choices(*models) -> None:
    for m in models:
        for rank in m.ranks:
            rank.choices.clear()


CACHES = ("conv", "recurrent", "latent", "tail", "kpool")
SLOT_DIMS = {"recurrent": 3, "latent": 1, "tail": 1, "conv": 2}  # compared caches: a slot's dims


def copy_caches(dst, src) -> None:
    """Every cache of `src`'s ranks into `dst`'s (after a step whose choices differed: the
    next step starts both from the same state)."""
    for a, b in zip(dst.ranks, src.ranks, strict=True):
        for kind in CACHES:
            for layer, cache in getattr(a.c, kind).items():
                cache.copy_(getattr(b.c, kind)[layer])


def written(step, kind: str, r: int) -> torch.Tensor:
    """The rows of cache `kind` that request r's step writes (`Placement`'s slots): its KDA states
    kept, its conv row, its tokens' latent slots, its indexer ring."""
    if kind == "recurrent":
        slots = step.write_slots[r]
        return slots[slots >= 0].long()
    one = {"conv": step.conv_slots, "tail": step.tail_rows}.get(kind)
    return one[r : r + 1].long() if one is not None else step.slots[r].long()


class Yardstick:
    """Per-row errors of the specialized model's steps against stock, beside the noise
    yardstick measured in the same run: the stock BF16 model's errors against the same model
    in FP32, whose rounding differs from stock's as much as the specialized op order does.

    Every step starts all models from the stock model's caches (`start`), so each step's
    errors are its own. The FP32 model follows the stock model's discrete choices
    (`follow_choices`), so every row measures rounding. Per step (`compare`), a request's
    rows count only where the specialized model made the same choices as stock for it
    (`agreeing`): each token's hidden state and logits as a row; the caches per slot where
    every request agreed. `check` holds the worst specialized row of each kind to MARGIN x
    the worst yardstick row of that kind. MARGIN 2: the specialized and stock sides both
    round (their BF16 outputs and caches) where the FP32 yardstick rounds once, so two
    roundings apart where it is one; a semantic slip (a wrong expert, weight or row) moves a
    row by O(1), 5x the bound and more."""

    MARGIN = 2.0

    def __init__(self, stock, spec, fp32, stages=()):
        """`stages`: the LayerStages (decode, draft) over `spec` whose MoE stages choose."""
        self.models = (stock, spec, fp32)
        self.worst = {"spec": {}, "noise": {}}
        self.rows = self.compared = self.cache_steps = 0
        record_choices(stock)
        record_choices(spec)
        for st in stages:
            record_stage_choices(st, spec)
        follow_choices(fp32, stock)

    def start(self):
        """Before a step: the other models' caches from stock's, the choice logs cleared."""
        stock, spec, fp32 = self.models
        copy_caches(spec, stock)
        copy_caches(fp32, stock)
        clear_choices(*self.models)

    def _worse(self, side, kind, errors):
        if errors.numel():
            w = self.worst[side]
            w[kind] = max(w.get(kind, 0.0), errors.max().item())

    def compare(self, h_stock, h_spec, h_fp32, logits=None, step=None):
        """After a step: hidden states [R, T, D] of each model (and (spec, stock, fp32)
        logits [R * T, V]); `step`: the stock model's placement, whose slots tell each
        request's cache rows (None: the caches where every request agreed)."""
        stock, spec, fp32 = self.models
        requests = h_stock.shape[0]
        ok = agreeing(stock, spec, requests)
        assert agreeing(stock, fp32, requests).all()  # it follows
        self.rows += h_stock[..., 0].numel()
        self.compared += h_stock[ok][..., 0].numel()
        self._worse("spec", "hidden", rel_rows(h_spec[ok], h_stock[ok]))
        self._worse("noise", "hidden", rel_rows(h_fp32, h_stock))
        if logits is not None:
            a, b, c = (x.reshape(requests, -1, x.shape[-1]) for x in logits)
            self._worse("spec", "logits", rel_rows(a[ok], b[ok]))
            self._worse("noise", "logits", rel_rows(c, b))
        for side, model, mine in (("spec", spec, ok), ("noise", fp32, torch.ones_like(ok))):
            if step is None and not mine.all():
                continue
            picked = range(requests) if step is None else mine.nonzero()[:, 0].tolist()
            self.cache_steps += len(picked) if side == "spec" else 0
            for a, b in zip(model.ranks, stock.ranks, strict=True):
                for kind, dims in SLOT_DIMS.items():
                    for layer, cache in getattr(b.c, kind).items():
                        got = getattr(a.c, kind)[layer]
                        if step is not None:  # the rows the picked requests wrote
                            rows = [written(step, kind, r) for r in picked]
                            rows = torch.cat(rows) if rows else rows
                            if kind == "latent":
                                got, cache = got.flatten(0, 1), cache.flatten(0, 1)
                            got, cache = got[rows], cache[rows]
                        self._worse(side, kind, rel_rows(got, cache, dims))

    def check(self, min_compared=0.5):
        """Each kind's worst specialized row within MARGIN x its worst yardstick row; at
        least `min_compared` of the rows compared and one request's caches."""
        spec, noise = self.worst["spec"], self.worst["noise"]
        summary = {k: f"{v:.2e} (noise {noise.get(k, float('nan')):.2e})" for k, v in spec.items()}
        print(f"worst per row, specialized vs stock: {summary}; rows compared "
              f"{self.compared} of {self.rows}")  # fmt: skip
        assert self.compared >= min_compared * self.rows, summary
        assert self.cache_steps and set(spec) == set(noise), summary
        for kind, err in spec.items():
            assert err <= self.MARGIN * noise[kind], (kind, summary)


def shadow(stages, model, pairs) -> set[str]:
    """Wrap every route of `stages` (a LayerStages over `model`) in a Shadow; the names."""
    for b, routes in stages.routes.items():
        stages.routes[b] = [(s, n, Shadow(op, model.ranks[s], n, pairs)) for s, n, op in routes]
    return {name for routes in stages.routes.values() for _, name, _ in routes}


def check_calls(pairs, worst=None) -> None:
    """Every recorded call's worst row within its bound, every MoE routing route_ref's; the
    worst row error per kind into `worst`."""
    assert pairs, "no stage op ran"
    for _, name, got, (bias, k, scaling) in (p for p in pairs if p[0] == "Routing"):
        logits, ids, weights = got
        try:
            assert_routing(logits, bias, k, scaling, ids, weights)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None
    pairs = [p for p in pairs if p[0] != "Routing"]
    rows = [rel_rows(y.reshape(y.shape[0], -1), ref.reshape(ref.shape[0], -1)).max()
            for _, _, y, ref in pairs]  # fmt: skip
    errors = torch.stack(rows).tolist()  # one sync
    for (kind, name, y, ref), err in zip(pairs, errors, strict=True):
        if worst is not None:
            worst[kind] = max(worst.get(kind, 0.0), err)
        if not err <= CALL_BOUND.get(kind, 0.0):  # NaN fails too; KdaConv: exact
            nans = (y.isnan().any().item(), ref.isnan().any().item())
            raise AssertionError((kind, name, err, "NaN in (op, stock):", nans))


# Ops that read a device value on the host: a CUDA-graph capture fails on each (the GPU
# suite captures every planned step with the shadows' reference ops inside it).
HOST_READS = {"_local_scalar_dense", "nonzero", "masked_select", "equal", "is_nonzero",
              "_unique", "_unique2", "unique_dim", "unique_consecutive"}  # fmt: skip


class NoHostRead(TorchDispatchMode):
    """Fails on the first op that reads a device value on the host, as a capture would: one
    of HOST_READS, or indexing by a boolean mask (its nonzero is below the dispatcher). On
    CPU what a capture alone would refuse is found before a GPU runs it."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        masks = name in ("index", "index_put", "index_put_", "_index_put_impl_") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ())
        )  # fmt: skip
        if name in HOST_READS or masks:
            raise AssertionError(f"{func} reads a device value on the host: a CUDA-graph "
                                 "capture would fail here")  # fmt: skip
        return func(*args, **(kwargs or {}))


def capturing_everywhere(monkeypatch) -> None:
    """`capturing()` true in every glm5 module that imported it (each op skips the input
    checks that read values, as inside a capture)."""
    from glm5_kernels.launch import capturing

    for name, module in list(sys.modules.items()):
        if name.startswith("glm5_") and getattr(module, "capturing", None) is capturing:
            monkeypatch.setattr(module, "capturing", lambda: True)
