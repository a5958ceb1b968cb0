"""Compile the skinny-GEMM Triton kernels for one GPU architecture on this machine (Triton ships
ptxas) and check what the PTX must contain. Run as `python compile_cases.py 90|100`; the CPU
suite runs it in a child process, because under TRITON_INTERPRET=1 kernels cannot compile."""

import os
import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from glm5_kernels.gemm.triton_skinny import (
    bf16_gemm_kernel,
    fp8_gemm_kernel,
    quantize_tokens_kernel,
)

# Pointers and the sizes Triton sees divisible by 16 at real shapes (it specializes on that;
# w_shared, the shared expert's offset from the routed stack in bytes, is a multiple of the
# allocator's alignment: without it the expert kernels' weight loads are single bytes).
ALIGNED = {"N", "K", "stride_xm", "stride_om", "D", "I", "stride_lm", "w_shared"}
INTS = {n: "i32" for n in ("M", "N", "K", "stride_xm", "stride_om", "K_TILES", "n_block")}
COMMON = {"INTERPRETER": False, "PDL": True, "PREFETCH": 4}


# Kernels that read nothing before their PDL wait but L2 prefetches of their weights (the
# others read their own weights there: fn / norm / conv / value-up weights, an expert id
# two launches old). Every kernel: no pipelined (cp.async) load before the wait.
NOTHING_BEFORE_WAIT = frozenset({
    "bf16_gemm_kernel", "fp8_gemm_kernel", "quantize_tokens_kernel", "gate_up_kernel",
    "route_kernel", "router_route_kernel", "embed_kernel", "indexer_topk_kernel",
    "sparse_mla_split_kernel",
})  # fmt: skip


def _before_wait(ptx: str, name: str) -> None:
    """The PDL pitfall of a loop pipeliner hoisting the first iterations' loads above the
    wait (stale reads of the previous kernel's output): none in program order before it."""
    at = ptx.find("griddepcontrol.wait")
    if at < 0:
        return
    before = ptx[:at]
    assert "cp.async" not in before, f"{name}: a pipelined load before the PDL wait"
    if name in NOTHING_BEFORE_WAIT:
        assert "ld.global" not in before, f"{name}: a global load before the PDL wait"


def _spill_bytes(ptx: str, arch: int) -> int:
    """Bytes spilled to local memory compiling ptx, by the ptxas Triton itself runs for arch."""
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        done = subprocess.run([get_ptxas(arch).path, f"-arch=sm_{arch}a", "-v", f.name, "-o",
                               os.devnull], capture_output=True, text=True, check=True)  # fmt: skip
    return sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", done.stderr))


def _compile(kernel, types: dict, constexprs: dict, arch: int, aligned=(), **options) -> str:
    """`aligned`: more integer arguments Triton sees divisible by 16 (as it specializes them
    where they are at the real shapes)."""
    names = kernel.arg_names
    signature = {n: ("constexpr" if n in constexprs else types[n]) for n in names}
    attrs = {
        (names.index(n),): [["tt.divisibility", 16]]
        for n in names
        if n not in constexprs
        and (n in ALIGNED or n in aligned or types.get(n, "").startswith("*"))
    }
    src = ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options).asm["ptx"]
    _before_wait(ptx, kernel.fn.__name__)
    return ptx


def bf16_cases(arch: int) -> int:
    n = 0
    for bm, split in ((16, 1), (64, 4)):
        # As the LM head (FP32 logits of BF16 values) at split K; at one split, as the MLA q_b
        # with the indexer's wq_b after it (a second weight).
        head = split > 1
        types = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*fp32" if head else "*bf16"}
        types |= {"part_ptr": "*fp32", "count_ptr": "*i32", "w2_off": "i64", "n_first": "i32"}
        types |= INTS
        constexprs = {"BM": bm, "BN": 64, "BK": 128, "SPLIT_K": split, "EVEN_K": True, **COMMON}
        constexprs |= {"ROUND_BF16": head, "THEN": not head}
        ptx = _compile(bf16_gemm_kernel, types, constexprs, arch, num_warps=4, num_stages=4)
        if arch == 90:  # tensor cores, pipelined weight loads, programmatic dependent launch
            for needed in ("wgmma", "cp.async", "griddepcontrol.wait"):
                assert needed in ptx, f"bf16 BM={bm} split={split}: no {needed} in the PTX"
        n += 1
    return n


def fp8_cases(arch: int) -> int:
    n = 0
    # The quantize-first GEMM also as the MLP's gate_up (unreduced FP32 partials out), whose
    # consumer is the SwiGLU quantization summing those partials.
    for x_fp8, swiglu, e8m0 in ((False, False, False), (False, True, True), (True, False, False)):
        types = {"x_ptr": "*fp8e4nv" if x_fp8 else "*bf16", "xs_ptr": "*fp32"}
        types |= {"w_ptr": "*fp8e4nv", "ws_ptr": "*u8" if e8m0 else "*fp32"}
        types |= {"out_ptr": "*fp32" if x_fp8 else "*bf16", "part_ptr": "*fp32"}
        types |= {"count_ptr": "*i32", "limit": "fp32"}
        constexprs = {"BM": 32, "BN": 64, "SPLIT_K": 3, "KB": 2, "UE8M0": e8m0}
        constexprs["SCALE_E8M0"] = e8m0
        constexprs |= {"SWIGLU": swiglu, "X_FP8": x_fp8, "PARTIALS": x_fp8, **COMMON}
        ptx = _compile(fp8_gemm_kernel, types | INTS, constexprs, arch, num_warps=4, num_stages=4)
        if arch == 90:
            assert "wgmma" in ptx and "e4m3" in ptx, f"fp8 x_fp8={x_fp8}: no FP8 wgmma"
        for parts in (0, 3) if swiglu else (0,):
            types = {"x_ptr": "*fp32" if parts else "*bf16", "q_ptr": "*fp8e4nv"}
            types |= {"s_ptr": "*fp32", "M": "i32", "K": "i32", "stride_xm": "i32"}
            types["limit"] = "fp32"
            constexprs = {"GROUPS": 8, "UE8M0": e8m0, "SWIGLU": swiglu, "PARTS": parts}
            constexprs |= COMMON
            constexprs.pop("PREFETCH")
            _compile(quantize_tokens_kernel, types, constexprs, arch, num_warps=4)
            n += 1
        n += 1
    return n


def moe_cases(arch: int) -> int:
    """The MoE stage's kernels with the tiles its plans pick at the real shapes (288
    experts, top-8, hidden 4096; TP 1, 4 and 8 ranks; per-route and grouped; 1, 8, 64
    tokens; the router GEMM inside the routing launch on the Router's tiles), each distinct
    configuration once."""
    from types import SimpleNamespace

    from glm5_kernels.gemm.linear import plan
    from glm5_kernels.launch import next_pow2
    from glm5_kernels.moe.experts import GroupedExperts, MegaExperts
    from glm5_kernels.moe.triton_moe import (
        down_kernel,
        gate_up_kernel,
        route_kernel,
        router_route_kernel,
    )

    ints = {n: "i32" for n in ("M", "E", "D", "I", "G", "CHUNK", "stride_lm", "stride_xm")}
    ints["stride_om"] = "i32"
    ints |= {"w_shared": "i64", "ws_shared": "i64", "limit": "fp32", "scaling": "fp32"}
    ints["rows_total"] = "i32"
    ptrs = {"x_ptr": "*bf16", "xq_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv", "out_ptr": "*bf16"}
    ptrs |= {n: "*fp32" for n in ("logits_ptr", "bias_ptr", "weights_ptr", "xs_ptr", "rows_ptr")}
    for n in ("ids_ptr", "route_row_ptr", "group_expert_ptr", "group_row_ptr", "count_ptr"):
        ptrs[n] = "*i32"
    ptrs |= {"group_count_ptr": "*i32", "row_token_ptr": "*i32"}
    ptrs |= {"gate_ptr": "*bf16", "part_ptr": "*fp32", "K_TILES": "i32"}
    seen: set = set()
    for cls in (MegaExperts, GroupedExperts):
        for tp in (1, 4, 8):
            shape = SimpleNamespace(
                top_k=8, num_experts=288, hidden=4096, inter=2048 // tp,
                chunk_tokens=cls.chunk_tokens, shared=True,
            )  # fmt: skip
            for m in (1, 8, 64):
                p = MegaExperts._plan(shape, m, 132)
                e8m0 = m == 8  # UE8M0 weight scales and activation scales on some cases
                common = {"INTERPRETER": False, "PDL": True, "SCALE_E8M0": e8m0}
                types = ptrs | ints | {"act_ptr": "*bf16", "ws_ptr": "*u8" if e8m0 else "*fp32"}
                cases = [
                    (route_kernel, {"MAX_CHUNKS": -(-m // p.chunk), "TOP_K": 8, "KP": 8,
                                    "BR": max(2, next_pow2(m * 8)), "BE": 512, "ROUTE": m != 8,
                                    "UE8M0": e8m0, "QUANT_GROUPS": 8, "INTERPRETER": False,
                                    "PDL": True, "SHARED": True,
                                    "QUANT_APART": p.quantize_apart and m != 1,
                                    "RELEASE_EARLY": p.release_early}, p.warps_route, 1),
                    (gate_up_kernel, {"BM": p.bm, "BN": p.bn_gate_up, "KB": p.blocks,
                                      "SPLIT": p.split_gate_up, **common},
                     p.warps_gate_up, p.stages_gate_up),
                    (down_kernel, {"BM": p.bm, "BN": p.bn_down, "NT": p.tiles_down,
                                   "BT": max(2, next_pow2(m)), "TOP_K": 8, "KP": 8,
                                   "UE8M0": e8m0, "FINALIZE": m != 1, "PREFETCH": 2, "SHARED": True,
                                   **common},
                     p.warps_down, p.stages_down),
                ]  # fmt: skip
                if cls is MegaExperts:  # fused_router: the Router's tile for m tokens
                    t = plan(m, 288, 4096, sms=132, fp8=False, pdl=True)
                    cases.append((router_route_kernel, {
                        "MAX_CHUNKS": -(-m // p.chunk), "TOP_K": 8, "KP": 8,
                        "BR": max(2, next_pow2(m * 8)), "BE": 512, "BM": t.bm, "BN": t.bn,
                        "BK": t.bk, "SPLIT_K": t.split_k, "BT": min(4, next_pow2(m)),
                        "UE8M0": e8m0, "QUANT_GROUPS": 8, "INTERPRETER": False, "PDL": True,
                        "PREFETCH": t.prefetch, "SHARED": True,
                        "QUANT_APART": p.quantize_apart and m != 1},
                        t.warps, t.stages))  # fmt: skip
                if m == 1:  # the sweep's variants: gate_up's K split over 4 CTAs a tile,
                    # the routing launch releasing gate_up right after its wait
                    cases.append((gate_up_kernel, {"BM": p.bm, "BN": p.bn_gate_up,
                                                   "KB": p.blocks, "SPLIT": 4, **common},
                                  p.warps_gate_up, p.stages_gate_up))  # fmt: skip
                    route = next(c for k, c, _, _ in cases if k is route_kernel)
                    cases.append((route_kernel, {**route, "RELEASE_EARLY": True},
                                  p.warps_route, 1))  # fmt: skip
                if m == 8 and tp == 4:  # the shared expert beside the launches (shared=None)
                    cases += [(k, {**c, "SHARED": False}, w, st) for k, c, w, st in cases
                              if k is not gate_up_kernel]  # fmt: skip
                for kernel, constexprs, warps, stages in cases:
                    key = (kernel.fn.__name__, tuple(sorted(constexprs.items())), warps, stages)
                    if key in seen:
                        continue
                    seen.add(key)
                    ptx = _compile(kernel, types, constexprs, arch, num_warps=warps,
                                   num_stages=stages)  # fmt: skip
                    # The experts' streaming loops in registers, not local memory: a spill
                    # there costs more than the tile saves.
                    if kernel in (gate_up_kernel, down_kernel):
                        assert _spill_bytes(ptx, arch) == 0, (key, "spills")
                    if constexprs.get("RELEASE_EARLY"):  # released after the wait, once
                        wait = ptx.find("griddepcontrol.wait")
                        release = ptx.find("griddepcontrol.launch_dependents")
                        assert 0 <= wait < release, key
                        assert ptx.count("griddepcontrol.launch_dependents") == 1, key
                    if arch == 90 and kernel is router_route_kernel:  # a 16-row MMA, no wgmma
                        assert "mma" in ptx and "griddepcontrol.wait" in ptx, key
                    elif arch == 90 and kernel is not route_kernel:
                        assert "wgmma" in ptx and "griddepcontrol.wait" in ptx, key
    return len(seen)


def mhc_cases(arch: int) -> int:
    """The mHC boundary kernel at the real shape (4 streams, hidden 4096) with the plans'
    tiles at 1, 8 and 64 tokens: every mode, one launch (the wait) and the two phases; the
    all-reduce fused in (world 2)."""
    from types import SimpleNamespace

    from glm5_kernels.mhc.boundary import MhcBoundary, MhcConfig
    from glm5_kernels.mhc.triton_mhc import hc_boundary_kernel

    op = SimpleNamespace(config=MhcConfig(4, 4096, 1e-6, 1e-6, 20, 1e-5), _sms=132, _interp=False)
    op._tiles = lambda m, bd, warps: MhcBoundary._tiles(op, m, bd, warps)
    types = {n: "*bf16" for n in ("x_ptr", "res_ptr", "streams_ptr", "normed_ptr", "norm_ptr")}
    types |= {n: "*fp32" for n in ("post_ptr", "comb_ptr", "fn_ptr", "scale_ptr", "base_ptr")}
    types |= {n: "*fp32" for n in ("post_out_ptr", "comb_out_ptr", "part_ptr", "sum_ptr")}
    types |= {"bar_ptr": "*i32", "T": "i32", "D": "i32", "max_tokens": "i32"}
    types |= {n: "fp32" for n in ("rms_eps", "hc_eps", "norm_eps", "post_mult")}
    types |= {
        "xr_ptr": "*bf16",
        "peers_ptr": "*i64",
        "xstate_ptr": "*i32",
        "rank": "i32",
        "slot_elems": "i32",
    }
    n = 0
    # Every mode and the one-launch form at one token; the post at 8 and 64 tokens (other
    # tiles), there also as the two phases; the post, the head and the expansion with the
    # all-reduce in (world 2: one launch at 8 tokens, phase 1 at 64).
    cases = [(1, mode, head, 0, 1)
             for mode, head in ((1, False), (2, False), (2, True), (0, False))]  # fmt: skip
    cases += [(8, 2, False, 0, 1)] + [(64, 2, False, phase, 1) for phase in (0, 1, 2)]
    cases += [(8, 2, False, 0, 2), (8, 2, True, 0, 2), (64, 2, False, 1, 2), (8, 1, False, 0, 2)]
    for m, mode, head, phase, world in cases:
        p = MhcBoundary._plan(op, m)
        constexprs = {"H": 4, "BT": p.bt, "BD": p.bd, "BTR": min(16, m), "SR": p.sr,
                      "NMIX_P": 32, "MODE": mode, "STORE": mode != 0 and not head,
                      "HEAD": head, "SINKHORN": 20, "PHASE": phase, "INTERPRETER": False,
                      "PDL": True, "WORLD": world}  # fmt: skip
        if world == 1:  # the op passes a BF16 output as every unused mailbox pointer
            types |= {n: "*bf16" for n in ("peers_ptr", "xstate_ptr")}
        else:
            types |= {"peers_ptr": "*i64", "xstate_ptr": "*i32"}
        ptx = _compile(hc_boundary_kernel, types, constexprs, arch, num_warps=p.warps,
                       enable_fp_fusion=False)  # fmt: skip
        if phase == 0:  # the wait: acquire / release atomics, and PDL
            assert "atom" in ptx and "griddepcontrol.wait" in ptx, (m, mode, head)
        # The mailboxes' polls: masked volatile loads (the wait's is one unmasked word).
        polls = [line.strip() for line in ptx.splitlines() if "ld.volatile" in line]
        assert any(p.startswith("@") for p in polls) == (world > 1), (m, mode, head, world)
        n += 1
    return n


def kda_cases(arch: int) -> int:
    """The KDA decode kernel at GLM-5.3-Flash's head (K = V = 128, conv width 4, the safe
    gate): decodes (1 token) and verifies of 2, 4 and 8 tokens (every state kept) at the
    plan's tiles, a head split over 8 CTAs to one, and the softplus gate."""
    from glm5_kernels.kda.decode import state_early
    from glm5_kernels.kda.triton_kda import kda_decode_kernel

    types = {n: "*bf16" for n in ("qkv_ptr", "f_ptr", "b_ptr", "gate_ptr", "out_ptr", "conv_ptr",
                                  "fb_ptr", "gb_ptr")}  # fmt: skip
    types |= {n: "*fp32" for n in ("rec_ptr", "conv_w_ptr", "dt_bias_ptr", "a_log_ptr")}
    types |= {"norm_w_ptr": "*fp32", "part_ptr": "*fp32", "count_ptr": "*i32", "gbuf_ptr": "*fp32"}
    types |= {
        n: "*i64" for n in ("conv_slot_ptr", "conv_off_ptr", "read_slot_ptr", "write_slot_ptr")
    }
    types |= {n: "i32" for n in ("stride_qkv", "stride_f", "stride_b", "stride_g", "stride_out",
                                 "stride_cs", "stride_cc", "stride_rs", "H")}  # fmt: skip
    types |= {n: "fp32" for n in ("q_scale", "lower_bound", "eps")}
    n = 0
    # (tokens, keep, safe gate, BV, warps, low-rank width): the plan's tiles, from 8 CTAs a
    # head to one; f_b and g_b in the kernel (GLM's 128-wide f_a / g_a) at both ends.
    cases = ((1, False, True, 16, 2, 0), (1, False, True, 128, 8, 0), (2, True, True, 32, 2, 0),
             (8, True, True, 128, 4, 0), (4, True, False, 64, 4, 0), (1, False, True, 16, 2, 128),
             (8, True, True, 128, 4, 128))  # fmt: skip
    shuffles = {}
    for t, keep, lb, bv, warps, rank in cases:
        tp = 1 << (t - 1).bit_length()
        constexprs = {"T": t, "TP": tp, "K": 128, "V": 128, "BV": bv, "W": 4,
                      "NCP": 1 << (1 + t).bit_length(), "KEEP": keep, "HAS_LB": lb, "RF": rank,
                      "RG": rank, "X8": rank > 0, "INTERPRETER": False,
                      "PDL": True, "STATE_EARLY": state_early(bv, warps)}  # fmt: skip
        ptx = _compile(kda_decode_kernel, types, constexprs, arch, num_warps=warps)
        # PDL, a split head's hand-off through an atomic, and no spills
        assert "griddepcontrol.wait" in ptx and ("atom" in ptx) == (bv < 128), (t, keep, lb, bv)
        assert "st.local" not in ptx, (t, keep, lb, bv)
        # The state slice read before the PDL wait where KdaDecode asks (a thread's share of
        # it in 32-bit words; unvectorized here, where the strides are not known aligned).
        before = ptx[: ptx.find("griddepcontrol.wait")]
        words = sum(int(v or 1) for v in re.findall(r"ld\.global[.a-z0-9:]*?(?:\.v(\d))?\.[bfu]32",
                                                     before))  # fmt: skip
        early = words >= bv * 128 // (warps * 32)
        assert early == constexprs["STATE_EARLY"], ("state read", t, bv, warps, words)
        shuffles[t, bv, warps, rank] = ptx.count("shfl.sync")
        n += 1
    # The gates' projection sums its products within a thread: a few shuffles more than the
    # plain kernel's, not a reduction over the lanes (1,540 against 179 at one token before).
    for t, bv, warps in ((1, 16, 2), (8, 128, 4)):
        plain, gates = shuffles[t, bv, warps, 0], shuffles[t, bv, warps, 128]
        assert gates <= 1.25 * plain, (t, bv, warps, plain, gates)
    return n + kda_two_launch_cases(arch, types)


def kda_two_launch_cases(arch: int, types: dict) -> int:
    """The two-launch KDA step at the real head: the inputs kernel (a decode; a verify of 8
    with the gates' projections) and the recurrence at slices of up to 16 rows a warp — no
    spill on SM90 in ptxas's own count (a slice of 32 rows a warp spilled: its state alone
    is 128 registers a thread; `st.local` in the PTX cannot see it), the state read before
    the PDL wait, as many shuffles as the rows' own sums need (a [1, K] row in another
    layout than the state's put each token's sums over every warp: ~1,800 shuffles and
    ~150 barriers at 32 x 4 and 4 tokens)."""
    from glm5_kernels.kda.triton_split import kda_inputs_kernel, kda_recurrence_kernel

    types = types | {n: "*fp32" for n in ("q_ptr", "k_ptr", "decay_ptr", "v_ptr", "beta_ptr")}
    aligned = ("stride_rs", "stride_out", "stride_cs", "stride_cc", "stride_g", "H")
    n = 0
    for t, keep, rank in ((1, False, 0), (8, True, 128)):
        constexprs = {"T": t, "TP": 1 << (t - 1).bit_length(), "K": 128, "V": 128, "W": 4,
                      "NCP": 1 << (1 + t).bit_length(), "KEEP": keep, "HAS_LB": True,
                      "RF": rank, "RG": rank, "X8": rank > 0, "INTERPRETER": False,
                      "PDL": True}  # fmt: skip
        warps = 8 if t > 4 else 4  # as KdaDecode launches it
        ptx = _compile(kda_inputs_kernel, types, constexprs, arch, aligned, num_warps=warps)
        assert _spill_bytes(ptx, arch) == 0, ("inputs", t, rank)
        n += 1
    # KdaDecode.plan's two-launch tiles, and a verify of 8 with the gates' projections.
    for t, keep, bv, warps, rank in ((1, False, 16, 1, 0), (1, False, 128, 8, 0),
                                     (2, True, 16, 1, 0), (2, True, 32, 4, 0),
                                     (4, True, 16, 1, 0), (4, True, 32, 4, 0),
                                     (8, True, 128, 8, 128)):  # fmt: skip
        constexprs = {"T": t, "TP": 1 << (t - 1).bit_length(), "K": 128, "V": 128, "BV": bv,
                      "NW": warps, "KEEP": keep, "RG": rank, "INTERPRETER": False,
                      "PDL": True}  # fmt: skip
        ptx = _compile(kda_recurrence_kernel, types, constexprs, arch, aligned, num_warps=warps)
        assert "ld.global" in ptx[: ptx.find("griddepcontrol.wait")], ("state after the wait", t)
        # SM100 under the GPU host's Triton (3.6): 4 bytes at the one-token 32 x 4 slice.
        assert _spill_bytes(ptx, arch) <= (0 if arch == 90 else 8), ("spills", t, bv, warps)
        rows = bv // warps  # a warp's rows: two sums over K a token, five shuffles each
        assert ptx.count("shfl.sync") <= 1.25 * (2 * t * rows * 5) + 64, (t, bv, warps)
        n += 1
    return n


def dsa_cases(arch: int) -> int:
    """The sparse MLA decode at GLM-5.3-Flash's latent (512) and value dim (256): the split
    attention and the merge + value-up, with the op's tiles and warps."""
    from glm5_kernels.dsa.attention import BH, BN, BV, BW, SB, WARPS
    from glm5_kernels.dsa.triton_attn import sparse_mla_split_kernel, value_up_kernel

    ints = ("N", "H", "W", "chunk", "bs", "stride_qn", "stride_qh", "stride_cb", "stride_c",
            "stride_bt", "stride_idx")  # fmt: skip
    split = {"q_ptr": "*bf16", "cache_ptr": "*bf16", "bt_ptr": "*i32", "req_ptr": "*i32",
             "idx_ptr": "*i32", "part_o_ptr": "*fp32", "part_ml_ptr": "*fp32", "scale": "fp32",
             **{n: "i32" for n in ints}}  # fmt: skip
    up = {"part_o_ptr": "*fp32", "part_ml_ptr": "*fp32", "w_ptr": "*bf16", "out_ptr": "*bf16",
          **{n: "i32" for n in ("N", "H", "Vd", "splits", "stride_wh", "stride_wv",
                                "stride_on", "stride_oh")}}  # fmt: skip
    common = {"L": 512, "INTERPRETER": False, "PDL": True}
    # The merge one split at a time (64 heads) and 8 at a time (16: attention.merge_unroll),
    # and row at a time (few rows: no MMA).
    cases = [(sparse_mla_split_kernel, split, {"BH": BH, "BW": BW, **common}),
             *((value_up_kernel, up, {"BN": BN, "BV": BV, "UNROLL": u, "SB": SB,
                                      "ROWWISE": rowwise, **common})
               for u, rowwise in ((1, False), (8, False), (8, True)))]  # fmt: skip
    for kernel, types, constexprs in cases:
        ptx = _compile(kernel, types, constexprs, arch, num_warps=WARPS)
        assert "griddepcontrol.wait" in ptx and "st.local" not in ptx, kernel.fn.__name__
        if arch == 90 and not constexprs.get("ROWWISE"):  # tensor cores
            assert "mma" in ptx, kernel.fn.__name__
    return len(cases)


def indexer_cases(arch: int) -> int:
    """The indexer's selection at GLM-5.3-Flash's shapes (32 heads of 128, pools of 16, the
    top 2048 tokens + tail) for block tables up to 128k tokens (8192 pools)."""
    from glm5_kernels.dsa.indexer import BC, BP, WARPS
    from glm5_kernels.dsa.triton_indexer import indexer_topk_kernel

    types = {"q_ptr": "*fp8e4nv", "qs_ptr": "*fp32", "w_ptr": "*fp32", "page_ptr": "*u8",
             "scale_ptr": "*fp32", "bt_ptr": "*i32", "req_ptr": "*i32", "pos_ptr": "*i32",
             "score_ptr": "*fp32", "pool_ptr": "*i32", "count_ptr": "*i32", "out_ptr": "*i32",
             "weight_scale": "fp32",
             **{n: "i32" for n in ("P", "S", "stride_pb", "per_split", "count", "width",
                                   "stride_qn", "stride_qh", "stride_sn", "stride_wn",
                                   "stride_bt",
                                   "stride_on")},
             }  # fmt: skip
    constexprs = {"IH": 32, "H": 32, "HD": 128, "KP": 16, "BP": BP, "PMAX": 8192, "BC": BC,
                  "TAIL": True, "PDL": True}  # fmt: skip
    ptx = _compile(indexer_topk_kernel, types, constexprs, arch, num_warps=WARPS)
    assert "griddepcontrol.wait" in ptx and "atom" in ptx, "indexer"
    assert "st.local" not in ptx, "indexer: register spills"
    if arch == 90:  # FP8 tensor cores
        assert "mma" in ptx and "e4m3" in ptx, "indexer"
    return 1


def kpool_cases(arch: int) -> int:
    """The indexer's pool write at GLM-5.3-Flash's shapes (32 heads of 128, pools of 16):
    on normed BF16 keys, and on the one projection's FP32 sums (RAW: the key norm inside)."""
    from glm5_kernels.dsa.triton_kpool import kpool_write_kernel

    for raw in (False, True):
        given = "*fp32" if raw else "*bf16"
        types = {"k_ptr": given, "g_ptr": given, "q_ptr": "*bf16", "tail_ptr": "*bf16",
                 "page_ptr": "*u8", "pscale_ptr": "*fp32", "ape_ptr": "*bf16",
                 "sign_ptr": "*bf16", "nw_ptr": "*fp32", "nb_ptr": "*fp32", "bt_ptr": "*i32",
                 "pos_ptr": "*i32", "trow_ptr": "*i32", "q8_ptr": "*fp8e4nv", "qs_ptr": "*fp32",
                 "had_scale": "fp32", "eps": "fp32",
                 **{n: "i32" for n in ("T", "ring", "S", "stride_pb", "block_size", "stride_k",
                                       "stride_g", "stride_qn", "stride_qh", "stride_tr",
                                       "stride_tc", "stride_bt")},
                 }  # fmt: skip
        constexprs = {"IH": 32, "H": 32, "HD": 128, "KP": 16, "RAW": raw, "INTERPRETER": False,
                      "PDL": True}  # fmt: skip
        ptx = _compile(kpool_write_kernel, types, constexprs, arch, num_warps=4)
        assert "griddepcontrol.wait" in ptx and "st.local" not in ptx, ("kpool", raw)
        if arch == 90:  # the Hadamard rotations on the tensor cores
            assert "mma" in ptx, ("kpool", raw)
    return 2


def latent_cases(arch: int) -> int:
    """The MLA input norms and latent write at GLM-5.3-Flash's widths (q_a 1536, kv_a 512)."""
    from glm5_kernels.dsa.triton_latent import latent_write_kernel

    types = {"x_ptr": "*bf16", "q_w_ptr": "*bf16", "kv_w_ptr": "*bf16", "slot_ptr": "*i64",
             "q_ptr": "*bf16", "latent_ptr": "*bf16", "stride_x": "i32", "stride_s": "i32",
             "eps": "fp32"}  # fmt: skip
    constexprs = {"Q": 1536, "L": 512, "BQ": 2048, "BL": 512, "INTERPRETER": False, "PDL": True}
    ptx = _compile(latent_write_kernel, types, constexprs, arch, num_warps=4)
    assert "griddepcontrol.wait" in ptx and "st.local" not in ptx, "latent"
    return 1


def embed_cases(arch: int) -> int:
    """The vocab-parallel embedding at GLM-5.3-Flash's width (4096: four 1024-column CTAs a
    row), int64 ids."""
    from glm5_kernels.embed.triton_embed import embed_kernel

    types = {"ids_ptr": "*i64", "table_ptr": "*bf16", "out_ptr": "*bf16", "stride_i": "i32",
             "stride_t": "i32", "start": "i32", "V": "i32", "D": "i32"}  # fmt: skip
    ptx = _compile(embed_kernel, types, {"BD": 1024, "PDL": True}, arch, num_warps=4)
    assert "griddepcontrol.wait" in ptx and "st.local" not in ptx, "embed"
    return 1


if __name__ == "__main__":
    arch = int(sys.argv[1])
    print(f"triton {os.path.dirname(os.path.dirname(triton.__file__))} {triton.__version__}")
    gemm = bf16_cases(arch) + fp8_cases(arch)
    print(f"sm{arch}: compiled {gemm} kernels")
    print(f"sm{arch}: compiled {moe_cases(arch)} MoE kernels")
    print(f"sm{arch}: compiled {mhc_cases(arch)} mHC kernels")
    print(f"sm{arch}: compiled {kda_cases(arch)} KDA kernels")
    dsa = dsa_cases(arch) + indexer_cases(arch) + kpool_cases(arch) + latent_cases(arch)
    print(f"sm{arch}: compiled {dsa} DSA kernels")
    print(f"sm{arch}: compiled {embed_cases(arch)} embedding kernel")
