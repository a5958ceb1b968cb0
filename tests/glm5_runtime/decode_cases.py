"""Shared by the CPU and GPU specialized-decode tests: every stage on, the per-call bounds,
and `shadow`, which makes each stage op also run the stock op it replaces on the same input."""

import torch

from glm5_kernels.dsa import (
    index_topk_ref,
    kpool_write_ref,
    sparse_mla_decode_ref,
    unpack_kpool_pages_ref,
)
from glm5_kernels.kda import kda_decode_ref

# The MoE stage: per-route at 1-4 tokens, grouped at 5-16 and 33-64 (16-token groups cut
# there), stock router + shared expert ops at 17-32. The fused mHC boundaries everywhere
# but 17-20 tokens (the stock boundaries beside the stages there).
ALL_STAGES = {
    "moe": {"1-4": "per_route", "5-16": "grouped", "33-64": "grouped"},
    "boundary": {"1-16": "nvlink", "21-64": "nvlink"},
    "kda": {"1-64": "fused"},
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
        ]
    },
}

# Per-call bounds against the stock op on the same input: BF16 output rounding (2^-9 rms, with
# margin) for the projections and exact-input FP32 for the router. The FP8 MLPs re-quantize
# their BF16 intermediate, whose one-ulp moves flip FP8 codes; at one token (a single row of
# codes, no averaging over rows) thousands of replays reach 2.7e-2 on the H200. Their bound is
# 2^-4: every intermediate code half an e4m3 step off. glm5-kernels' own tests check the two
# GEMMs apart, tightly; here a wrong weight or row (error ~1) is what must not pass.
# The MoE layer: the same FP8 MLP bound on its routed + shared sum (whose routing is exact:
# the tests' models route every token to every expert). The fused KDA step against
# kda_decode_ref on the same caches: its BF16 rows round twice (o, then the gated norm: ~2^-8.5
# rms) and a conv output may land on the neighbouring BF16 (the sums' order), which the
# state carries: 2^-7 for the rows and for the state it writes.
CALL_BOUND = {
    "Projection": 4e-3, "Router": 1e-5, "SharedExpert": 2**-4, "DenseMlp": 2**-4,
    "MoeLayer": 2**-4, "KdaDecode": 2**-7, "KdaState": 2**-7, "SparseMlaDecode": 2**-7,
    "IndexerTopk": 0.0, "KpoolQueries": 2**-4, "KpoolPages": 2**-4,
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

    def supports(self, m):
        return self.op.supports(m)

    def __call__(self, x, *args, **kw):
        if type(self.op).__name__ == "KdaDecode":
            return self._kda(x, *args, **kw)
        if type(self.op).__name__ == "KpoolWrite":
            return self._kpool(x, *args, **kw)
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
        y = self.op(x)
        routes, self.rank.routes = self.rank.routes, {}  # the stock op, this once
        try:
            if type(self.op).__name__ == "MoeLayer":  # the whole MoE layer: "layers.{i}.mlp"
                ref = self.rank.moe(int(self.name.split(".")[1]), x)
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

    def _kpool(self, k, gate, q, tail, pages, block_table, positions, tail_rows):
        """The pool write on the caches, `kpool_write_ref` on copies taken before: the ring
        (raw copies: exact), the pool keys and the queries as values (an FP8 code may land
        on its neighbour where a BF16 rounding upstream did: 2^-4, as the FP8 MLPs)."""
        op, tail_ref, pages_ref = self.op, tail.clone(), pages.clone()
        q8, qs = op(k, gate, q, tail, pages, block_table, positions, tail_rows)
        q8_ref, qs_ref = kpool_write_ref(k, gate, q, tail_ref, pages_ref, op.ape, block_table,
                                         positions, tail_rows, op.block_size)  # fmt: skip
        self.pairs.append(("KpoolQueries", self.name, q8.float() * qs[..., None],
                           q8_ref.float() * qs_ref[..., None]))  # fmt: skip
        self.pairs.append(("KpoolTail", self.name, tail.clone(), tail_ref))
        keys = [unpack_kpool_pages_ref(x[1:]) for x in (pages, pages_ref)]  # not the null block
        values = [kk.float() * sc[..., None] for kk, sc in keys]
        self.pairs.append(("KpoolPages", self.name, *values))
        return q8, qs

    def _kda(self, qkv, f, b, gate, conv, rec, **place):
        """The fused KDA step on the caches, `kda_decode_ref` on copies taken before: the
        rows and the recurrent state each wrote (the conv state moves raw inputs: exact)."""
        op, conv_ref, rec_ref = self.op, conv.clone(), rec.clone()
        y = op(qkv, f, b, gate, conv, rec, **place)
        ref = kda_decode_ref(qkv, f, b, gate, conv_ref, rec_ref, op.conv_weight, op.dt_bias,
                             op.A_log, op.norm_weight, **place, lower_bound=op.lower_bound,
                             eps=op.eps)  # fmt: skip
        self.pairs.append(("KdaDecode", self.name, y, ref))
        self.pairs.append(("KdaState", self.name, rec.clone(), rec_ref))
        self.pairs.append(("KdaConv", self.name, conv.clone(), conv_ref))
        return y


def shadow(stages, model, pairs) -> set[str]:
    """Wrap every route of `stages` (a LayerStages over `model`) in a Shadow; the names."""
    for b, routes in stages.routes.items():
        stages.routes[b] = [(s, n, Shadow(op, model.ranks[s], n, pairs)) for s, n, op in routes]
    return {name for routes in stages.routes.values() for _, name, _ in routes}


def check_calls(pairs, worst=None) -> None:
    """Every recorded call within its bound; the worst error per kind into `worst`."""
    assert pairs, "no stage op ran"
    errors = torch.stack([rel_tensor(y, ref) for _, _, y, ref in pairs]).tolist()  # one sync
    for (kind, name, y, ref), err in zip(pairs, errors, strict=True):
        if worst is not None:
            worst[kind] = max(worst.get(kind, 0.0), err)
        if not err <= CALL_BOUND.get(kind, 0.0):  # NaN fails too; KdaConv: exact
            nans = (y.isnan().any().item(), ref.isnan().any().item())
            raise AssertionError((kind, name, err, "NaN in (op, stock):", nans))
