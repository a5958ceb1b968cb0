"""`bench --kernels` off the GPU: kernels assigned to the range around their launch and timed
from the replays, the owners' bytes summing to the step's floor, the ranges the planned
step runs in (the decode and the backbone left as they were), the table from a result."""

import json

import pytest
import torch
from decode_cases import ALL_STAGES
from torch.profiler import ProfilerActivity, profile

from glm5_policy import DecodeConfig
from glm5_runtime.bench import _fill_caches, _step, _token_ids
from glm5_runtime.decode import SpecializedDecode
from glm5_runtime.floor import floor_bytes
from glm5_runtime.kernel_table import (
    OUTSIDE,
    UNATTRIBUTED,
    assign,
    owner_bytes,
    owner_rows,
    owners,
    short_name,
)
from glm5_runtime.reference import ReferenceModel, geometry
from glm5_runtime.reference.backbone import ReferenceBackbone
from glm5_runtime.results import STAGES, table


def _span(name, ts, dur, cat="user_annotation"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def _launch(correlation, ts):
    return {"ph": "X", "cat": "cuda_driver", "name": "cuLaunchKernelEx", "ts": ts, "dur": 1,
            "args": {"correlation": correlation}}  # fmt: skip


def _kernel(name, correlation, ts, dur=1.0):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur,
            "args": {"correlation": correlation}}  # fmt: skip


def test_kernels_take_the_innermost_range_around_their_launch_and_the_replays_times():
    eager = [
        _span("stock moe", 0, 100), _span("stage moe", 10, 40), _span("stage boundary", 150, 20),
        _launch(1, 20), _launch(2, 60), _launch(3, 200), _launch(4, 155),
        _kernel("gemv", 1, 1000), _kernel("copy", 2, 1010), _kernel("gemv", 3, 1020),
        _kernel("hc_boundary_kernel", 4, 1015),
        _launch(5, 30), _kernel("check", 5, 1005),  # eager only: a check skipped in capture
    ]  # fmt: skip
    # Two replays, each graph launch one correlation; the second runs a kernel more.
    replays = [
        _kernel("gemv", 10, 0, 5.0), _kernel("copy", 10, 1, 7.0),
        _kernel("hc_boundary_kernel", 10, 2, 3.0), _kernel("gemv", 10, 3, 9.0),
        _kernel("gemv", 11, 10, 6.0), _kernel("copy", 11, 11, 8.0),
        _kernel("hc_boundary_kernel", 11, 12, 4.0), _kernel("gemv", 11, 13, 10.0),
        _kernel("extra", 11, 14, 2.0),
    ]  # fmt: skip
    rows = assign(eager, replays, 2)
    assert [(r["kernel"], r["owner"], r["us"]) for r in rows] == [
        ("gemv", "moe", 5.5),  # k-th of a name in a replay: the k-th launched eagerly
        ("copy", "stock moe", 7.5),
        ("hc_boundary_kernel", "boundary", 3.5),
        ("gemv", OUTSIDE, 9.5),
        ("extra", UNATTRIBUTED, 2.0),
    ]


def test_replays_without_launch_correlations_split_in_equal_runs():
    eager = [_launch(1, 5), _kernel("a", 1, 10), _launch(2, 6), _kernel("b", 2, 11)]
    replays = [_kernel(n, None, t, d) for t, (n, d) in enumerate([("a", 1), ("b", 2)] * 3)]
    rows = assign(eager, replays, 3)
    assert [(r["kernel"], r["us"]) for r in rows] == [("a", 1.0), ("b", 2.0)]
    with pytest.raises(RuntimeError, match="cannot split"):
        assign(eager, replays[:-1], 3)


def test_short_names():
    copy = (
        "void at::native::vectorized_elementwise_kernel<4, at::native::direct_copy_kernel_cuda("
        "at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda(float)#1}, "
        "std::array<char*, 2ul> >(int, at::native::direct_copy_kernel_cuda(...))"
    )
    mean = (
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::"
        "MeanOps<float, float, float, float>, unsigned int, float, 4, 4> >(...)"
    )
    mul = (
        "void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<at::"
        "native::BinaryFunctor<float, float, float, at::native::binary_internal::MulFunctor<"
        "float> > >(at::TensorIteratorBase&)::{lambda(int)#1}>(int, ...)"
    )
    assert short_name(copy) == "vectorized_elementwise_kernel[direct_copy]"
    assert short_name(mean) == "reduce_kernel[MeanOps]"
    assert short_name(mul) == "elementwise_kernel[MulFunctor]"
    assert short_name("hc_boundary_kernel") == "hc_boundary_kernel"
    cute = "kernel_cutlass_kernel_glm5_kernelsmhccute_mhcCuteBoundary_object_at__tensorptrbf16_0"
    assert short_name(cute) == "cute:CuteBoundary"


@pytest.fixture(scope="module")
def planned():
    model = ReferenceModel.random(geometry("tiny"), max_requests=4, max_context=64)
    config = DecodeConfig.build(max_context=64, q=1, capture_sizes=[1, 4], policy=ALL_STAGES)
    return model, SpecializedDecode(ReferenceBackbone(model), config)


@pytest.mark.parametrize("tokens, traffic", [(1, {}), (4, {}), (4, {"requests": 2, "touched": {}})])
def test_owners_bytes_are_the_floor_split(planned, tokens, traffic):
    model, decode = planned
    if "touched" in traffic:  # some experts of each MoE layer, as a step's routing selects
        moe = (i for i, t in enumerate(model.g.mlp_layer_types) if t != "dense")
        traffic["touched"] = {i: 1 + i % 3 for i in moe}
    floor = floor_bytes(model, tokens, 48, **traffic)
    stock = owner_bytes(model, tokens, 48, **traffic)
    assert set(stock) <= {OUTSIDE, *(f"stock {m}" for m in ("kda", "mla", "dense_mlp", "moe",
                                                            "head"))}  # fmt: skip
    ours = owner_bytes(model, tokens, 48, decode, **traffic)
    assert sum(stock.values()) == pytest.approx(floor, rel=1e-12)
    assert sum(ours.values()) == pytest.approx(floor, rel=1e-12)
    # Each stage the decode built at this count owns bytes, and only the decode's stages do.
    served = {decode.stage_of[id(op)] for _, _, op in decode.routes[tokens]} | {"boundary"}
    assert served - {"dsa_indexer"} <= set(ours)  # the indexer reads pools only: > 0 bytes
    assert all(ours[s] > 0 for s in served & set(ours))
    assert not {o for o in ours if not o.startswith("stock ")} - served - {"logits_head"}


def test_the_planned_step_runs_in_its_owners_ranges_and_is_left_as_it_was(planned):
    model, decode = planned
    model.add()
    _fill_caches(model)
    requests, step = _step(model, 1, 1, 40)
    ids = _token_ids(model, len(requests), 1)
    before = (decode.routes, decode.mhc, decode.head, dict(model.ranks[0].__dict__))
    with torch.no_grad(), owners(model, decode), profile(activities=[ProfilerActivity.CPU]) as p:
        decision = decode.plan(step, capturing=True)
        decode.compute_logits(decode.run(decision.step, ids, step))
    names = {e.name for e in p.events()}
    stages = {f"stage {decode.stage_of[id(op)]}" for _, _, op in decode.routes[1]}
    assert stages | {"stage boundary", "stage logits_head"} <= names
    # The KDA and MLA sublayers: all stage (the query absorption is the MLA stage's).
    assert {"stage kda", "stage dsa_attn"} <= stages
    assert not {"stock kda", "stock mla"} & names

    def owner(event):  # the innermost stage or stock range around an op
        while event is not None and not event.name.startswith(("stage ", "stock ")):
            event = event.cpu_parent
        return None if event is None else event.name

    absorbs = [owner(e) for e in p.events() if e.name == "aten::bmm"]
    assert absorbs and set(absorbs) == {"stage dsa_attn"}  # the query absorption's GEMM
    assert (decode.routes, decode.mhc, decode.head) == before[:3]
    assert model.ranks[0].__dict__.keys() == before[3].keys()


def test_table_prints_the_kernel_tables(tmp_path):
    with open("benchmarks/results/decode_h200_tp4.json") as f:
        result = json.load(f)
    row = result["rows"][0]
    row["kernel_tables"] = {
        "specialized": {
            "owners": [{"owner": "boundary", "launches": 91, "us": 560.0, "bytes": 1.5e8,
                        "floor_us": 35.0, "to_floor": 16.0}],
            "kernels": [{"owner": "boundary", "kernel": "hc_boundary_kernel", "launches": 91,
                         "us": 560.0}],
        }
    }  # fmt: skip
    path = tmp_path / "r.json"
    path.write_text(json.dumps(result))
    text = table([str(path)])
    assert "1 token (q = 1), specialized**: 91 launches (kernels and copies), 0.56 ms" in text
    assert "| boundary | 91 | 560.0 | 150.00 | 35.0 | 16.0 |" in text
    assert "| boundary | `hc_boundary_kernel` | 91 | 560.0 | 6.15 |" in text


def test_table_leaves_out_a_split_no_stage_method_ran_in(tmp_path):
    """A planned step of sublayer stage objects calls none of the reference's stage methods
    the split's marks wrap: all of it would read as the boundaries'. Its row is left out."""
    with open("benchmarks/results/decode_h100_tp8_all.json") as f:
        result = json.load(f)
    row = result["rows"][0]
    assert not set(row["stages_ms"]["specialized"]) & set(STAGES)
    path = tmp_path / "r.json"
    path.write_text(json.dumps(result))
    cells = [line.split(" | ") for line in table([str(path)]).splitlines()]
    sides = [c[3] for c in cells if len(c) > 3 and c[3] in ("vllm", "specialized")]
    assert sides == ["vllm"]


def test_owner_rows_sum_each_owners_kernels_and_keep_byte_only_owners():
    table = [{"owner": "moe", "kernel": "a", "launches": 2, "us": 30.0},
             {"owner": "moe", "kernel": "b", "launches": 1, "us": 10.0},
             {"owner": OUTSIDE, "kernel": "copy", "launches": 4, "us": 8.0}]  # fmt: skip
    rows = owner_rows(table, {"moe": 4e6, "stock head": 2e6}, bandwidth=4e12)
    assert [(r["owner"], r["launches"], r["us"]) for r in rows] == [
        ("moe", 3, 40.0), (OUTSIDE, 4, 8.0), ("stock head", 0, 0.0)
    ]  # fmt: skip
    assert rows[0]["floor_us"] == 1.0 and rows[0]["to_floor"] == 40.0
    assert rows[1]["to_floor"] is None  # no bytes: no floor to be a multiple of
