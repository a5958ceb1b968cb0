"""The mHC boundary as one launch: `MhcBoundary`.

Between two sublayers GLM-5.3-Flash runs the previous one's mHC post, the next one's mHC pre
(RMS-normed streams -> mix logits -> pre / post weights and a Sinkhorn-balanced comb) and
the next one's input RMSNorm: stock, dozens of small kernels (20 Sinkhorn iterations alone
are ~80). Here each is one kernel (`triton_mhc.hc_boundary_kernel`):

    expand_pre(x, ...)                       the step's first: embedding -> streams, pre, norm
    post_pre(y, streams, post, comb, ...)    every other boundary (hc_fused_post_pre_ref)
    head(y, streams, post, comb, norm)       the last: post, the streams' mean, final norm

Two kernels compute the same boundary: the Triton one (`triton_mhc`, every world size) and
the CuTe DSL one (`cute_mhc`, world size 1: a thread-block cluster whose CTAs combine their
row sums through distributed shared memory), chosen per token count (`cute_tokens`, the
policy's `boundary` stage); where the CuTe DSL is missing or a kernel does not build, one
warning and the Triton kernel. At the token counts in `defer_tokens` the CuTe boundaries
hand comb on as a `PendingComb` (its mix logits and a ready word a token group), balanced
by the next boundary before its PDL wait: Sinkhorn off the critical path (`cute_mhc`'s
docstring). A caller passes it on like the comb tensor; `resolve_comb` makes it one.

Numerics: the streams round as transformers' BF16 post does (bit-equal); mix, Sinkhorn and
norms run in FP32. The norm's 1/rms comes from the streams' Gram matrix (the unrounded
collapse), so a normed value may land on the neighbouring BF16 of the reference's.

One object serves every boundary of a model on one stream: its workspace (partial sums and
barrier words) is reused by each call in stream order.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from glm5_kernels.launch import capturing, interpreting, next_pow2, sm_count, use_pdl
from glm5_kernels.mhc.reference import sinkhorn_ref

__all__ = ["MhcBoundary", "MhcConfig", "PendingComb"]

logger = logging.getLogger(__name__)

GIVEN, EXPAND, POST = 0, 1, 2  # the kernel's MODE: where its streams come from
# The most CuTe clusters a boundary launches (a GPU that runs more at once still gets 16:
# one token a cluster is the plan's floor up to 16 tokens).
MAX_CLUSTERS = 16


def tokens_a_cluster(m: int, clusters: int) -> int:
    """The CuTe kernel's tokens a cluster at m tokens, where `clusters` clusters run at
    once: the fewest that keep every cluster resident. A cluster's time grows with its
    tokens (the mix GEMV's FMAs a CTA), and one cluster past what fits runs as a second
    wave: the H100 sweep at 16 / 32 / 64 tokens (14 resident): 1 token a cluster (16
    clusters) 8.7 µs, 2 (8) 6.4, 3 (6) 7.0; 2 (16) 11.1, 3 (11) 8.6, 4 (8) 10.3; 4 (16) 17.2,
    6 (11) 15.1, 8 (8) 21.2 (benchmarks/boundary.py --sweep, kernels README)."""
    return -(-m // min(clusters, MAX_CLUSTERS))


def _want(problems: list[str], name: str, t, shape: tuple, dtypes: tuple, device=None) -> None:
    """One input as a kernel reads it (contiguous, of `shape` and one of `dtypes`, on
    `device` where given), else its problem appended."""
    if t is None:
        problems.append(f"{name}: missing")
    elif tuple(t.shape) != shape or t.dtype not in dtypes or not t.is_contiguous():
        names = " or ".join(str(dt).removeprefix("torch.") for dt in dtypes)
        problems.append(
            f"{name}: {tuple(t.shape)} {t.dtype}, expected contiguous {list(shape)} {names}"
        )
    elif device is not None and t.device != device:
        problems.append(f"{name}: on {t.device}, expected {device}")


@dataclass(frozen=True)
class MhcConfig:
    """The model's mHC constants: `hc` streams of `hidden` columns; `rms_eps` of the mix
    input's normalization, `hc_eps` of pre and Sinkhorn, `norm_eps` of the sublayer input
    RMSNorm (and of the final norm), `post_mult` (2.0 in GLM-5.3-Flash)."""

    hc: int
    hidden: int
    rms_eps: float
    hc_eps: float
    sinkhorn_iters: int
    norm_eps: float
    post_mult: float = 2.0

    @property
    def mix(self) -> int:
        return (2 + self.hc) * self.hc


class PendingComb(NamedTuple):
    """A comb the next boundary balances: its mix logits [T, H, H] FP32 (the softmax input,
    scale and base applied) and the ready words [groups] int32 of the CuTe boundary that
    writes them (one a cluster of tokens). Valid as an input once that boundary was launched
    before, on the same stream."""

    logits: Tensor
    ready: Tensor


def _split(comb) -> tuple:
    """(comb or its logits, the ready words or None): what the CuTe kernel's slots take."""
    return tuple(comb) if isinstance(comb, PendingComb) else (comb, None)


@dataclass(frozen=True)
class _Plan:
    bd: int  # hidden columns per CTA (all four streams)
    splits: int  # CTAs per token block
    sr: int  # splits summed per load by the token block's last CTA
    fused: bool  # one launch with a wait on the token block, else two launches
    warps: int = 4
    bt: int = 16  # tokens per CTA (the mix dot's M)


class MhcBoundary:
    """mHC boundaries of `config`'s shape for 1..`max_tokens` tokens on `device`; the token
    counts in `cute_tokens` run the CuTe DSL kernel where it can (world size 1)."""

    def __init__(self, config: MhcConfig, *, max_tokens: int = 64, device="cuda",
                 cute_tokens=(), defer_tokens=()):  # fmt: skip
        if config.hc != 4:
            raise ValueError(f"MhcBoundary: hc={config.hc}, the kernel is built for 4 streams")
        if config.sinkhorn_iters < 1:
            raise ValueError(f"MhcBoundary: sinkhorn_iters={config.sinkhorn_iters}, >= 1 expected")
        self.config, self.max_tokens = config, max_tokens
        self._device = torch.device(device)
        if self._device.type == "cuda" and self._device.index is None:
            self._device = torch.device("cuda", torch.cuda.current_device())
        self._pdl, self._interp = use_pdl(self._device), interpreting()
        self._sms = sm_count(self._device)
        from glm5_kernels.mhc.triton_mhc import hc_boundary_kernel  # Triton: an extra

        self._kernel = hc_boundary_kernel
        self.plans = {m: self._plan(m) for m in range(1, max_tokens + 1)}
        self._max_splits = -(-config.hidden // 16)
        pw = config.mix + config.hc * config.hc
        self._part = torch.zeros(self._max_splits, max_tokens, pw, device=self._device)
        self._sum = torch.zeros(max_tokens, pw, device=self._device)
        self._bar = torch.zeros(-(-max_tokens // 16), dtype=torch.int32, device=self._device)
        # Unused pointers of the CuTe kernel (never read where MODE / HEAD / STORE say so).
        self._spare_f32 = torch.zeros(1, device=self._device)
        self._spare_bf16 = torch.zeros(1, dtype=torch.bfloat16, device=self._device)
        self._spare_i64 = torch.zeros(1, dtype=torch.int64, device=self._device)  # phases
        self._spare_i32 = torch.zeros(1, dtype=torch.int32, device=self._device)  # ready words
        self._xr: Tensor | None = None  # an exchange's reduced rows between two phases
        # The weight dtypes `check_weights` has seen: `prepare` compiles for each (a first
        # launch inside a CUDA-graph capture must not compile).
        self._dtypes: set[tuple[torch.dtype, ...]] = set()
        self.cute_tokens = frozenset(m for m in cute_tokens if self.supports(m))
        # Token counts whose boundaries leave comb pending (CuTe only: `_no_cute` clears both)
        self.defer_tokens = frozenset(defer_tokens) & self.cute_tokens
        self._cute: dict[tuple, object] = {}  # compiled CuTe kernels by static configuration
        self._clusters: int | None = None  # CuTe clusters resident at once (resident_clusters)
        if self.cute_tokens and (reason := self._cute_unavailable()):
            self._no_cute(f"the CuTe DSL boundary {reason}")

    def _no_cute(self, why: str) -> None:
        logger.warning("MhcBoundary: %s; the Triton kernel runs instead", why)
        self.cute_tokens = self.defer_tokens = frozenset()

    def _plan(self, m: int) -> _Plan:
        """Token blocks of 16 (the mix dot's M). Columns per CTA from the H200 sweep of
        benchmarks/boundary.py --sweep (4 warps; 8 were slower everywhere): 32 up to 4 tokens
        (128 CTAs; 64 columns: 5-30 % slower), 64 up to 8, 128 above (the last CTA's sum over
        the splits grows with the tokens); more where the grid would not fit the SMs (the
        wait needs every CTA of a block resident). Under the interpreter, whose programs run
        one after another at a fixed cost an op, the fewest splits: up to 512 columns a CTA
        (the whole-step CPU tests' boundaries 2.3x faster; test_mhc sets split plans)."""
        d, blocks = self.config.hidden, -(-m // 16)
        bd = 32 if m <= 4 else 64 if m <= 8 else 128
        if self._interp:
            bd = max(bd, min(512, next_pow2(d)))
        while bd < 512 and blocks * -(-d // bd) > self._sms:
            bd *= 2
        return self._tiles(m, bd, 4)

    def _tiles(self, m: int, bd: int, warps: int) -> _Plan:
        splits = -(-self.config.hidden // bd)
        blocks = -(-m // 16)
        # The last CTA's sum: rows of the block's tokens, as many splits a load as fit
        # ~64 registers a thread.
        rows = min(16, next_pow2(m))
        sr = max(1, min(next_pow2(splits), 64 * 32 * warps // (rows * 64)))
        fused = not self._interp and blocks * splits <= self._sms
        return _Plan(bd, splits, sr, fused, warps)

    def _cute_unavailable(self) -> str | None:
        """Why the CuTe DSL kernel cannot run here, or None."""
        if self._interp or self._device.type != "cuda":
            return "runs on a CUDA device only"
        if torch.cuda.get_device_capability(self._device)[0] < 9:
            return "needs thread-block clusters (SM90 or newer)"
        try:
            from glm5_kernels.mhc import cute_mhc
        except ImportError as e:
            return f"needs nvidia-cutlass-dsl (glm5-kernels[cute]): {e}"
        return cute_mhc.unfit(self.config.hidden)

    def cute_tb(self, m: int) -> int:
        """Tokens a cluster of the CuTe kernel at m tokens (`tokens_a_cluster`)."""
        return tokens_a_cluster(m, self.resident_clusters())

    def cute_per_sm(self, m: int) -> int:
        """CTAs an SM the CuTe kernel is built for at m tokens: two (128 registers a
        thread), as `tokens_a_cluster` plans. One an SM (no spills at many tokens a cluster,
        half the clusters re-reading fn) is built for `benchmarks/boundary.py --sweep` to time
        beside it; the plan keeps two until that sweep measures one faster."""
        return 2

    def cute_groups(self, m: int) -> int:
        """The CuTe kernel's clusters at m tokens: a `PendingComb`'s ready words."""
        return -(-m // self.cute_tb(m))

    def resident_clusters(self) -> int:
        """How many of the CuTe kernel's clusters this GPU runs at once (the driver's
        occupancy query on the one-token build, asked once: every build is bounded to the
        same registers), at most MAX_CLUSTERS; MAX_CLUSTERS where no CuTe kernel runs or the
        driver does not say (one warning)."""
        if self._clusters is not None:
            return self._clusters
        if not self.cute_tokens:
            return MAX_CLUSTERS  # not kept: the count is the GPU's, asked where it matters
        if capturing():
            raise RuntimeError("MhcBoundary: call prepare() before CUDA-graph capture (the "
                               "CuTe plan asks the driver how many clusters fit)")  # fmt: skip
        from glm5_kernels.mhc import cute_mhc

        try:
            one = self._compile_cute(POST, False, True, 1, ("float32",) * 3 + ("bfloat16",))
        except Exception:  # a build failure is _run_cute's to report (its one warning)
            self._clusters = MAX_CLUSTERS
            return self._clusters
        n = cute_mhc.resident_clusters(one, self.config.hidden // cute_mhc.CLUSTER)
        if n is None:
            logger.warning("MhcBoundary: the driver did not say how many CuTe clusters fit at "
                           "once; planning for %d", MAX_CLUSTERS)  # fmt: skip
        self._clusters = min(n or MAX_CLUSTERS, MAX_CLUSTERS)
        return self._clusters

    def supports(self, m: int) -> bool:
        return 1 <= m <= self.max_tokens

    def prepare(self, tokens, exchange=None) -> None:
        """Compile every kind of boundary for each token count (before CUDA-graph capture),
        for the weight dtypes `check_weights` has seen (FP32 mix weights and a BF16 norm
        where it has seen none); with `exchange`, the posts all-reduce through it (every
        rank must prepare alike: each call exchanges), and so does an expansion (beside the
        one without)."""
        c, dev = self.config, self._device
        bf16, f32 = torch.bfloat16, torch.float32
        for fn_t, scale_t, base_t, norm_t in self._dtypes or {(f32, f32, f32, bf16)}:
            fn = torch.zeros(c.mix, c.hc * c.hidden, dtype=fn_t, device=dev)
            scale = torch.ones(3, dtype=scale_t, device=dev)
            base = torch.zeros(c.mix, dtype=base_t, device=dev)
            norm = torch.ones(c.hidden, dtype=norm_t, device=dev)
            for m in tokens:
                x = torch.zeros(m, c.hidden, dtype=bf16, device=dev)
                # At a deferring token count: comb pending from here on, as a step passes it
                streams, post, comb, _ = self.expand_pre(x, fn, scale, base, norm)
                if exchange is not None:  # the vocab-parallel embedding's partial, summed
                    self.expand_pre(x, fn, scale, base, norm, exchange=exchange)
                self.post_pre(x, streams, post, comb, fn, scale, base, norm, exchange=exchange)
                self.head(x, streams, post, comb, norm, exchange=exchange)

    # The boundaries.
    def pre(self, streams, fn, scale, base, norm_weight, *, out=None):
        """streams [T, H, D] BF16 -> (streams, post [T, H] FP32, comb [T, H, H] FP32, the
        normed sublayer input [T, D] BF16): `hc_pre_ref` then the input RMSNorm. (At a token
        count of `defer_tokens`, every boundary's comb is a `PendingComb`.)"""
        x = streams[:, 0] if streams.dim() == 3 else streams
        return self._run(GIVEN, x, streams, None, None, fn, scale, base, norm_weight, out)

    def expand_pre(self, x, fn, scale, base, norm_weight, *, out=None, exchange=None):
        """x [T, D] BF16 (the embedding) -> (streams [T, H, D] BF16 (x in every stream),
        post [T, H] FP32, comb [T, H, H] FP32, the normed sublayer input [T, D] BF16).
        `exchange`: x is this rank's vocab-parallel partial, summed first (as `post_pre`'s)."""
        return self._run(EXPAND, x, None, None, None, fn, scale, base, norm_weight, out,
                         exchange)  # fmt: skip

    def post_pre(self, x, streams, post, comb, fn, scale, base, norm_weight, *, out=None,
                 exchange=None):  # fmt: skip
        """The sublayer output x [T, D] BF16 posted into streams [T, H, D] with post [T, H] /
        comb [T, H, H] FP32, then the next pre and norm: (streams', post', comb', normed).
        `exchange`: x is this rank's TP-partial output, all-reduced in the same launch
        through these peer mailboxes (glm5-comm's `Mailbox`: rank, world, hidden,
        max_tokens, peers, state; world 1: no exchange)."""
        return self._run(POST, x, streams, post, comb, fn, scale, base, norm_weight, out,
                         exchange)  # fmt: skip

    def head(self, x, streams, post, comb, norm_weight, *, out=None, exchange=None) -> Tensor:
        """The last sublayer's post, the streams' mean and the final norm: [T, D] BF16
        (`exchange`: as `post_pre`'s)."""
        return self._run(POST, x, streams, post, comb, None, None, None, norm_weight, out,
                         exchange)[3]  # fmt: skip

    def resolve_comb(self, comb: Tensor | PendingComb) -> Tensor:
        """comb [T, H, H] FP32 from a `PendingComb` (torch ops: softmax and Sinkhorn of its
        logits, as the reference), or the comb tensor itself."""
        if not isinstance(comb, PendingComb):
            return comb
        c = self.config
        return sinkhorn_ref(comb.logits, c.hc_eps, c.sinkhorn_iters)

    def _run(self, mode, x, streams, post, comb, fn, scale, base, norm, out, exchange=None):
        c = self.config
        head = fn is None
        m = self._check(mode, x, streams, post, comb, fn, scale, base, norm, head, out)
        world = 1 if exchange is None else exchange.world
        if world > 1:
            self._check_exchange(exchange, m)
        dev, h, d = self._device, c.hc, c.hidden
        store = not head and mode != GIVEN  # the new streams are an output
        cute = world == 1 and m in self.cute_tokens
        pend_out = cute and not head and m in self.defer_tokens
        if out is None:
            logits = None if head else torch.empty(m, h, h, dtype=torch.float32, device=dev)
            out = (
                torch.empty(m, h, d, dtype=torch.bfloat16, device=dev) if store else None,
                None if head else torch.empty(m, h, dtype=torch.float32, device=dev),
                PendingComb(logits, torch.empty(self.cute_groups(m), dtype=torch.int32,
                                                device=dev)) if pend_out else logits,
                torch.empty(m, d, dtype=torch.bfloat16, device=dev),
            )  # fmt: skip
        new, post_out, comb_out, normed = out
        if cute:
            (comb_in, ready_in), (logits_out, ready_out) = _split(comb), _split(comb_out)
            tensors = (x, streams, post, comb_in, fn, scale, base, norm, new, post_out,
                       logits_out, normed, None, ready_in, ready_out)  # fmt: skip
            if self._run_cute(mode, head, store, m, tensors):
                return (streams if mode == GIVEN else new), post_out, comb_out, normed
        if isinstance(comb, PendingComb):  # from a CuTe boundary before a fallback
            comb = self.resolve_comb(comb)
        if isinstance(comb_out, PendingComb):  # the CuTe kernel did not build: a comb
            comb_out = comb_out.logits
        p = self.plans[m]
        dummy = normed  # never read where a pointer is unused (MODE / HEAD / STORE say so)
        args = [
            x if x is not None else dummy,
            streams if streams is not None else dummy,
            post if post is not None else dummy,
            comb if comb is not None else dummy,
            fn if fn is not None else dummy,
            scale if scale is not None else dummy,
            base if base is not None else dummy,
            norm,
            new if store else dummy,
            post_out if not head else dummy,
            comb_out if not head else dummy,
            normed,
            self._part,
            self._sum,
            self._bar,
            *(self._exchange_args(exchange) if world > 1 else (dummy, dummy, dummy)),
            m, d, self.max_tokens, c.rms_eps, c.hc_eps, c.norm_eps, c.post_mult,
            exchange.rank if world > 1 else 0,
            exchange.max_tokens * d if world > 1 else 0,
        ]  # fmt: skip
        meta = dict(
            H=h, BT=p.bt, BD=p.bd, BTR=min(p.bt, next_pow2(m)), SR=p.sr, NMIX_P=next_pow2(c.mix),
            MODE=mode, STORE=store, HEAD=head, SINKHORN=c.sinkhorn_iters, WORLD=world,
            INTERPRETER=self._interp, PDL=self._pdl, num_warps=p.warps, launch_pdl=self._pdl,
            # No contraction: a BF16 multiply and the add after it are two roundings in the
            # model (post * y, then + comb^T streams), never one fused multiply-add.
            enable_fp_fusion=False,
        )  # fmt: skip
        grid = (-(-m // p.bt), p.splits)
        for phase in (0,) if p.fused else (1, 2):
            self._kernel[grid](*args, PHASE=phase, **meta)
        return (streams if mode == GIVEN else new), post_out, comb_out, normed

    def _compile_cute(self, mode, head, store, tb, weights, pend_in=False, pend_out=False,
                      per_sm=2):  # fmt: skip
        """The CuTe kernel of one static configuration for this boundary's model constants
        (`weights`: the fn, scale, base and norm dtypes' names); the DSL caches each build."""
        from glm5_kernels.mhc import cute_mhc

        c = self.config
        return cute_mhc.compile_boundary(
            cute_mhc.slot_dtypes(weights), mode=mode, head=head, store=store, tb=tb,
            hidden=c.hidden, rms_eps=c.rms_eps, hc_eps=c.hc_eps, norm_eps=c.norm_eps,
            post_mult=c.post_mult, sinkhorn_iters=c.sinkhorn_iters, pdl=self._pdl,
            pend_in=pend_in, pend_out=pend_out, per_sm=per_sm,
        )  # fmt: skip

    def _run_cute(self, mode, head, store, m, tensors) -> bool:
        """The boundary by the CuTe DSL kernel (compiled on first use; never inside a
        capture), or False where it does not build (one warning: the Triton kernel from
        then on)."""
        from glm5_kernels.mhc import cute_mhc

        tb = self.cute_tb(m)
        # fn, scale, base, norm: the site's dtypes (HEAD has no mix weights: FP32 slots)
        weights = tuple(str(t.dtype).removeprefix("torch.") if t is not None else "float32"
                        for t in tensors[4:8])  # fmt: skip
        pend_in, pend_out = tensors[13] is not None, tensors[14] is not None  # ready words
        key = (mode, head, store, tb, weights, pend_in, pend_out, self.cute_per_sm(m))
        if key not in self._cute:
            if capturing():
                raise RuntimeError(f"MhcBoundary: {m} tokens were not prepared; call "
                                   "prepare() before CUDA-graph capture (a capture must never "
                                   "compile)")  # fmt: skip
            try:
                self._cute[key] = self._compile_cute(*key)
            except Exception as e:  # a DSL or toolchain failure: the Triton kernel serves
                self._no_cute(f"the CuTe DSL boundary did not build ({type(e).__name__}: {e})")
                return False
        spare = {torch.float32: self._spare_f32, torch.bfloat16: self._spare_bf16,
                 torch.int64: self._spare_i64, torch.int32: self._spare_i32}  # fmt: skip
        dtypes = cute_mhc.slot_dtypes(weights)
        args = [t if t is not None else spare[getattr(torch, dt)]
                for t, dt in zip(tensors, dtypes, strict=True)]  # fmt: skip
        stream = torch.cuda.current_stream(self._device).cuda_stream
        cute_mhc.launch(self._cute[key], args, m, stream)
        return True

    def _exchange_args(self, exchange) -> tuple:
        """(xr, peers, state): xr keeps the reduced rows between two phases (one
        launch leaves it unused, but every call passes the same buffer: one specialization
        of the kernel, compiled by `prepare`)."""
        if self._xr is None:
            if capturing():
                raise RuntimeError("MhcBoundary: the exchange's row buffer is allocated by a "
                                   "call before CUDA-graph capture (prepare)")  # fmt: skip
            self._xr = torch.empty(self.max_tokens, self.config.hidden, dtype=torch.bfloat16,
                                   device=self._device)  # fmt: skip
        return self._xr, exchange.peers, exchange.state

    def _check_exchange(self, exchange, m: int) -> None:
        problems = []
        if exchange.hidden != self.config.hidden or exchange.max_tokens < m:
            problems.append(f"exchange: hidden {exchange.hidden}, max_tokens "
                            f"{exchange.max_tokens}; the boundary needs hidden "
                            f"{self.config.hidden} and {m} tokens")  # fmt: skip
        if getattr(exchange, "dtype", torch.int16) != torch.int16:
            problems.append(f"exchange: a mailbox of {exchange.dtype}, BF16 rows need int16")
        if problems:
            raise ValueError("MhcBoundary: " + "; ".join(problems))

    def check_weights(self, fn, scale, base, norm_weight) -> None:
        """A site's weights as the boundaries read them, or one error naming every problem
        (a caller building boundaries ahead checks them before any step runs)."""
        problems: list[str] = []
        self._check_weights(problems, (fn, scale, base), norm_weight)
        if problems:
            raise ValueError("MhcBoundary: " + "; ".join(problems))
        self._dtypes.add((fn.dtype, scale.dtype, base.dtype, norm_weight.dtype))

    def _check_weights(self, problems: list[str], mix, norm, device=None) -> None:
        c, floats = self.config, (torch.float32, torch.bfloat16)
        if mix is not None:
            fn, scale, base = mix
            _want(problems, "fn", fn, (c.mix, c.hc * c.hidden), floats, device)
            _want(problems, "scale", scale, (3,), floats, device)
            _want(problems, "base", base, (c.mix,), floats, device)
        _want(problems, "norm_weight", norm, (c.hidden,), floats, device)

    def _check(self, mode, x, streams, post, comb, fn, scale, base, norm, head, out) -> int:
        """The token count; every problem with the inputs in one error."""
        c, problems = self.config, []
        h, d = c.hc, c.hidden
        m = x.shape[0] if x is not None and x.dim() == 2 else -1
        if not self.supports(m):
            problems.append(f"x: {m} tokens, outside 1..{self.max_tokens}")
        device = None if self._interp else self._device

        def want(name, t, shape, dtypes):
            _want(problems, name, t, shape, dtypes, device)

        bf16, f32 = (torch.bfloat16,), (torch.float32,)
        if mode == GIVEN:
            want("streams", streams, (m, h, d), bf16)
        else:
            want("x", x, (m, d), bf16)
        groups = (self.cute_groups(m),) if self.supports(m) and m <= 128 else (0,)

        def want_comb(name, t):  # a comb tensor or a PendingComb of this token count
            if isinstance(t, PendingComb):
                want(f"{name}.logits", t.logits, (m, h, h), f32)
                want(f"{name}.ready", t.ready, groups, (torch.int32,))
            else:
                want(name, t, (m, h, h), f32)

        if mode == POST:
            want("streams", streams, (m, h, d), bf16)
            want("post", post, (m, h), f32)
            want_comb("comb", comb)
        self._check_weights(problems, None if head else (fn, scale, base), norm, device)
        if out is not None:
            shapes = [(m, h, d), (m, h), (m, h, h), (m, d)]
            dtypes = [bf16, f32, f32, bf16]
            needed = [not head and mode != GIVEN, not head, not head, True]
            for name, t, shape, dt, need in zip(("streams", "post", "comb", "normed"), out,
                                                shapes, dtypes, needed, strict=True):  # fmt: skip
                if need and name == "comb":
                    want_comb("out.comb", t)
                elif need:
                    want(f"out.{name}", t, shape, dt)

            def flat(ts):
                return [u for t in ts for u in (t if isinstance(t, PendingComb) else (t,))]

            inputs = {t.data_ptr() for t in flat((x, streams, post, comb)) if t is not None}
            if any(t is not None and t.data_ptr() in inputs for t in flat(out)):
                problems.append("out: aliases an input (the kernel reads its inputs twice)")
        if problems:
            raise ValueError("MhcBoundary: " + "; ".join(problems))
        return m
