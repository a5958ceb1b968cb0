"""A KDA layer's decode / verify step at GLM-5.3-Flash's heads (K = V = 128, conv width 4, the
safe gate at -5): `KdaDecode` (one launch) vs the stock path as vLLM 0.33 runs it, the torch
reference, and the HBM floor.

Two stocks, vLLM 0.33's decode ops for the two KDA models it ships. "glm" (GLM-5.3-Flash's
own, what a vLLM server runs for this model: `Glm5NextLinearAttention`): its
`causal_conv1d_update`, GLM-5's `fused_recurrent_kda` with the gate, beta and q / k norms in
the kernel and `num_accepted_tokens` for a verify, vLLM's `rms_norm_gated`
(`glm5_runtime.vllm_stock.kda_core`, the whole-step `VllmStock`'s KDA core). "fla" (Kimi-K3's
`KimiGatedDeltaNet._forward`): the same conv, the fla recurrence
(`fused_recurrent_kda_packed_decode` for one token, `fused_recurrent_kda` for a verify), then
fla-core's `rms_norm_gated` and vLLM's copy of its result into the attention output. Both
take their int32 indices and contiguous q | k | v built outside the graph, as vLLM's
metadata builder and projection hand them (once a step, for every layer). vLLM is not
installed on the GPU host: `--vllm-ops DIR` names a folder of vLLM 0.33's files
(`benchmarks/vllm_files.py` makes it), loaded by `glm5_runtime.vllm_stock.VllmKernels` with
stand-ins for the vLLM helpers they import.

Floor: the bytes a step must move ÷ `hbm_bandwidth()` of the same run — the recurrent state
read once and written once per stored token, the conv window read and its new columns
written, the projections' rows read, the output written, the layer's small weights.
Timing: CUDA-graph replays, median; every call in a graph on its own state slots and inputs
(more than L2 in all). Each case checks ours and the stock path against the reference first.

    PYTHONPATH=packages/glm5-kernels/src:packages/glm5-runtime/src:packages/glm5-policy/src \\
        python benchmarks/kda_decode.py --vllm-ops DIR --out benchmarks/results/kda_decode_h200.json
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
from provenance import floor_bandwidth, provenance, result_args, write_result

from glm5_kernels.kda import KdaDecode, kda_decode_ref
from glm5_kernels.timing import graph_calls_us
from glm5_runtime.bench import call_launches
from glm5_runtime.vllm_stock import VllmKernels, kda_core

K = V = 128
W, LOWER_BOUND, EPS = 4, -5.0, 1e-5
L2_BYTES = 50 << 20
# (BV, warps, launches): one launch (the fused kernel), two (conv / norms / gates, then the
# recurrence: slices of at most 16 rows a warp, beyond which its state spills).
SWEEP = ((16, 1, 1), (16, 2, 1), (16, 4, 1), (32, 1, 1), (32, 2, 1), (32, 4, 1), (64, 4, 1),
         (64, 8, 1), (128, 4, 1), (128, 8, 1), (128, 16, 1), (16, 1, 2), (16, 2, 2), (32, 2, 2),
         (32, 4, 2), (64, 4, 2), (64, 8, 2), (128, 8, 2))  # fmt: skip


def vllm_ops(folder: str) -> VllmKernels:
    """vLLM 0.33's KDA decode kernels (its causal conv, GLM-5's and Kimi's recurrences, its
    gated norm) from the folder."""
    return VllmKernels(folder)


def weights(heads: int, gen):
    c = heads * (2 * K + V)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, device="cuda") * scale

    return dict(conv_weight=randn(c, W, scale=W**-0.5).bfloat16(),
                dt_bias=randn(heads * K, scale=0.5), A_log=randn(heads, scale=0.5),
                norm_weight=(1 + randn(V, scale=0.1)).bfloat16(),
                lower_bound=LOWER_BOUND, eps=EPS)  # fmt: skip


def step_inputs(heads: int, r: int, q: int, first_slot: int, gen):
    """One call's projections (q | k | v read from a wider row, as vLLM's fused in_proj
    lays them out) and its placement: request i owns slots first_slot + i*q .. + q-1; a
    verify resumes from a random accepted token."""
    c = heads * (2 * K + V)
    wide = torch.randn(r, q, c + 2 * heads * K, generator=gen, device="cuda").bfloat16()
    x = (wide[..., :c], torch.randn(r, q, heads * K, generator=gen, device="cuda").bfloat16(),
         torch.randn(r, q, heads, generator=gen, device="cuda").bfloat16(),
         torch.randn(r, q, heads * V, generator=gen, device="cuda").bfloat16())  # fmt: skip
    owned = first_slot + torch.arange(r * q, device="cuda").view(r, q)
    accepted = torch.randint(1, q + 1, (r,), generator=gen, device="cuda")
    verify = q > 1
    read = owned[torch.arange(r, device="cuda"), accepted - 1] if verify else owned[:, 0]
    write = owned if verify else owned[:, :1]
    place = dict(conv_slots=owned[:, 0], conv_offset=accepted - 1 if verify else accepted * 0,
                 read_slots=read, write_slots=write, keep=verify)  # fmt: skip
    # What vLLM hands its kernels: int32 indices (its metadata builder's, once a step) and
    # q | k | v contiguous (its projection's output).
    n = r * q
    vllm = dict(qkv=x[0].reshape(n, c).contiguous(), conv=owned[:, 0].int(),
                states=(owned if verify else read).int().contiguous(),
                accepted=accepted.int() if verify else None,
                starts=torch.arange(0, n + 1, q, dtype=torch.int32, device="cuda"))  # fmt: skip
    return x, place, vllm


def fla_step(vk: VllmKernels, w, heads, x, vllm, conv, rec):
    """Kimi-K3's decode ops on this step (its `_forward`, spec-only or decode-only)."""
    from fla.modules.fused_norm_gate import rms_norm_gated

    _, f, b, gate = x
    r, q = f.shape[:2]
    n, qkv = r * q, vllm["qkv"]
    state = conv.transpose(-1, -2)  # the SD cache seen as (dim, state_len), as vLLM does
    g1 = f.reshape(1, n, heads, K)
    beta = b.reshape(1, n, heads)
    core = torch.empty(1, n, heads, V, dtype=qkv.dtype, device="cuda")
    if q == 1:
        mixed = vk.conv.causal_conv1d_update(
            qkv, state, w["conv_weight"], None, activation="silu", conv_state_indices=vllm["conv"],
            validate_data=False, out=torch.empty_like(qkv),
        )  # fmt: skip
        o, _ = vk.kimi.fused_recurrent_kda_packed_decode(
            mixed_qkv=mixed, raw_g=g1, raw_beta=beta, A_log=w["A_log"], dt_bias=w["dt_bias"],
            lower_bound=LOWER_BOUND, initial_state=rec, state_indices=vllm["conv"],
        )  # fmt: skip
        core[0] = o[0].view(n, heads, V)
    else:
        mixed = vk.conv.causal_conv1d_update(
            qkv, state, w["conv_weight"], None, activation="silu", conv_state_indices=vllm["conv"],
            num_accepted_tokens=vllm["accepted"], query_start_loc=vllm["starts"],
            max_query_len=q, validate_data=False, out=torch.empty_like(qkv),
        )  # fmt: skip
        qs, ks, vs = (t.reshape(1, n, heads, -1) for t in mixed.split(heads * K, dim=-1))
        vk.kimi.fused_recurrent_kda(
            q=qs, k=ks, v=vs, raw_g=g1, raw_beta=beta, A_log=w["A_log"], dt_bias=w["dt_bias"],
            lower_bound=LOWER_BOUND, initial_state=rec, cu_seqlens=vllm["starts"],
            ssm_state_indices=vllm["states"], num_accepted_tokens=vllm["accepted"], out=core,
        )  # fmt: skip
    normed = rms_norm_gated(core, gate.reshape(1, n, heads, V), w["norm_weight"], None,
                            activation="sigmoid", eps=EPS)  # fmt: skip
    core.copy_(normed)
    return core.view(r, q, heads * V)


def glm_step(vk: VllmKernels, w, heads, x, vllm, conv, rec):
    """GLM-5.3-Flash's decode ops in vLLM on this step (`kda_core`; the conv writes its
    output over q | k | v, as vLLM's does over its projection's)."""
    _, f, b, gate = x
    r, q = f.shape[:2]
    placed = {k: vllm[k] for k in ("conv", "starts", "states", "accepted")}
    return kda_core(vk, vllm["qkv"].view(r, q, -1), f, b, gate, conv, rec, w["conv_weight"],
                    w["dt_bias"], w["A_log"], w["norm_weight"], LOWER_BOUND, placed)  # fmt: skip


def step_bytes(heads: int, r: int, q: int) -> int:
    c = heads * (2 * K + V)
    state = heads * V * K * 4
    stored = q if q > 1 else 1
    conv_cols = (W - 1) + (W - 2 + q if q > 1 else W - 1)
    rows = q * (c + heads * K + heads + heads * V) + q * heads * V
    small = c * W * 2 + heads * K * 4 + heads * 4 + V * 2
    return r * ((1 + stored) * state + conv_cols * c * 2 + rows * 2) + small


def case(op, vk, w, heads, r, q, bw, gen, sweep_tiles=()) -> dict:
    per_call = step_bytes(heads, r, q)
    copies = max(2, min(64, math.ceil(2 * L2_BYTES / per_call)))
    c, slots = heads * (2 * K + V), 1 + copies * r * q
    conv = torch.randn(slots, W - 2 + q, c, generator=gen, device="cuda").bfloat16()
    rec = 0.1 * torch.randn(slots, heads, V, K, generator=gen, device="cuda")
    steps = [step_inputs(heads, r, q, 1 + i * r * q, gen) for i in range(copies)]
    # The GLM path's conv writes over its q | k | v: its own copy, so the others read theirs.
    glm_in = [{**s[2], "qkv": s[2]["qkv"].clone()} for s in steps]
    caches = {name: (conv.clone(), rec.clone()) for name in ("ref", "ours", "glm", "fla")}
    paths = {
        "ours": [lambda s=s: op(*s[0], *caches["ours"], **s[1]) for s in steps],
        "glm": [lambda s=s, v=v: glm_step(vk, w, heads, s[0], v, *caches["glm"])
                for s, v in zip(steps, glm_in, strict=True)],
        "fla": [lambda s=s: fla_step(vk, w, heads, s[0], s[2], *caches["fla"]) for s in steps],
    }  # fmt: skip
    ref = [lambda s=s: kda_decode_ref(*s[0], *caches["ref"], **w, **s[1]) for s in steps]
    want = ref[0]()
    errors = {}
    for name, fns in paths.items():
        got = fns[0]()
        errors[name] = {
            "out": ((got.float() - want.float()).abs().max() / want.float().abs().max()).item(),
            "state": (caches[name][1] - caches["ref"][1]).abs().max().item(),
            "conv_equal": torch.equal(caches[name][0], caches["ref"][0]),
        }
    floor = per_call / bw * 1e6
    us, glm_us, fla_us = (graph_calls_us(fns) for fns in paths.values())
    ref_us = graph_calls_us(ref)
    sweep = {}
    for tile in sweep_tiles:
        op.tile = tile
        sweep["x".join(map(str, tile))] = graph_calls_us(paths["ours"])
    op.tile = None
    return {"heads": heads, "requests": r, "q": q, "us": us, "glm_us": glm_us, "fla_us": fla_us,
            "ref_us": ref_us, "floor_us": floor, "speedup_vs_glm": glm_us / us,
            "speedup_vs_fla": fla_us / us, "floor_ratio": us / floor,
            "launches": call_launches(paths["ours"][0]),
            "glm_launches": call_launches(paths["glm"][0]),
            "fla_launches": call_launches(paths["fla"][0]), "copies": copies, "errors": errors,
            "tile": op.plan(r, q), "tiles_us": sweep}  # fmt: skip


def gates_case(op, op_gates, vk, w, heads, r, q, bw, gen) -> dict:
    """The gates' low-rank up-projections (f_b [H*K, RF], g_b [H*V, RG] of `op_gates`) and the
    core, three ways: inside our kernel (the `fused_gates` choice: one launch), two cuBLAS
    GEMMs then our kernel (`fused`), the same GEMMs then vLLM's ops (the stock step's KDA).
    Every path on the same f_a / g_a rows, checked against the reference on the GEMMs'
    BF16 outputs first."""
    fb, gb = op_gates.f_b, op_gates.g_b
    per_call = step_bytes(heads, r, q) + fb.nbytes + gb.nbytes
    copies = max(2, min(64, math.ceil(2 * L2_BYTES / per_call)))
    c, slots = heads * (2 * K + V), 1 + copies * r * q
    conv = torch.randn(slots, W - 2 + q, c, generator=gen, device="cuda").bfloat16()
    rec = 0.1 * torch.randn(slots, heads, V, K, generator=gen, device="cuda")
    steps = []
    for i in range(copies):
        x, place, vllm = step_inputs(heads, r, q, 1 + i * r * q, gen)
        halves = torch.randn(r, q, fb.shape[1] + gb.shape[1], generator=gen, device="cuda")
        f_a, g_a = halves.bfloat16().split([fb.shape[1], gb.shape[1]], dim=-1)
        steps.append(((x[0], f_a, x[2], g_a), place, {**vllm, "qkv": vllm["qkv"].clone()}))

    def up(x):  # the split choices' GEMMs: cuBLAS, BF16 out
        return (x[0], x[1] @ fb.T, x[2], x[3] @ gb.T)

    caches = {name: (conv.clone(), rec.clone()) for name in ("ref", "gates", "split", "glm")}
    paths = {
        "gates": [lambda s=s: op_gates(*s[0], *caches["gates"], **s[1]) for s in steps],
        "split": [lambda s=s: op(*up(s[0]), *caches["split"], **s[1]) for s in steps],
        "glm": [lambda s=s: glm_step(vk, w, heads, up(s[0]), s[2], *caches["glm"])
                for s in steps],
    }  # fmt: skip
    want = kda_decode_ref(*up(steps[0][0]), *caches["ref"], **w, **steps[0][1])
    errors = {}
    for name, fns in paths.items():
        got = fns[0]()
        errors[name] = {
            "out": ((got.float() - want.float()).abs().max() / want.float().abs().max()).item(),
            "state": (caches[name][1] - caches["ref"][1]).abs().max().item(),
        }
    us = {name: graph_calls_us(fns) for name, fns in paths.items()}
    return {"heads": heads, "requests": r, "q": q, "rank": fb.shape[1],
            "gates_us": us["gates"], "split_us": us["split"], "glm_split_us": us["glm"],
            "floor_us": per_call / bw * 1e6,
            "launches": {n: call_launches(f[0]) for n, f in paths.items()},
            "copies": copies, "errors": errors, "tile": op_gates.plan(r, q)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--heads", default="16,64")
    parser.add_argument("--requests", default="1,2,4,8,16,32,64")
    parser.add_argument("--q", default="1,2,4")
    parser.add_argument("--sweep", action="store_true", help="time SWEEP's tiles too")
    parser.add_argument("--tiles", help="instead of --sweep's: BVxWARPSxLAUNCHES,...")
    parser.add_argument("--vllm-ops", help="folder of vLLM 0.33's files (vllm_files.py)")
    parser.add_argument("--gates", type=int, default=0, metavar="RANK",
                        help="instead: the gates' up-projections of this rank (GLM-5.3-Flash: "
                        "128) in our kernel vs cuBLAS GEMMs before ours / vLLM's ops")  # fmt: skip
    result_args(parser)
    args = parser.parse_args()
    if args.table:
        print(table(args.table))
        return
    if not args.vllm_ops:  # every row times vLLM's ops beside ours
        parser.error("--vllm-ops FOLDER is required (vLLM 0.33's files: vllm_files.py)")
    gen = torch.Generator("cuda").manual_seed(0)
    bw = floor_bandwidth()
    vk = vllm_ops(args.vllm_ops)
    rows, start = [], time.perf_counter()

    def save():  # after every case: a run cut short keeps what it measured
        result = provenance("kda_decode", args) | {
            "hbm_bytes_per_s": bw, "stock": {
                "glm": "vLLM 0.33 Glm5NextLinearAttention decode ops (kda_core)",
                "fla": "vLLM 0.33 KimiGatedDeltaNet decode ops + fla-core rms_norm_gated"},
            "rows": rows, "seconds": time.perf_counter() - start,
        }  # fmt: skip
        write_result(args.out, result)

    most = max(int(x) for x in args.requests.split(",")) * max(int(x) for x in args.q.split(","))
    tiles = SWEEP if args.sweep else ()
    if args.tiles:
        tiles = [tuple(int(n) for n in t.split("x")) for t in args.tiles.split(",")]
    for heads in (int(h) for h in args.heads.split(",")):
        w = weights(heads, gen)
        op = KdaDecode(**w, max_tokens=8)
        # Compiled for the largest step timed only: each step size compiles every tile and
        # token count up to it (minutes for 64 requests, twice with --gates).
        op.prepare([most])
        if args.gates:
            lr = [torch.randn(n, args.gates, generator=gen, device="cuda") * args.gates**-0.5
                  for n in (heads * K, heads * V)]  # fmt: skip
            op_gates = KdaDecode(**w, max_tokens=8, f_b=lr[0].bfloat16(), g_b=lr[1].bfloat16())
            op_gates.prepare([most])
        for q in (int(x) for x in args.q.split(",")):
            for r in (int(x) for x in args.requests.split(",")):
                if args.gates:
                    rows.append(gates_case(op, op_gates, vk, w, heads, r, q, bw, gen))
                    save()
                    print(json.dumps(rows[-1]))
                    continue
                row = case(op, vk, w, heads, r, q, bw, gen, tiles)
                rows.append(row)
                save()
                e = row["errors"]
                print(f"H={heads:2d} R={r:2d} q={q}: {row['us']:7.2f} µs (floor "
                      f"{row['floor_us']:6.2f}, ×{row['floor_ratio']:.2f}) glm "
                      f"{row['glm_us']:7.2f} (×{row['speedup_vs_glm']:.2f}) fla "
                      f"{row['fla_us']:7.2f} (×{row['speedup_vs_fla']:.2f}) ref "
                      f"{row['ref_us']:8.1f} [{row['launches']} / {row['glm_launches']} / "
                      f"{row['fla_launches']}] err "
                      + " ".join(f"{k} {v['out']:.1e}/{v['state']:.1e}/{v['conv_equal']}"
                                 for k, v in e.items())
                      + f" {row['tile']} {row['tiles_us']}")  # fmt: skip


def _cell(row: dict, key: str, digits: int = 1, over: float = 1.0, unit: str = "") -> str:
    return f"{row[key] / over:.{digits}f}{unit}" if key in row else "–"


def table(path: str) -> str:
    """The README's table: each stock's µs and launches, and each over our best tile ("–": a
    stock a run did not time; files before the GLM path timed Kimi's only)."""
    with open(path) as f:
        result = json.load(f)
    if result["rows"] and "gates_us" in result["rows"][0]:
        return gates_table(result)
    out = [
        f"{result['gpu']}, {result['date']}, commit {result['commit']}: `{result['command']}`",
        "",
        "| heads | requests | q | ours µs (× floor) | best µs (tile) | glm µs | fla µs | launches "
        "(ours / glm / fla) | glm / ours | fla / ours |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["rows"]:
        # The plan's own tile is a candidate too: the ratios are over the fastest of all.
        plan = "x".join(map(str, r["tile"])) if r.get("tile") else "plan"
        tiles = {plan: r["us"], **(r.get("tiles_us") or {})}
        best = min(tiles, key=tiles.get)

        out.append(
            f"| {r['heads']} | {r['requests']} | {r['q']} | {r['us']:.1f} "
            f"({r['floor_ratio']:.1f}×) | {tiles[best]:.1f} ({best}) | {_cell(r, 'glm_us')} | "
            f"{r['fla_us']:.1f} | {r['launches']} / {_cell(r, 'glm_launches', 0)} / "
            f"{r['fla_launches']} | {_cell(r, 'glm_us', 2, tiles[best], '×')} | "
            f"{r['fla_us'] / tiles[best]:.2f}× |"
        )
    return "\n".join(out)


def gates_table(result: dict) -> str:
    """The `--gates` run's table: µs per call of each path, launches, and over ours."""
    out = [
        f"{result['gpu']}, {result['date']}, commit {result['commit']}: `{result['command']}`",
        "",
        "| heads | requests | q | gates in our kernel µs (× floor) | cuBLAS + ours µs | "
        "cuBLAS + vLLM µs | launches | (cuBLAS + ours) / gates | (cuBLAS + vLLM) / gates |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["rows"]:
        n = r["launches"]
        out.append(
            f"| {r['heads']} | {r['requests']} | {r['q']} | {r['gates_us']:.1f} "
            f"({r['gates_us'] / r['floor_us']:.1f}×) | {r['split_us']:.1f} | "
            f"{r['glm_split_us']:.1f} | {n['gates']} / {n['split']} / {n['glm']} | "
            f"{r['split_us'] / r['gates_us']:.2f}× | {r['glm_split_us'] / r['gates_us']:.2f}× |"
        )
    return "\n".join(out)


if __name__ == "__main__":
    main()
