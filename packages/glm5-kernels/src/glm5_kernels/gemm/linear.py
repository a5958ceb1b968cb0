"""Public skinny-GEMM ops: BF16 `Projection` / `Router`, block-FP8 `Fp8Linear`, and the FP8
MLP built on it (`DenseMlp`; the MoE's `SharedExpert` is one, in glm5_kernels.moe).

Every op is built once over weights it never modifies, serves any token count 1..max_tokens
(`supports(m)`), and keeps its compiled kernels per token count: `prepare(tokens)` compiles and
runs each one, after which a call inside CUDA-graph capture launches without compiling or
allocating anything but its output (the graph's pool). A call during capture for a token count
that was never prepared is an error, never a compile.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from glm5_kernels.launch import first_call, interpreting, sm_count, use_pdl

__all__ = [
    "MAX_TOKENS",
    "DenseMlp",
    "Fp8Linear",
    "Projection",
    "Router",
    "Tile",
    "plan",
]

MAX_TOKENS = 64
GROUP = 128  # FP8 block / activation group width
QUANT_GROUPS = 8  # 128-wide activation groups per quantization program (BF16 input)


def _parts_groups(m: int, k_tiles: int) -> int:
    """Groups per quantization program when it sums split-K partials (2 x splits FP32 loads
    per element): the most of 1 / 2 / 4 that still leaves >= 256 programs. H200, the MLPs at
    1-64 tokens: one group per program is 0.3-1.8 us faster than eight up to 16 tokens; at
    64 tokens, 2-4 per program are best. (Plain BF16 input: 8 is best or tied everywhere.)"""
    return max(g for g in (1, 2, 4) if g == 1 or m * k_tiles >= 256 * g)


@dataclass(frozen=True)
class Tile:
    """One launch shape: BM tokens (padded), BN output columns and BK of K per CTA step,
    split_k CTAs along K, warps, pipeline stages, programmatic dependent launch and the
    128-byte weight lines per row each CTA prefetches into L2 before waiting on its inputs."""

    bm: int
    bn: int
    bk: int
    split_k: int
    warps: int = 4
    stages: int = 4
    pdl: bool = False
    prefetch: int = 0
    quantize_first: bool = False  # FP8: quantize activations in their own kernel first
    blocks: int = 1  # FP8: 128-wide K blocks per pipelined step (divides each split's blocks)


def plan(
    m: int, n: int, k: int, *, sms: int, fp8: bool, split_k: bool = True, pdl: bool = False
) -> Tile:
    """The tile for an [m, k] x [n, k]ᵀ product on a GPU with `sms` SMs (from the H200 sweeps
    of benchmarks/skinny_gemm.py --sweep and the variants in the glm5-kernels README).

    Weight streaming wants loads in flight on every SM and K loops long enough per CTA to
    amortize the pipeline's fill. BF16 splits K only when N gives fewer than a third as many
    column tiles as SMs: from there up, the split-K fixup costs more than the idle SMs do
    (N = 4096: one CTA on 64 of 132 SMs streams 3-16 % faster than 128 split CTAs, M = 1..64).
    FP8 aims at about two CTAs per SM up to 16 tokens (one above). Splits keep >= 4 K tiles
    each; narrow outputs (the router's 288) take 32-wide tiles.

    Stages: what keeps enough bytes in flight per SM with every CTA resident in one wave.
    BF16: as many as ~160 KB of shared memory holds, up to 6; where the tiles need up to two
    waves, few enough for two CTAs per SM (q_b at TP 1, 256 tiles: 6 -> 4 stages is 75 -> 83 %);
    where they fill at most half the SMs with long K loops, 8 (each SM must then stream twice
    its share: TP 1 o_proj 80 -> 85 %, KDA o_proj 77 -> 80 %). FP8 takes two 128-wide K blocks
    per step, 3 stages up to 16 tokens and 4 above, within the shared memory left per CTA
    when all its CTAs share the SMs in one wave; one block per step where two would leave
    fewer than 3 stages (dense gate_up at TP 1, M = 64: 384 CTAs, 49 -> 72 %); always 4 warps
    (8 measured 3-30 % slower once the scales were loaded ahead). FP8 activations are
    quantized in their own small kernel first (every column tile would redo it otherwise;
    with PDL the extra launch costs less than that, at every M).
    """
    bm = max(16, 1 << (m - 1).bit_length())
    bk = 128
    bn = 64 if fp8 or -(-n // 64) >= sms // 8 else 32
    k_tiles, tiles = -(-k // bk), -(-n // bn)
    splits = 1
    if split_k and (fp8 or 3 * tiles < sms):
        target = (2 if fp8 and m <= 16 else 1) * sms
        splits = max(1, min(round(target / tiles), k_tiles // 4))
    blocks = 1
    if fp8:
        waves = -(-tiles * splits // sms)  # CTAs each SM holds at once
        budget = min(160 << 10, (220 << 10) // waves)
        per_block = (bn + bm) * bk
        blocks = 2 if k_tiles % 2 == 0 and budget >= 3 * 2 * per_block else 1
        most = 6 if blocks == 1 else 3 if m <= 16 else 4  # swept: 3 (M <= 16), 4 (above)
        stages = max(2, min(most, budget // (blocks * per_block)))
    if splits > 1:  # every split a multiple of the step's blocks, none empty
        per_split = -(-k_tiles // splits)
        per_split += -per_split % blocks
        splits = -(-k_tiles // per_split)
    if fp8:
        return Tile(
            bm, bn, bk, splits, stages=stages, pdl=pdl, prefetch=2 if pdl else 0,
            quantize_first=True, blocks=blocks,
        )  # fmt: skip
    per_stage = (bn + bm) * bk * 2
    stages = max(2, min(6, (160 << 10) // per_stage))
    if sms < tiles * splits <= 2 * sms:  # two CTAs per SM: one wave
        stages = max(3, min(stages, (80 << 10) // per_stage))
    elif 2 * tiles * splits <= sms and k_tiles >= 32 * splits:
        stages = min(8, (200 << 10) // per_stage)
    return Tile(bm, bn, bk, splits, stages=stages, pdl=pdl, prefetch=2 if pdl else 0)


def _offset(base: Tensor, t: Tensor) -> int:
    """t's first element as an element offset from base's (same dtype: both aligned to it)."""
    delta = t.data_ptr() - base.data_ptr()
    assert delta % base.element_size() == 0
    return delta // base.element_size()


def _check_weight(name: str, w: Tensor, dtypes: tuple[torch.dtype, ...], problems: list[str]):
    if w.dim() != 2:
        problems.append(f"{name}: expected 2-D [N, K], got shape {tuple(w.shape)}")
    if w.dtype not in dtypes:
        problems.append(f"{name}: dtype {w.dtype}, expected one of {dtypes}")
    if not w.is_contiguous():
        problems.append(f"{name}: must be contiguous (k-major)")
    if w.device.type != "cuda" and not interpreting():
        problems.append(f"{name}: on {w.device}; the Triton kernels need CUDA")


def _raise(op: str, problems: list[str]) -> None:
    if problems:
        raise ValueError(f"{op}: " + "; ".join(problems))


class _SkinnyGemm:
    """Host side shared by the ops: tiles per token count, split-K scratch, prepare/capture."""

    fp8 = False

    def __init__(self, n: int, k: int, device: torch.device, split_k_tokens, max_tokens: int):
        try:
            import triton  # noqa: F401  (the kernels' backend: glm5-kernels[triton])
        except ImportError as e:
            raise ImportError(f"{type(self).__name__} needs Triton (glm5-kernels[triton])") from e
        if not 1 <= max_tokens <= MAX_TOKENS:
            raise ValueError(f"max_tokens={max_tokens}: must be in 1..{MAX_TOKENS}")
        self.n, self.k, self.max_tokens = n, k, max_tokens
        split = range(1, max_tokens + 1) if split_k_tokens is None else set(split_k_tokens)
        sms = sm_count(device)
        self.tiles = {
            m: plan(m, n, k, sms=sms, fp8=self.fp8, split_k=m in split, pdl=use_pdl(device))
            for m in range(1, max_tokens + 1)
        }
        # One counter per column tile at the narrowest BN any plan may use; the kernels reset
        # them, so they stay zero between launches (and graph replays).
        self._counts = torch.zeros(-(-n // 16), dtype=torch.int32, device=device)
        self._ready: set[int] = set()

    def supports(self, m: int) -> bool:
        return 1 <= m <= self.max_tokens

    def prepare(self, tokens: Iterable[int]) -> None:
        """Compile and run once for each token count (do this before CUDA-graph capture)."""
        for m in tokens:
            if not self.supports(m):
                raise ValueError(f"{type(self).__name__}: M={m} outside 1..{self.max_tokens}")
            self(torch.zeros(m, self._in_features, dtype=torch.bfloat16, device=self._device))

    @property
    def _in_features(self) -> int:
        return self.k

    def _check_input(self, x: Tensor) -> int:
        problems = []
        if x.dim() != 2 or x.shape[-1] != self._in_features:
            problems.append(f"x: shape {tuple(x.shape)}, expected [M, {self._in_features}]")
        if x.dtype != torch.bfloat16:
            problems.append(f"x: dtype {x.dtype}, expected torch.bfloat16")
        if x.dim() == 2 and x.stride(-1) != 1:
            problems.append("x: columns must be contiguous (stride 1)")
        if x.data_ptr() % 16:
            problems.append("x: data must be 16-byte aligned")
        if x.device != self._device:
            problems.append(f"x: on {x.device}, weights on {self._device}")
        m = x.shape[0] if x.dim() == 2 else 0
        if not self.supports(m):
            problems.append(f"x: M={m} outside the compiled range 1..{self.max_tokens}")
        _raise(type(self).__name__, problems)
        first_call(self, m)
        return m

    def _output(self, m: int, out: Tensor | None) -> Tensor:
        if out is None:
            return torch.empty(m, self.n, dtype=self.out_dtype, device=self._device)
        if out.shape != (m, self.n) or out.dtype != self.out_dtype or out.stride(-1) != 1:
            raise ValueError(
                f"{type(self).__name__}: out must be [{m}, {self.n}] {self.out_dtype} with "
                f"contiguous columns, got {tuple(out.shape)} {out.dtype} strides {out.stride()}"
            )
        return out

    def _scratch(self, tile: Tile) -> Tensor:
        tiles = -(-self.n // tile.bn)
        size = tile.split_k * tiles * tile.bn * tile.bm if tile.split_k > 1 else 1
        return torch.empty(size, dtype=torch.float32, device=self._device)


class Projection(_SkinnyGemm):
    """BF16 projection y [M, N] = x [M, K] @ weightᵀ (weight [N, K] BF16), M <= max_tokens.

    `split_k_tokens`: the token counts allowed to split K (default: all; the plan still picks
    one split where N alone fills the GPU). `out_dtype`: BF16 (default) or FP32; FP32 with
    `bf16_values` holds the BF16-rounded sums (what a BF16 GEMM then `.float()` gives: an LM
    head's logits, without the cast's launch). `blocks` B:
    B projections of equal shapes in one launch, block-diagonal — x [M, B·K], weight the B
    weights stacked [N, K], output block b (columns b·N/B ..) from x's columns b·K .. (two
    low-rank up-projections whose inputs are adjacent columns of one projection's output).
    `then` [N2, K]: a second weight of the same input, read in place as output columns
    N..N+N2 (two projections in one launch, one wave over the SMs where each alone fills
    half: the MLA q_b and the indexer's wq_b); N must be a multiple of every column tile.
    """

    def __init__(
        self,
        weight: Tensor,
        split_k_tokens: Iterable[int] | None = None,
        *,
        out_dtype: torch.dtype = torch.bfloat16,
        max_tokens: int = MAX_TOKENS,
        blocks: int = 1,
        bf16_values: bool = False,
        then: Tensor | None = None,
    ):
        problems: list[str] = []
        _check_weight("weight", weight, (torch.bfloat16,), problems)
        if then is not None:
            _check_weight("then", then, (torch.bfloat16,), problems)
            if then.dim() == 2 and weight.dim() == 2 and then.shape[1] != weight.shape[1]:
                problems.append(f"then: K={then.shape[1]}, the weight's is {weight.shape[1]}")
            if then.device != weight.device:
                problems.append(f"then: on {then.device}, weight on {weight.device}")
            if blocks != 1:
                problems.append("then: with blocks=1 only")
        if out_dtype not in (torch.bfloat16, torch.float32):
            problems.append(f"out_dtype {out_dtype}: expected bfloat16 or float32")
        if bf16_values and out_dtype != torch.float32:
            problems.append("bf16_values: for a float32 output (a BF16 one holds them already)")
        if blocks < 1 or weight.shape[0] % blocks:
            problems.append(f"blocks={blocks}: must divide the weight's {weight.shape[0]} rows")
        _raise(type(self).__name__, problems)
        self.weight, self.out_dtype, self._device = weight, out_dtype, weight.device
        self.blocks, self.bf16_values, self.then = blocks, bf16_values, then
        n, k = weight.shape
        super().__init__(n + (0 if then is None else then.shape[0]), k, weight.device,
                         split_k_tokens, max_tokens)  # fmt: skip
        uneven = sorted({t.bn for t in self.tiles.values() if n % t.bn})
        if then is not None and uneven:  # a column tile must not straddle the two weights
            raise ValueError(f"Projection: the first weight's {n} rows are not a multiple of "
                             f"the column tiles {uneven}")  # fmt: skip
        self.n_first = n
        uneven = sorted({t.bn for t in self.tiles.values() if (self.n // blocks) % t.bn})
        if blocks > 1 and uneven:  # a column tile must not straddle two blocks
            raise ValueError(f"Projection: {self.n // blocks} columns a block is not a multiple "
                             f"of the column tiles {uneven}")  # fmt: skip

    @property
    def _in_features(self) -> int:
        return self.blocks * self.k

    def __call__(self, x: Tensor, out: Tensor | None = None) -> Tensor:
        """x [M, B·K] BF16 -> [M, N] out_dtype (written into `out` when given)."""
        from .triton_skinny import bf16_gemm_kernel

        m = self._check_input(x)
        t = self.tiles[m]
        out = self._output(m, out)
        k_tiles = -(-self.k // t.bk)
        grid = (-(-self.n // t.bn), t.split_k)
        bf16_gemm_kernel[grid](
            x, self.weight, out, self._scratch(t), self._counts,
            m, self.n, self.k, x.stride(0), out.stride(0), -(-k_tiles // t.split_k),
            self.n // self.blocks,
            BM=t.bm, BN=t.bn, BK=t.bk, SPLIT_K=t.split_k, EVEN_K=self.k % t.bk == 0,
            INTERPRETER=interpreting(), PDL=t.pdl, PREFETCH=t.prefetch,
            ROUND_BF16=self.bf16_values, THEN=self.then is not None,
            w2_off=0 if self.then is None else _offset(self.weight, self.then),
            n_first=self.n_first, num_warps=t.warps, num_stages=t.stages, launch_pdl=t.pdl,
        )  # fmt: skip
        return out


class Router(Projection):
    """MoE router logits: x [M, hidden] BF16 @ gate weight [E, hidden]ᵀ BF16 -> [M, E] FP32,
    split-K at every token count (288 experts alone fill only a few CTAs)."""

    def __init__(self, weight: Tensor, *, max_tokens: int = MAX_TOKENS):
        super().__init__(weight, None, out_dtype=torch.float32, max_tokens=max_tokens)


class Fp8Linear(_SkinnyGemm):
    """Block-FP8 linear y [M, N] BF16 = quant(x [M, K] BF16) @ dequant(weight [N, K] e4m3)ᵀ.

    weight_scale_inv [⌈N/128⌉, K/128]: FP32, or torch.float8_e8m0fnu (UE8M0 exponents). `ue8m0`
    rounds the per-token 1×128 activation scales up to powers of two (DeepGEMM's E8M0 mode).
    With `swiglu_limit` the input is a gate_up output [M, 2K] and the op computes
    down(swiglu(x)) — the second half of an FP8 MLP. K must be a multiple of 128.
    """

    fp8 = True

    def __init__(
        self,
        weight: Tensor,
        weight_scale_inv: Tensor,
        *,
        ue8m0: bool = False,
        swiglu_limit: float | None = None,
        split_k_tokens: Iterable[int] | None = None,
        out_dtype: torch.dtype = torch.bfloat16,
        max_tokens: int = MAX_TOKENS,
    ):
        problems: list[str] = []
        _check_weight("weight", weight, (torch.float8_e4m3fn,), problems)
        s = weight_scale_inv
        if s.dtype not in (torch.float32, torch.float8_e8m0fnu):
            problems.append(f"weight_scale_inv: dtype {s.dtype}, expected float32 or e8m0fnu")
        if weight.dim() == 2:
            n, k = weight.shape
            if k % GROUP:
                problems.append(f"weight: K={k} is not a multiple of {GROUP}")
            want = (-(-n // GROUP), k // GROUP)
            if tuple(s.shape) != want or not s.is_contiguous():
                problems.append(
                    f"weight_scale_inv: shape {tuple(s.shape)}, expected contiguous {want}"
                )
        if s.device != weight.device:
            problems.append(f"weight_scale_inv: on {s.device}, weight on {weight.device}")
        if swiglu_limit is not None and not swiglu_limit > 0:
            problems.append(f"swiglu_limit={swiglu_limit}: must be > 0")
        if out_dtype not in (torch.bfloat16, torch.float32):
            problems.append(f"out_dtype {out_dtype}: expected bfloat16 or float32")
        _raise(type(self).__name__, problems)
        self.weight, self.out_dtype, self._device = weight, out_dtype, weight.device
        e8m0 = s.dtype == torch.float8_e8m0fnu
        self.scale = s.view(torch.uint8) if e8m0 else s
        self.scale_e8m0, self.ue8m0, self.swiglu_limit = e8m0, ue8m0, swiglu_limit
        super().__init__(*weight.shape, weight.device, split_k_tokens, max_tokens)

    @property
    def _in_features(self) -> int:
        return 2 * self.k if self.swiglu_limit is not None else self.k

    def __call__(self, x: Tensor, out: Tensor | None = None) -> Tensor:
        """x [M, K] BF16 (SwiGLU: [M, 2K]) -> [M, N] out_dtype (into `out` when given)."""
        m = self._check_input(x)
        return self._launch(x, m, self._output(m, out))

    def _split_partials(self, x: Tensor, m: int) -> Tensor | None:
        """The product's FP32 split-K partials [splits, M, N], left for the consumer to sum
        (DenseMlp's SwiGLU quantization), or None where this token count's plan does not
        split K."""
        t = self.tiles[m]
        if t.split_k == 1:
            return None
        parts = torch.empty(t.split_k, m, self.n, dtype=torch.float32, device=x.device)
        return self._launch(x, m, parts, partials=True)

    def _launch(
        self, x: Tensor, m: int, out: Tensor, *, partials: bool = False, parts: int = 0
    ) -> Tensor:
        """Quantize (unless the plan does it in the GEMM) and run the GEMM into `out`.
        `partials`: out is [splits, M, N] FP32 and the splits are not reduced; `parts`: x is
        such a [parts, M, 2K] producer output (SwiGLU input), summed while quantizing."""
        from .triton_skinny import fp8_gemm_kernel, quantize_tokens_kernel

        t = self.tiles[m]
        if GROUP % t.bn:  # the kernel reads one weight-scale row per column tile
            raise ValueError(f"{type(self).__name__}: tile BN={t.bn} must divide {GROUP}")
        k_tiles = self.k // GROUP
        limit = self.swiglu_limit if self.swiglu_limit is not None else math.inf
        swiglu, scales = self.swiglu_limit is not None, self.scale  # scales: a placeholder
        if t.quantize_first or parts:
            xq = torch.empty(m, self.k, dtype=torch.float8_e4m3fn, device=x.device)
            scales = torch.empty(m, k_tiles, dtype=torch.float32, device=x.device)
            groups = _parts_groups(m, k_tiles) if parts else QUANT_GROUPS
            quantize_tokens_kernel[(m, -(-k_tiles // groups))](
                x, xq, scales, m, self.k, x.stride(-2), limit,
                GROUPS=groups, UE8M0=self.ue8m0, SWIGLU=swiglu, INTERPRETER=interpreting(),
                PDL=t.pdl, PARTS=parts, num_warps=4, launch_pdl=t.pdl,
            )  # fmt: skip
            x, swiglu = xq, False
        per_split = -(-k_tiles // t.split_k)
        per_split += -per_split % t.blocks
        scratch = out if partials else self._scratch(t)  # unreduced partials need no fixup
        fp8_gemm_kernel[(-(-self.n // t.bn), t.split_k)](
            x, scales, self.weight, self.scale, out, scratch, self._counts,
            m, self.n, self.k, x.stride(0), out.stride(-2), per_split, limit,
            BM=t.bm, BN=t.bn, SPLIT_K=t.split_k, KB=t.blocks, UE8M0=self.ue8m0,
            SCALE_E8M0=self.scale_e8m0, SWIGLU=swiglu, X_FP8=t.quantize_first or bool(parts),
            INTERPRETER=interpreting(), PDL=t.pdl, PREFETCH=t.prefetch, PARTIALS=partials,
            num_warps=t.warps, num_stages=t.stages, launch_pdl=t.pdl,
        )  # fmt: skip
        return out


class DenseMlp:
    """FP8 SwiGLU MLP as two skinny GEMMs: x [M, D] BF16 -> [M, D] BF16 (TP-partial when the
    weights are one rank's shard).

    gate_up [2I, D] e4m3 (gate rows, then up rows) with scales [2I/128, D/128]; down [D, I]
    e4m3 with scales [D/128, I/128]; clamped SwiGLU at `swiglu_limit`, formed where the
    down GEMM's activations are quantized. Numerics follow vLLM's stock sequence (BF16
    between the GEMMs, also where gate_up's split-K partials are summed by that quantization).
    """

    def __init__(
        self,
        gate_up: Tensor,
        gate_up_scale_inv: Tensor,
        down: Tensor,
        down_scale_inv: Tensor,
        swiglu_limit: float,
        ue8m0: bool = False,
        *,
        max_tokens: int = MAX_TOKENS,
    ):
        if gate_up.dim() == 2 and down.dim() == 2 and gate_up.shape[0] != 2 * down.shape[1]:
            raise ValueError(
                f"{type(self).__name__}: gate_up rows {gate_up.shape[0]} != 2 x down columns "
                f"{down.shape[1]}"
            )
        self.gate_up = Fp8Linear(gate_up, gate_up_scale_inv, ue8m0=ue8m0, max_tokens=max_tokens)
        self.down = Fp8Linear(
            down, down_scale_inv, ue8m0=ue8m0, swiglu_limit=swiglu_limit, max_tokens=max_tokens
        )
        self._ready: set[int] = set()

    def supports(self, m: int) -> bool:
        return self.gate_up.supports(m)

    def prepare(self, tokens: Iterable[int]) -> None:
        """Compile and run once for each token count (do this before CUDA-graph capture):
        the MLP's own launches, and each GEMM's standalone ones (they are callable too)."""
        tokens = list(tokens)
        self.gate_up.prepare(tokens)
        self.down.prepare(tokens)
        for m in tokens:
            self(torch.zeros(m, self.gate_up.k, dtype=torch.bfloat16, device=self.gate_up._device))

    def __call__(self, x: Tensor, out: Tensor | None = None) -> Tensor:
        """x [M, D] BF16 -> [M, D] BF16.

        Where gate_up splits K, its FP32 partials go unreduced to the down GEMM's SwiGLU
        quantization, which sums them in the fixup's order and rounding (so the same values):
        the fixup's release, counter and L2 round trips cost gate_up 1.6-3.3 us on the H200."""
        m = self.gate_up._check_input(x)
        first_call(self, m)
        out = self.down._output(m, out)
        parts = self.gate_up._split_partials(x, m)
        if parts is None:
            h = self.gate_up._launch(x, m, self.gate_up._output(m, None))
            return self.down._launch(h, m, out)
        return self.down._launch(parts, m, out, parts=parts.shape[0])
