"""The specialized decode over a backbone: one routing decision per step (`plan`), then
every layer's stages in one loop, captured once per token count in a FULL CUDA graph.

Stages come from the policy per stage and token count. The whole-sublayer stages are run
by the layer loop itself (`mlp`, `attention`; each shard's ops on the sublayer's input, the
partial outputs summed by the backbone's `all_reduce`); the others stand in for one stock
GEMM (or the shared expert's MLP) of the backbone through its routes (by weight name or
module prefix) while a planned step of a token count they serve runs, inside a sublayer no
whole-sublayer stage serves:
  * `dense_mlp` (`DenseMlp`) and `moe`, whole sublayers: the block-FP8 SwiGLU MLP, and the
    whole MoE layer (router, routing, routed + shared experts, summed) as one `MoeLayer` in
    four launches, its experts `MegaExperts` (`per_route`) or `GroupedExperts` (`grouped`)
    per token count, or three (`fused_router`: per_route's, the router GEMM inside the
    routing launch); the `router` and `shared_expert` stages serve only the token counts it
    does not (where it cannot build, its whole sublayer runs stock);
  * `kda`, a whole sublayer (`sublayers.kda_attention`): each KDA layer's fused projection,
    f_b / g_b, conv -> gates -> delta rule -> gated norm as one `KdaDecode` launch, and
    o_proj, on the backbone's KDA caches at the step's neutral placement;
  * `dsa_attn`, `dsa_kpool` and `dsa_indexer` together, a whole sublayer
    (`sublayers.mla_attention`): each MLA layer's fused q_a | kv_a projection, input norms
    and latent write (`LatentWrite`), q_b, the query absorption and the attention over the
    indexer's selection with its value-up (`SparseMlaDecode`), o_proj (`dsa_attn`); a full
    indexer's key | gate | head-weight projection and pool write (`KpoolWrite`: `dsa_kpool`)
    and selection (`IndexerTopk`: `dsa_indexer`); a shared-indexer layer reuses the last
    full layer's selection;
  * glm5-kernels' skinny GEMMs where no whole sublayer serves: `dsa_proj` (the MLA q_a /
    kv_a / q_b / o_proj and indexer wq_b projections; one op over a fused q_a | kv_a weight
    where the backbone holds one), `kda_proj` (KDA q / k / v and o_proj), `router` (the MoE
    gate, FP32 logits), and the shared expert's block-FP8 SwiGLU MLP (`shared_expert`:
    `SharedExpert`).
The others are called by the decode itself: `embed` (the token embedding, `Embedding`: each
shard's vocab-parallel rows in one launch), `logits_head` (the skinny LM head of
`compute_logits`), `logits_gather` (the logits' all-gather through mailboxes where the vocab
shards live in other processes) and `boundary`, which replaces the loop's mHC boundaries
(post, pre, norm: dozens of stock kernels each) with one `MhcBoundary` kernel each: the first
expands the embedding into the streams, the last takes the streams' mean and the final norm.
Sublayer outputs are reduced by the backbone before it, unless the TP ranks live in other
processes and the backbone gives a mailbox over them: then sublayers leave their outputs
TP-partial (`partial`) and each boundary is glm5-comm's `AllReduceBoundary`, the all-reduce
and the boundary in one launch. A stage that cannot be built or compiled logs one warning
and its ops stay stock.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from glm5_comm import AllReduceBoundary, LogitsGather, MailboxWatch
from glm5_kernels.dsa import IndexerTopk, KpoolWrite, LatentWrite, SparseMlaDecode
from glm5_kernels.embed import Embedding
from glm5_kernels.gemm import DenseMlp, Projection, Router
from glm5_kernels.kda import KdaDecode
from glm5_kernels.mhc import MhcBoundary
from glm5_kernels.moe import GroupedExperts, MegaExperts, MoeLayer, SharedExpert
from glm5_kernels.quant import dequantize_fp8_block_ref
from glm5_policy import DecodeConfig, Policy

from .plan import Plan, Step, StepContext, plan
from .protocol import Backbone
from .sublayers import (
    GATES_B,
    INDEXER_PARTS,
    KDA_PARTS,
    MLA_PARTS,
    Q_B_WQ_B,
    kda_attention,
    mla_attention,
)

__all__ = ["LayerStages", "SpecializedDecode"]

logger = logging.getLogger("glm5_runtime")

DSA_PROJECTIONS = ("q_a_proj", "kv_a_proj_with_mqa", "q_b_proj", "o_proj", "indexer.wq_b")
KDA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
KDA_CORES = ("fused", "fused_gates")  # the `kda` choices: the whole KDA sublayer a stage
MLA_STAGES, MLA_CHOICES = ("dsa_attn", "dsa_kpool", "dsa_indexer"), ("sparse", "fused", "fused")


def _gate_projections(f_b: Tensor, g_b: Tensor, tokens: list[int]) -> Projection | None:
    """The KDA gates' up-projections f_b and g_b as one two-block `Projection` (their inputs
    f_a | g_a are adjacent columns of the fused input projection's output; a copy of both
    weights, 2 x 0.5 MB a layer at TP 4), None where their shapes differ or the tiles would
    straddle the blocks (then two launches)."""
    if f_b.shape != g_b.shape or f_b.dtype != g_b.dtype:
        return None
    try:
        return Projection(torch.cat([f_b, g_b]), tokens, blocks=2)
    except ValueError:
        return None


def _stacked_projection(q_b: Tensor, wq_b: Tensor | None, tokens: list[int]):
    """A full indexer layer's q_b and wq_b (both of q_resid) as one `Projection` reading both
    weights in place (one launch, one wave over the SMs where each alone fills about half),
    None without wq_b or where a column tile would straddle the two (then two launches)."""
    if wq_b is None or q_b.shape[1] != wq_b.shape[1] or q_b.dtype != wq_b.dtype:
        return None
    try:
        return Projection(q_b, tokens, then=wq_b)
    except ValueError:
        return None


def _stacked(a: Tensor, b: Tensor) -> Tensor:
    """[a; b] along rows, as the MLP kernels read gate | up: a view where b's rows follow a's
    in one tensor (vLLM's merged gate_up_proj and its scales), else a copy (the checkpoint
    keeps them apart). The view saves a second copy of every gate_up weight (~1 GB at TP 1)."""
    follows = b.data_ptr() == a.data_ptr() + a.numel() * a.element_size()
    if (
        a.is_contiguous() and b.is_contiguous() and a.dtype == b.dtype and follows
        and a.shape[1:] == b.shape[1:]
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    ):  # fmt: skip
        return a.as_strided((a.shape[0] + b.shape[0], *a.shape[1:]), a.stride())
    return torch.cat([a, b])


class LayerStages:
    """The stages of a set of layers (the backbone's, or the MTP draft's) per token count."""

    def __init__(self, backbone: Backbone, policy: Policy, batches: Sequence[int], layers):
        self.backbone, self.policy = backbone, policy
        self.batches = sorted(batches)
        self.layers = list(layers)
        # token count -> [(shard, stock op name, stage op)] of that count's steps: installed
        # in the backbone while a step runs, but for the names in that count's `sublayers`
        # (a whole sublayer's parts, e.g. the MLP stages' `layers.{i}.mlp`), which the layer
        # loop calls itself. Per count: a name may be a sublayer's part at one count and a
        # route at another (KDA's o_proj: the `kda` stage's at 1-16, `kda_proj`'s above).
        self.routes: dict[int, list[tuple[int, str, Any]]] = {b: [] for b in self.batches}
        self.sublayers: dict[int, set[str]] = {b: set() for b in self.batches}
        self._serving: dict[tuple[int, str], Any] = {}  # `installed`: the sublayers' ops
        # The step's last full indexer selection per shard, for the shared-indexer layers.
        self._selections: dict[int, Tensor] = {}
        self.ops: list[tuple[Any, list[int]]] = []  # (op, its token counts) to prepare
        self.stage_of: dict[int, str] = {}  # id(op) -> its policy stage
        # Stages the policy picks only at token counts a whole-sublayer stage serves (so
        # they serve none): stage -> which one, and where. Not an error; `tune` reports it.
        self.unserved: dict[str, str] = {}
        # Where the MLA stages all serve a token count, the MLA sublayer is theirs,
        # projections included (`mla_counts`); `dsa_proj` serves only the other counts.
        self.mla_counts = self._mla_counts()
        self._build("dsa_proj", self._projections("mla", DSA_PROJECTIONS), skip=self.mla_counts,
                    served_by="the MLA sublayer stages")  # fmt: skip
        # Where `kda` serves a token count the KDA sublayer is its own, projections included.
        sublayer = {b for b in self.batches if self.policy("kda", b) in KDA_CORES}
        self._build("kda_proj", self._projections("kda", KDA_PROJECTIONS), skip=sublayer,
                    served_by="kda (the whole KDA sublayer)")  # fmt: skip
        # Where `moe` serves a token count it is the whole layer, its router and shared
        # expert inside its own launches: their stages serve the other counts only.
        layer = {b for b in self.batches if self.policy("moe", b)}
        moe = "moe (the whole MoE layer)"
        self._build("router", self._routers, skip=layer, served_by=moe)
        self._build("shared_expert", self._mlps("moe", "mlp.shared_experts", SharedExpert),
                    skip=layer, served_by=moe)  # fmt: skip
        self._build("dense_mlp", self._mlps("dense", "mlp", DenseMlp, sublayer=True))
        self._build("moe", self._moe)
        self._build("kda", self._kda, choice=KDA_CORES)
        others = [b for b in self.batches if b not in self.mla_counts]
        self._build("dsa_attn", self._dsa_attn, choice="sparse", skip=others)
        self._build("dsa_kpool", self._dsa_kpool, choice="fused", skip=others)
        self._build("dsa_indexer", self._dsa_indexer, choice="fused", skip=others)
        # The token embedding: each shard's vocab-parallel rows in one launch.
        self.embedding: dict[int, list[Embedding]] = {}
        self._build("embed", self._embeddings, choice="gather")

    def _mla_counts(self) -> frozenset[int]:
        """The token counts whose MLA sublayers are stage objects: where `dsa_attn`,
        `dsa_kpool` and `dsa_indexer` all serve (the attention reads the indexer's selection,
        which reads the pools the write keeps). One warning where a policy picks some of
        them only: there MLA runs stock."""
        picks = {b: [self.policy(s, b) for s in MLA_STAGES] for b in self.batches}
        counts = frozenset(b for b, p in picks.items() if p == list(MLA_CHOICES))
        partial = [b for b, p in picks.items() if b not in counts and any(p)]
        if partial and any(x.attention == "mla" for x in self.layers):
            logger.warning("Specialized decode: %s serve the MLA sublayer together; at %s "
                           "tokens the policy picks some of them only, and MLA runs stock",
                           ", ".join(MLA_STAGES), partial)  # fmt: skip
        return counts

    def _build(self, stage: str, build: Callable[[list[int]], None], choice=None,
               skip=frozenset(), served_by: str | None = None) -> None:  # fmt: skip
        """Build one stage for the token counts the policy gives it (`choice`: only those
        that pick it, or one of a tuple; none in `skip`, which `served_by` serves); on
        failure, one warning and the stage's ops stay stock."""
        chosen = (choice,) if isinstance(choice, str) else choice
        picked = [(b, self.policy(stage, b)) for b in self.batches]
        picked = [b for b, c in picked if (c in chosen if chosen else c)]
        tokens = [b for b in picked if b not in skip]
        if not tokens:
            if picked and served_by:
                self.unserved[stage] = f"{served_by} serves its token counts {picked}"
            return
        routes, ops = {b: list(r) for b, r in self.routes.items()}, list(self.ops)
        sublayers = {b: set(names) for b, names in self.sublayers.items()}
        try:
            build(tokens)
        except Exception as e:  # any kernel build problem: the stock op is always right
            self.routes, self.ops, self.sublayers = routes, ops, sublayers
            error = f"{type(e).__name__}: {e}"
            logger.warning("Specialized decode: stage %s runs stock (%s)", stage, error)
            return
        for op, _ in self.ops[len(ops) :]:  # what `build` added is this stage's
            self.stage_of[id(op)] = stage

    def _add(self, op: Any, tokens: list[int], shard: int | None, name: str | None,
             sublayer: bool = False) -> None:  # fmt: skip
        """Register a stage op (for `name` of `shard`, unless None: routed, or where
        `sublayer`, the whole sublayer `name` the layer loop calls it for)."""
        self.ops.append((op, tokens))
        if name is not None:
            for b in tokens:
                self.routes[b].append((shard, name, op))
                if sublayer:
                    self.sublayers[b].add(name)

    def _projections(self, kind: str, names: Sequence[str]):
        # Where the backbone holds projections this stage serves in one fused weight (vLLM),
        # one op serves it whole: one launch instead of one per part, and no concatenation.
        fused = {f: p for f, p in self.backbone.fused_projections.items() if set(p) <= set(names)}

        def build(tokens: list[int]) -> None:
            for layer in (x for x in self.layers if x.attention == kind):
                for shard in self.backbone.shards:
                    served: set[str] = set()
                    for n in (*fused, *names):
                        if n in served:
                            continue
                        name = f"layers.{layer.index}.self_attn.{n}.weight"
                        w = self.backbone.weight(shard, name)
                        if w is not None:
                            self._add(Projection(w, tokens), tokens, shard, name)
                            served.update(fused.get(n, ()))

        return build

    def _routers(self, tokens: list[int]) -> None:
        for layer in (x for x in self.layers if x.mlp == "moe"):
            for shard in self.backbone.shards:
                name = f"layers.{layer.index}.mlp.gate.weight"
                self._add(Router(self.backbone.weight(shard, name)), tokens, shard, name)

    def _mlps(self, kind: str, prefix: str, cls, sublayer: bool = False):
        def build(tokens: list[int]) -> None:
            for layer in (x for x in self.layers if x.mlp == kind):
                for shard in self.backbone.shards:
                    p = f"layers.{layer.index}.{prefix}"
                    weight = self.backbone.weight
                    w = {n: weight(shard, f"{p}.{n}_proj.weight") for n in ("gate", "up", "down")}
                    s = {n: weight(shard, f"{p}.{n}_proj.weight_scale_inv") for n in w}
                    if any(t is None for t in (*w.values(), *s.values())):
                        raise ValueError(f"{p}: FP8 weights with block scales expected")
                    op = cls(
                        _stacked(w["gate"], w["up"]), _stacked(s["gate"], s["up"]),
                        w["down"], s["down"], self.backbone.swiglu_limit, self.backbone.ue8m0,
                    )  # fmt: skip
                    self._add(op, tokens, shard, p, sublayer)

        return build

    def _moe(self, tokens: list[int]) -> None:
        """Each MoE layer as one op (router, routing, routed + shared experts, summed): four
        launches (three with `fused_router`), the experts cut per the policy's choice at each
        token count."""
        b = self.backbone
        if b.routing is None:
            raise ValueError("the backbone's MoE routing is not GLM's (Backbone.routing)")
        choice = {m: self.policy("moe", m) for m in tokens}
        for layer in (x for x in self.layers if x.mlp == "moe"):
            for shard in b.shards:
                p = f"layers.{layer.index}.mlp"
                e, se = f"{p}.experts", f"{p}.shared_experts"
                names = [
                    f"{p}.gate.weight", f"{p}.gate.e_score_correction_bias",
                    f"{e}.gate_up_proj", f"{e}.gate_up_proj_scale_inv",
                    f"{e}.down_proj", f"{e}.down_proj_scale_inv",
                    *(f"{se}.{n}_proj.weight{s}" for n in ("gate", "up", "down")
                      for s in ("", "_scale_inv")),
                ]  # fmt: skip
                w = [b.weight(shard, name) for name in names]
                missing = [name for name, t in zip(names, w, strict=True) if t is None]
                if missing:
                    raise ValueError(f"{p}: no {', '.join(missing)} (block-FP8 experts expected)")
                router, bias, w13, s13, w2, s2, g, gs, u, us, d, ds = w
                shared = (_stacked(g, u), _stacked(gs, us), d, ds)
                # fused_router: per_route's experts, the router GEMM in their routing launch.
                kinds = {"per_route": MegaExperts, "grouped": GroupedExperts}
                kind_of = {m: "per_route" if c == "fused_router" else c for m, c in choice.items()}
                ops = {
                    kind: cls(
                        w13, s13, w2, s2, bias=bias, shared=shared,
                        top_k=b.routing.top_k, routed_scaling=b.routing.routed_scaling,
                        swiglu_limit=b.swiglu_limit, ue8m0=b.ue8m0,
                    )
                    for kind, cls in kinds.items() if kind in kind_of.values()
                }  # fmt: skip
                gated = [m for m, c in choice.items() if c == "fused_router"]
                op = MoeLayer(Router(router), {m: ops[c] for m, c in kind_of.items()},
                              gated=gated)  # fmt: skip
                self._add(op, tokens, shard, p, sublayer=True)

    def _kda(self, tokens: list[int]) -> None:
        """Each KDA layer's attention as one sublayer the loop runs (`attention`): the fused
        input projection, f_b and g_b (`fused`: one two-block launch) or none (`fused_gates`:
        inside the core),
        the core — conv -> gates -> delta rule -> gated norm, one `KdaDecode` launch — and
        o_proj (`sublayers.kda_attention`), on the backbone's KDA caches at the step's
        neutral placement; one core a layer for each choice the token counts take."""
        b = self.backbone
        if b.kda is None:
            raise ValueError("the backbone's KDA layers do not take the fused stage (Backbone.kda)")
        by_choice: dict[str, list[int]] = {}
        for m in tokens:
            by_choice.setdefault(self.policy("kda", m), []).append(m)
        split = by_choice.get("fused", [])
        for layer in (x for x in self.layers if x.attention == "kda"):
            for shard in b.shards:
                p = f"layers.{layer.index}.self_attn"
                small = ("conv1d.weight", "forget_gate.dt_bias", "forget_gate.A_log",
                         "o_norm.weight")  # fmt: skip
                names = [f"{p}.{n}" for n in (*small, *KDA_PARTS[:3], "o_proj.weight")]
                w = [b.weight(shard, n) for n in names]
                missing = [n for n, t in zip(names, w, strict=True) if t is None]
                if missing:
                    raise ValueError(f"no {', '.join(missing)}")
                conv, dt_bias, a_log, norm, in_proj, f_b, g_b, o_proj = w
                for choice, counts in by_choice.items():
                    gates = {"f_b": f_b, "g_b": g_b} if choice == "fused_gates" else {}
                    # A planned step holds q tokens a request (1: a decode), so the core
                    # compiles its steps of up to q, not of every T up to 8 (prepare()).
                    core = KdaDecode(
                        conv.reshape(conv.shape[0], -1), dt_bias, a_log.reshape(-1), norm,
                        lower_bound=b.kda.lower_bound, eps=b.kda.eps, max_tokens=self.q,
                        **gates,
                    )  # fmt: skip
                    self._add(core, counts, shard, f"{p}.kda", sublayer=True)
                parts = {"in_proj_qkvbfg_a.weight": (in_proj, tokens), "o_proj.weight":
                         (o_proj, tokens)}  # fmt: skip
                gates = _gate_projections(f_b, g_b, split) if split else None
                if gates is not None:  # f_b and g_b in one launch, two blocks
                    self._add(gates, split, shard, f"{p}.{GATES_B}", sublayer=True)
                elif split:
                    parts |= {"forget_gate.f_b_proj.weight": (f_b, split),
                              "g_b_proj.weight": (g_b, split)}  # fmt: skip
                for n, (weight, counts) in parts.items():
                    self._add(Projection(weight, counts), counts, shard, f"{p}.{n}",
                              sublayer=True)  # fmt: skip
                width = conv.shape[0] + a_log.numel() + f_b.shape[1] + g_b.shape[1]
                if in_proj.shape[0] != width:
                    raise ValueError(f"{p}.in_proj_qkvbfg_a.weight: {in_proj.shape[0]} rows, "
                                     f"q | k | v | b | f_a | g_a are {width}")  # fmt: skip

    def _dsa_attn(self, tokens: list[int]) -> None:
        """Each MLA layer's attention as one sublayer the loop runs (`attention`,
        `sublayers.mla_attention`): the fused q_a | kv_a projection, its input norms and
        latent write (`LatentWrite`, one launch), q_b, the query absorption and the attention
        over the indexer's selection with its value-up (`SparseMlaDecode`), o_proj; a full
        indexer layer's query projection wq_b too (its pool write and selection are the
        `dsa_kpool` and `dsa_indexer` stages')."""
        b = self.backbone
        mla = b.mla
        if mla is None or mla.norm_eps is None:
            raise ValueError("the backbone's MLA layers do not take the sublayer stage "
                             "(Backbone.mla, with the input norms' eps)")  # fmt: skip
        if "fused_qkv_a_proj" not in b.fused_projections:
            raise ValueError("the backbone holds q_a and kv_a apart: the latent write reads "
                             "them as one projection's columns")  # fmt: skip
        for layer in (x for x in self.layers if x.attention == "mla"):
            for shard in b.shards:
                p = f"layers.{layer.index}.self_attn"
                w = b.weight(shard, f"{p}.kv_b_proj.weight")
                if w is None:
                    raise ValueError(f"no {p}.kv_b_proj.weight")
                if w.dtype == torch.float8_e4m3fn:  # block-FP8: the value rows in BF16
                    scale = b.weight(shard, f"{p}.kv_b_proj.weight_scale_inv")
                    w = dequantize_fp8_block_ref(w, scale, dtype=torch.bfloat16)
                split = mla.nope_dim + mla.v_dim
                per_head = w.to(torch.bfloat16).view(w.shape[0] // split, split, w.shape[1])
                op = SparseMlaDecode(per_head[:, mla.nope_dim :], mla.scale, max_rows=max(tokens),
                                     w_uk=per_head[:, : mla.nope_dim])  # fmt: skip
                self._add(op, tokens, shard, f"{p}.dsa_attn", sublayer=True)
                norms = [b.weight(shard, f"{p}.{n}_layernorm.weight") for n in ("q_a", "kv_a")]
                if any(t is None for t in norms):
                    raise ValueError(f"no {p}.q_a_layernorm.weight / kv_a_layernorm.weight")
                op = LatentWrite(*norms, mla.norm_eps, max_rows=max(tokens))
                self._add(op, tokens, shard, f"{p}.latent", sublayer=True)
                names = ["fused_qkv_a_proj", "q_b_proj", "o_proj", "indexer.wq_b"]
                weights = {n: b.weight(shard, f"{p}.{n}.weight") for n in names}
                missing = [n for n, t in weights.items() if t is None and n != "indexer.wq_b"]
                if missing:  # (no wq_b: a shared-indexer layer)
                    raise ValueError(f"no {', '.join(f'{p}.{n}.weight' for n in missing)}")
                both = _stacked_projection(weights["q_b_proj"], weights["indexer.wq_b"], tokens)
                if both is not None:  # q_b and wq_b in one launch
                    self._add(both, tokens, shard, f"{p}.{Q_B_WQ_B}", sublayer=True)
                    names = [n for n in names if n not in ("q_b_proj", "indexer.wq_b")]
                for n in (n for n in names if weights[n] is not None):
                    self._add(Projection(weights[n], tokens), tokens, shard, f"{p}.{n}.weight",
                              sublayer=True)  # fmt: skip

    def _indexers(self, stage: str):
        """(shard, prefix, its pool bias `index_kpool_compress_ape`) of every full indexer
        layer: a shared one (no indexer weights) reuses the last full layer's selection and
        writes no pools. (The bias, not wk: vLLM keeps wk fused with weights_proj.)"""
        b = self.backbone
        if b.indexer is None:
            raise ValueError(f"the backbone's indexers do not take {stage} (Backbone.indexer)")
        for layer in (x for x in self.layers if x.attention == "mla"):
            for shard in b.shards:
                p = f"layers.{layer.index}.self_attn.indexer"
                ape = b.weight(shard, f"{p}.index_kpool_compress_ape")
                if ape is not None:
                    yield shard, p, ape

    def _dsa_kpool(self, tokens: list[int]) -> None:
        """Each full indexer layer's key, gate score and head weights as one FP32
        `Projection` over [wk; compress gate; weights_proj] (`.indexer.inputs`), and its pool
        write (ring, compressed FP8 pool keys; the key norm and BF16 roundings inside) and
        query rotation as one `KpoolWrite` launch (`.indexer.kpool`): two launches of the
        MLA sublayer for a dozen stock kernels."""
        ix = self.backbone.indexer
        if ix is not None and ix.key_norm_eps is None:
            raise ValueError("the backbone's indexers do not take one projection of wk | "
                             "compress gate | weights_proj (Indexer.key_norm_eps)")  # fmt: skip
        for shard, p, ape in self._indexers("dsa_kpool"):
            weight, norm = self._indexer_inputs(shard, p, ix.key_norm_eps)
            self._add(Projection(weight, tokens, out_dtype=torch.float32), tokens, shard,
                      f"{p}.inputs", sublayer=True)  # fmt: skip
            op = KpoolWrite(ix.heads, ix.head_dim, ape, kpool=ix.kpool, block_size=ix.block_size,
                            max_rows=max(tokens), key_norm=norm)  # fmt: skip
            self._add(op, tokens, shard, f"{p}.kpool", sublayer=True)

    def _indexer_inputs(self, shard: int, p: str, eps: float):
        """[wk; compress gate; weights_proj] as one BF16 weight (a copy: the backbone keeps
        them apart; 2.4 MB a layer) and the key norm (weight, bias, eps)."""
        names = [f"{p}.wk.weight", f"{p}.index_kpool_compress_gate", f"{p}.weights_proj.weight",
                 f"{p}.k_norm.weight", f"{p}.k_norm.bias"]  # fmt: skip
        w = [self.backbone.weight(shard, n) for n in names]
        missing = [n for n, t in zip(names, w, strict=True) if t is None]
        if missing:
            raise ValueError(f"no {', '.join(missing)}")
        parts, (norm_w, norm_b) = w[:3], w[3:]
        bad = [
            f"{n}: {t.dtype} {tuple(t.shape)}"
            for n, t in zip(names, parts, strict=False)
            if t.dtype != torch.bfloat16 or t.dim() != 2 or t.shape[1] != parts[0].shape[1]
        ]
        if bad:
            raise ValueError(f"BF16 [N, hidden] indexer projections expected: {'; '.join(bad)}")
        return torch.cat(parts), (norm_w, norm_b, eps)

    def _dsa_indexer(self, tokens: list[int]) -> None:
        """Each full indexer layer's pool scoring and top-k selection as one `IndexerTopk`
        launch of the MLA sublayer, after the pool write (`.indexer.topk`; vLLM's FP8 pages)."""
        ix = self.backbone.indexer
        for shard, p, ape in self._indexers("dsa_indexer"):
            op = IndexerTopk(ix.heads, ix.head_dim, kpool=ix.kpool, topk=ix.topk, tail=ix.tail,
                             max_rows=max(tokens), max_pools=ix.max_pools,
                             device=ape.device)  # fmt: skip
            self._add(op, tokens, shard, f"{p}.topk", sublayer=True)

    def prepare(self) -> set[str]:
        """Compile every stage op for its token counts (before any CUDA-graph capture). A
        stage whose kernels fail to compile warns once and runs stock; returns those stages."""
        failed: dict[str, str] = {}
        for op, tokens in self.ops:
            stage = self.stage_of[id(op)]
            if stage not in failed:
                try:
                    op.prepare(tokens)
                except Exception as e:  # a compile problem: the stock op is always right
                    failed[stage] = f"{type(e).__name__}: {e}"
        for stage, error in failed.items():
            logger.warning("Specialized decode: stage %s runs stock (%s)", stage, error)
        if "embed" in failed:
            self.embedding = {}
        gone = {id(op) for op, _ in self.ops if self.stage_of[id(op)] in failed}
        self.ops = [(op, t) for op, t in self.ops if id(op) not in gone]
        self.routes = {b: [r for r in rs if id(r[2]) not in gone] for b, rs in self.routes.items()}
        return set(failed)

    @contextmanager
    def installed(self, tokens: int) -> Iterator[None]:
        """The stage ops serving `tokens`-token steps stand in for their stock ops: routed
        in the backbone, or (whole sublayers) called by `mlp`."""
        parts = self.sublayers.get(tokens, set())
        routes = [r for r in self.routes.get(tokens, []) if r[1] not in parts]
        serving = {(s, n): op for s, n, op in self.routes.get(tokens, []) if n in parts}
        for shard, name, op in routes:
            self.backbone.route(shard, name, op)
        saved, self._serving = self._serving, serving
        selections, self._selections = self._selections, {}
        try:
            yield
        finally:
            self._serving, self._selections = saved, selections
            for shard, name, _ in routes:
                self.backbone.route(shard, name, None)

    def _embeddings(self, tokens: list[int]) -> None:
        b = self.backbone
        found = {s: b.embedding(s) for s in b.shards}
        if any(f is None for f in found.values()):
            raise ValueError("the backbone's embedding is not a vocab-parallel table "
                             "(Backbone.embedding)")  # fmt: skip
        ops = [Embedding(*found[s], max_tokens=max(tokens)) for s in b.shards]
        for op in ops:
            self._add(op, tokens, None, None)  # not a route: `run` calls it
        self.embedding = {m: ops for m in tokens}

    def _embed(self, tokens: Tensor, step: Step) -> Tensor:
        """The step's embeddings: the `embed` stage's where it serves the count (each shard's
        partial, summed by the backbone's `all_reduce`, or this process's partial where
        the boundaries reduce it), else the backbone's."""
        ops = self.embedding.get(step.tokens)
        if ops is None or tokens.numel() != step.tokens:
            return self.backbone.embed(tokens)
        if self.partial(step.tokens):
            (op,) = ops  # one shard a process (`_mailbox`)
            return op(tokens)
        return self.backbone.all_reduce([op(tokens) for op in ops])

    def partial(self, tokens: int) -> bool:
        """Whether sublayers leave their outputs TP-partial for a fused boundary."""
        return False

    def _mailbox(self, hidden: int, max_tokens: int, dtype=torch.int16):
        """The backbone's mailbox for an exchange stage (seam 6), None where this process
        holds every shard; an error where it holds several of a TP group across processes
        (an exchange moves one shard a process)."""
        b = self.backbone
        mailbox = b.mailbox(hidden, max_tokens, dtype)
        if mailbox is not None and len(b.shards) != 1:
            raise ValueError(f"shards {list(b.shards)} in a process of a TP group: an "
                             "exchange moves one shard a process")  # fmt: skip
        return mailbox

    def attention(self, layer, x: Tensor, placement: Any) -> Tensor:
        """The layer's attention output, reduced or, where `partial`, this process's
        TP-partial one: a KDA or MLA layer's whole sublayer where its stages serve the step,
        else the backbone's attention (projections routed per the policy)."""
        whole = self._kda_sublayer if layer.attention == "kda" else self._mla_sublayer
        out = whole(layer, x, placement)
        if out is not None:
            return out
        return self._sublayer(x, lambda s: self.backbone.attention(s, layer.index, x, placement))

    def _mla_sublayer(self, layer, x: Tensor, placement: Any) -> Tensor | None:
        """`sublayers.mla_attention` on each shard, or None where the stages do not serve this
        step (no ops installed for its count, a step the placement does not cover, caches
        they do not read, a shared-indexer layer after a stock one). A full indexer layer's
        selection is kept for the shared layers after it (`_selections`, per shard); where the
        placement carries a selection (the indexers skipped), every layer attends that."""
        b, p = self.backbone, f"layers.{layer.index}.self_attn"
        parts = (*MLA_PARTS, Q_B_WQ_B)
        ops = {s: {n: self._serving.get((s, f"{p}.{n}")) for n in parts} for s in b.shards}
        # A full indexer layer: the `dsa_attn` stage built its query projection (wq_b), apart
        # or with q_b (then neither is apart).
        full = {s: o["indexer.wq_b.weight"] is not None or o[Q_B_WQ_B] is not None
                for s, o in ops.items()}  # fmt: skip
        needed = {s: MLA_PARTS if full[s] else MLA_PARTS[: -len(INDEXER_PARTS)] for s in ops}
        for s, o in ops.items():
            if o[Q_B_WQ_B] is not None:
                needed[s] = [n for n in needed[s] if n not in ("q_b_proj.weight",
                                                               "indexer.wq_b.weight")]  # fmt: skip
        if x.dtype != torch.bfloat16 or any(
            ops[s][name] is None for s in ops for name in needed[s]
        ):
            return None
        m = x.numel() // x.shape[-1]
        place = b.mla_placement(placement, layer.index)
        if place is None:
            return None
        reuse = place.selection is not None  # the indexers skipped: the step's selection
        if not reuse and any(not full[s] and s not in self._selections for s in ops):
            return None  # a shared-indexer layer after a stock one
        caches = {s: b.mla_caches(s, layer.index) for s in b.shards}
        if any(c is None or (full[s] and not reuse and (c.pools is None or c.ring is None))
               for s, c in caches.items()):  # fmt: skip
            return None
        n = place.request.shape[0]
        if not all(op.supports(m if name.endswith(".weight") else n)
                   for o in ops.values() for name, op in o.items() if op is not None):  # fmt: skip
            return None
        rows = x.reshape(m, x.shape[-1]).contiguous()

        def shard_output(s: int) -> Tensor:
            shared = place.selection if reuse else None if full[s] else self._selections[s]
            y, self._selections[s] = mla_attention(rows, ops[s], caches[s], place, shared)
            return y.view(*x.shape[:-1], -1)

        return self._sublayer(x, shard_output, stage=True)

    def _kda_sublayer(self, layer, x: Tensor, placement: Any) -> Tensor | None:
        """`sublayers.kda_attention` on each shard, or None where the stage does not serve
        this step (no ops installed for its count, a step the placement does not cover)."""
        b, p = self.backbone, f"layers.{layer.index}.self_attn"
        ops = {s: {n: self._serving.get((s, f"{p}.{n}")) for n in KDA_PARTS} for s in b.shards}
        if x.dtype != torch.bfloat16 or any(o["kda"] is None for o in ops.values()):
            return None
        m = x.numel() // x.shape[-1]
        place = b.kda_placement(placement, layer.index)
        if place is None or not all(
            op.supports(place.write_slots.shape[1] if n == "kda" else m)
            for o in ops.values() for n, op in o.items() if op is not None
        ):  # fmt: skip
            return None
        rows = x.reshape(m, x.shape[-1]).contiguous()

        def shard_output(s: int) -> Tensor:
            y = kda_attention(rows, ops[s], *b.kda_caches(s, layer.index), place)
            return y.view(*x.shape[:-1], -1)

        return self._sublayer(x, shard_output, stage=True)

    def mlp(self, layer, x: Tensor) -> Tensor:
        """The layer's MLP output, as `attention`'s: the whole-MLP stage (dense MLP or MoE)
        where one serves the installed count, each shard's op on x's rows, else the
        backbone's MLP (its router and shared expert routed where their stages serve)."""
        name = f"layers.{layer.index}.mlp"
        ops = [self._serving.get((s, name)) for s in self.backbone.shards]
        m = x.numel() // x.shape[-1]
        if x.dtype != torch.bfloat16 or any(op is None or not op.supports(m) for op in ops):
            return self._sublayer(x, lambda s: self.backbone.mlp(s, layer.index, x))
        rows = x.reshape(m, x.shape[-1]).contiguous()
        by_shard = dict(zip(self.backbone.shards, ops, strict=True))
        return self._sublayer(x, lambda s: by_shard[s](rows).view(*x.shape[:-1], -1), stage=True)

    def _sublayer(self, x: Tensor, shard_output: Callable[[int], Tensor], stage=False) -> Tensor:
        """The shards' outputs reduced (a stage's partials by the backbone's `all_reduce`,
        its own sublayers' by `reduce`), or this process's partial where `partial`."""
        b = self.backbone
        if self.partial(x.numel() // x.shape[-1]):  # `run` holds the backbone unreduced
            (shard,) = b.shards  # `_boundaries` exchanges only one shard a process
            return shard_output(shard)
        outputs = [shard_output(s) for s in b.shards]
        return b.all_reduce(outputs) if stage else b.reduce(outputs)


class SpecializedDecode(LayerStages):
    """Built once over a backbone whose weights are loaded; reads it, never modifies it."""

    def __init__(self, backbone: Backbone, config: DecodeConfig):
        self.q = config.q
        super().__init__(backbone, config.policy, config.planned_tokens, backbone.layers)
        self.head: dict[int, list[Projection]] = {}

        def heads(tokens: list[int]) -> None:
            # FP32 logits of BF16 values, as the stock head's BF16 GEMM + cast: one launch.
            ops = [
                Projection(backbone.weight(s, "lm_head.weight"), tokens, out_dtype=torch.float32,
                           bf16_values=True)
                for s in backbone.shards
            ]  # fmt: skip
            for op in ops:
                self._add(op, tokens, None, None)  # not a route: compute_logits calls it
            self.head = {b: ops for b in tokens}

        self._build("logits_head", heads, choice="skinny")
        # The logits all-gather through mailboxes, where the vocab shards live in other
        # processes (seam 6); a process holding every shard concatenates them.
        self.logits_gather: LogitsGather | None = None
        self.gather_tokens: frozenset[int] = frozenset()
        self._build("logits_gather", self._logits_gather, choice="nvlink")
        # The mHC boundaries: one kernel object for all of them, their weights per site.
        self.mhc: MhcBoundary | None = None
        self.exchange: AllReduceBoundary | None = None  # `mhc` all-reducing partial outputs
        self.mhc_tokens: frozenset[int] = frozenset()
        self._sites: dict[tuple[int, str], tuple[Tensor, ...]] = {}
        self._build("boundary", self._boundaries)
        self.watch = MailboxWatch([])  # the exchanges' failure words (`prepare`)

    def _logits_gather(self, tokens: list[int]) -> None:
        b = self.backbone
        head = b.weight(b.shards[0], "lm_head.weight")
        if head is None:
            raise ValueError("no lm_head.weight")
        mailbox = self._mailbox(head.shape[0], max(tokens), torch.int32)  # FP32 rows' bits
        if mailbox is None:
            return
        op = LogitsGather(mailbox)
        self._add(op, tokens, None, None)  # not a route: compute_logits calls it
        self.logits_gather, self.gather_tokens = op, frozenset(tokens)

    def _boundaries(self, tokens: list[int]) -> None:
        b = self.backbone
        if b.mhc is None:
            raise ValueError("the backbone's boundaries are not GLM's mHC (Backbone.mhc)")
        shard, sites, missing = b.shards[0], {}, []  # replicated weights: any shard's
        for layer in self.layers:
            for site, norm in (("attn", "input_layernorm"), ("ffn", "post_attention_layernorm")):
                p = f"layers.{layer.index}"
                names = [*(f"{p}.{site}_hc.{n}" for n in ("fn", "scale", "base")),
                         f"{p}.{norm}.weight"]  # fmt: skip
                w = [b.weight(shard, n) for n in names]
                missing += [n for n, t in zip(names, w, strict=True) if t is None]
                sites[layer.index, site] = tuple(w)
        final = b.weight(shard, "norm.weight")
        if final is None:
            missing.append("norm.weight")
        if missing:
            raise ValueError(f"no {', '.join(missing)}")
        # `cute`: the CuTe DSL cluster kernel where it builds (world size 1: with an exchange,
        # and where it cannot build, MhcBoundary runs the Triton kernel and says so once);
        # `cute_deferred`: each comb balanced by the next boundary (`run` passes it on).
        kind = {m: self.policy("boundary", m) for m in tokens}
        cute = [m for m, k in kind.items() if k in ("cute", "cute_deferred")]
        defer = [m for m, k in kind.items() if k == "cute_deferred"]
        op = MhcBoundary(b.mhc, max_tokens=max(tokens), device=final.device, cute_tokens=cute,
                         defer_tokens=defer)  # fmt: skip
        for w in sites.values():
            op.check_weights(*w)
        op.check_weights(*sites[self.layers[0].index, "attn"][:3], final)
        # TP ranks in other processes: the boundaries all-reduce the partial outputs
        # themselves (compiled with the exchange, every process alike).
        mailbox = self._mailbox(b.hidden_size, max(tokens))
        exchange = None if mailbox is None else AllReduceBoundary(mailbox, op)
        self._add(exchange or op, tokens, None, None)  # not a route: `run` calls it
        self.mhc, self.exchange = op, exchange
        self.mhc_tokens, self._sites = frozenset(tokens), sites
        self._final_norm = final

    def prepare(self) -> set[str]:
        failed = super().prepare()
        if "logits_head" in failed:
            self.head = {}
        if "boundary" in failed:
            self.mhc, self.exchange = None, None
        if "logits_gather" in failed:
            self.logits_gather, self.gather_tokens = None, frozenset()
        # A peer that never arrives leaves NaN and a failed mailbox, not a hung GPU: each
        # planned step with exchanges records the failure words, the next raises.
        self.watch = MailboxWatch([self.exchange and self.exchange.mailbox,
                                   self.logits_gather and self.logits_gather.mailbox])  # fmt: skip
        return failed

    def partial(self, tokens: int) -> bool:
        return self.exchange is not None and tokens in self.mhc_tokens

    def plan(self, placement: Any, capturing: bool, graph: str = "FULL") -> Plan:
        """This step's plan (`plan.step`), or the reason the stock forward runs."""
        b = self.backbone
        context = StepContext(
            b.tokens(placement), capturing, graph, aux_layers=tuple(b.aux_layers),
            rows=b.rows(placement),
        )  # fmt: skip
        return plan(context, self.batches, self.q)

    def run(
        self, step: Step, tokens: Tensor | None, placement: Any, embeds: Tensor | None = None
    ) -> Tensor:
        """Final normalized hidden states [R, T, D] of a planned step, from token ids or
        from input embeddings the caller computed (a multimodal model's)."""
        b = self.backbone
        with self.installed(step.tokens):
            if self.partial(step.tokens):  # the backbone's all-reduces off once a step
                self.watch.check()
                with b.unreduced():  # the embedding too: summed in the first boundary
                    x = self._embed(tokens, step) if embeds is None else embeds
                    out = self._fused_boundaries(x, placement, embedded=embeds is None)
                self.watch.record()
                return out
            x = self._embed(tokens, step) if embeds is None else embeds
            if self.mhc is not None and step.tokens in self.mhc_tokens:
                return self._fused_boundaries(x, placement)
            shape = x.shape
            streams = b.expand(x.reshape(-1, shape[-1]))
            for layer in self.layers:
                h, post, comb = b.pre(layer.index, "attn", streams)
                a = self.attention(layer, h.view(shape), placement)
                streams = b.post(a.reshape(-1, shape[-1]), streams, post, comb)
                h, post, comb = b.pre(layer.index, "ffn", streams)
                m = self.mlp(layer, h.view(shape))
                streams = b.post(m.reshape(-1, shape[-1]), streams, post, comb)
            return b.final_norm(streams).view(shape)

    def _fused_boundaries(self, x: Tensor, placement: Any, embedded: bool = False) -> Tensor:
        """`run`'s layer loop with each mHC boundary one kernel: the embedding expanded
        into the streams and the first pre; between sublayers post -> pre -> norm; after the
        last, post -> the streams' mean -> the final norm. With partial outputs, x is the
        embedding's partial where `embedded` (else the caller's whole input embeddings)."""
        shape, op, sites = x.shape, self.mhc, self._sites
        assert op is not None
        # After a sublayer: its output reduced here, or its partial through the exchange.
        boundary = self.exchange if self.partial(x.numel() // shape[-1]) else op
        assert boundary is not None

        def rows(t: Tensor) -> Tensor:
            return t.reshape(-1, shape[-1]).contiguous()

        first = boundary if embedded else op
        streams, post, comb, h = first.expand_pre(rows(x), *sites[self.layers[0].index, "attn"])
        for i, layer in enumerate(self.layers):
            a = rows(self.attention(layer, h.view(shape), placement))
            site = sites[layer.index, "ffn"]
            streams, post, comb, h = boundary.post_pre(a, streams, post, comb, *site)
            m = rows(self.mlp(layer, h.view(shape)))
            if i + 1 == len(self.layers):
                return boundary.head(m, streams, post, comb, self._final_norm).view(shape)
            nxt = sites[self.layers[i + 1].index, "attn"]
            streams, post, comb, h = boundary.post_pre(m, streams, post, comb, *nxt)
        raise AssertionError("unreachable: a backbone has layers")

    def forward(
        self,
        tokens: Tensor | None,
        placement: Any,
        stock: Callable[[Tensor | None, Any], Tensor],
        *,
        capturing: bool | None = None,
        graph: str = "FULL",
        embeds: Tensor | None = None,
    ) -> Tensor:
        """The step: planned when `plan` says so, else `stock(tokens, placement)`.
        `capturing` defaults to whether a CUDA-graph capture is under way; `graph` is the
        capture's mode ("FULL" | "PIECEWISE" | "NONE"); `embeds` stand in for `tokens`."""
        if capturing is None:
            capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        decision = self.plan(placement, capturing, graph)
        if decision.step is None:
            return stock(tokens, placement)
        return self.run(decision.step, tokens, placement, embeds)

    def serves_logits(self, hidden: Tensor) -> bool:
        """Whether `compute_logits` runs the skinny LM head for these hidden states."""
        rows = hidden.numel() // hidden.shape[-1]
        return rows in self.head and hidden.dtype == torch.bfloat16

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """[..., vocab] FP32 logits: the skinny LM head and the mailbox gather where the
        policy picks them."""
        b = self.backbone
        self.watch.check()  # an exchange of an earlier step timed out: its outputs are NaN
        x = hidden.reshape(-1, hidden.shape[-1])
        if self.serves_logits(hidden):
            x = x.contiguous()
            shards = [h(x) for h in self.head[x.shape[0]]]
        else:
            shards = [b.head(s, x) for s in b.shards]
        if self.logits_gather is not None and x.shape[0] in self.gather_tokens:
            (shard,) = shards
            full = self.logits_gather(shard.contiguous())[:, : b.vocab_size]  # padding off
            self.watch.record()
        else:
            full = b.gather(shards)
        return full.view(*hidden.shape[:-1], -1)
