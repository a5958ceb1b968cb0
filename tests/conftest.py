"""Marker gates shared by every test folder: gpu / multi_gpu tests skip cleanly without them;
the quick GPU selection (`nox -s gpu_tests -- quick`) marked by node."""

from pathlib import Path

import interpreter_calls
import pytest

# The quick GPU selection, for every change that touches a kernel (the full suite is for a
# stage's own issue): every kernel once at the real GLM-5.3-Flash shapes with NaN-poisoned
# outputs, one CUDA-graph capture each, and the whole step at one q with every stage on (q = 4:
# three MTP drafts, at 4, 12 and 64 tokens, the draft beside). Entries: (file under tests/, test,
# its parameter id: "-"-separated parts in any order, "" unparametrized).
# tests/integration/test_quick_selection.py checks each names exactly one collected test.
QUICK = (
    ("glm5_kernels/test_gemm_gpu.py", "test_flash_shape", "tp4-kda.in_proj"),  # BF16, N 6416
    ("glm5_kernels/test_gemm_gpu.py", "test_flash_shape", "tp4-dense.gate_up"),  # FP8
    ("glm5_kernels/test_gemm_gpu.py", "test_flash_shape", "tp4-moe.router"),
    ("glm5_kernels/test_gemm_gpu.py", "test_flash_shape", "tp4-shared.mlp"),
    ("glm5_kernels/test_gemm_gpu.py", "test_graph_capture_after_prepare", ""),
    ("glm5_kernels/test_gemm_gpu.py", "test_a_pdl_chain_reads_what_its_predecessor_wrote", "1"),
    ("glm5_kernels/test_gemm_gpu.py", "test_kda_gate_projections_in_one_launch", "4"),
    ("glm5_kernels/test_gemm_gpu.py", "test_q_b_and_wq_b_in_one_launch", "4"),
    ("glm5_kernels/test_dsa_attn_gpu.py", "test_absorb_at_the_real_shapes", "16"),
    ("glm5_kernels/test_moe_gpu.py", "test_real_shapes", "tp4"),
    ("glm5_kernels/test_moe_gpu.py", "test_graph_capture_and_unprepared_tokens", "tp4"),
    ("glm5_kernels/test_moe_gpu.py", "test_router_inside_the_routing_launch", "tp4"),
    ("glm5_kernels/test_kda_gpu.py", "test_consecutive_steps_equal_the_reference", "16-8-2-0-None"),
    (
        "glm5_kernels/test_kda_gpu.py",
        "test_consecutive_steps_equal_the_reference",
        "16-8-2-128-None",
    ),
    (
        "glm5_kernels/test_kda_gpu.py",
        "test_consecutive_steps_equal_the_reference",
        "16-32-4-0-32x4x2",
    ),
    ("glm5_kernels/test_kda_gpu.py", "test_a_captured_step_replays_like_eager", ""),
    ("glm5_kernels/test_mhc_gpu.py", "test_boundaries_match_reference", "triton-13"),
    ("glm5_kernels/test_mhc_gpu.py", "test_boundaries_match_reference", "cute-13"),
    ("glm5_kernels/test_mhc_gpu.py", "test_barrier_reused_and_captured", "triton-47"),
    ("glm5_kernels/test_mhc_gpu.py", "test_barrier_reused_and_captured", "cute-1"),
    ("glm5_kernels/test_dsa_attn_gpu.py", "test_matches_the_reference", "16-8-3-4096"),
    ("glm5_kernels/test_dsa_attn_gpu.py", "test_a_captured_call_replays_like_eager", ""),
    ("glm5_kernels/test_dsa_indexer_gpu.py", "test_matches_the_reference", "8-3-4096"),
    ("glm5_kernels/test_dsa_kpool_gpu.py", "test_matches_the_reference", "16-4-keys"),
    ("glm5_kernels/test_dsa_kpool_gpu.py", "test_matches_the_reference", "16-4-sums"),
    ("glm5_kernels/test_dsa_latent_gpu.py", "test_matches_the_reference", "8"),
    ("glm5_kernels/test_dsa_latent_gpu.py", "test_a_captured_call_replays_like_eager", ""),
    ("glm5_kernels/test_embed_gpu.py", "test_a_captured_call_replays_like_eager", ""),
    ("glm5_runtime/test_decode_gpu.py", "test_three_capture_sizes_with_draft_equal_stock", ""),
    # Hosts of 2+ GPUs only (multi_gpu): the NVLink exchanges.
    ("glm5_comm/test_allreduce_gpu.py", "test_gpus_hold_the_rank_order_sum", ""),
)
TESTS = Path(__file__).parent


def quick_key(file: str, test: str, params: str) -> tuple[str, str, tuple[str, ...]]:
    return file, test, tuple(sorted(params.split("-"))) if params else ()


_QUICK = {quick_key(*entry) for entry in QUICK}


def pytest_configure(config):
    """The `quick` marker (applied by node, below); one intra-op thread for CPU-only runs.
    The suite's tensors are small enough that a second thread saves nothing (93 s either way
    on an idle 2-core machine), and where another process holds the other core each parallel
    op waits for a descheduled worker (measured: up to 40 ms per index_add_ instead of 5 us;
    one consistency test 30 s instead of 1.5)."""
    config.addinivalue_line("markers", "quick: the quick GPU selection (tests/conftest.py QUICK)")
    interpreter_calls.install()
    try:
        import torch
    except ImportError:
        return
    if not torch.cuda.is_available():
        torch.set_num_threads(1)


def _compile_check(item) -> bool:
    return getattr(item, "originalname", None) == "test_kernels_compile"


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        gpus = 0
    for item in items:
        callspec = getattr(item, "callspec", None)
        file = item.path.relative_to(TESTS).as_posix() if item.path.is_relative_to(TESTS) else ""
        test = getattr(item, "originalname", item.name)
        if quick_key(file, test, callspec.id if callspec else "") in _QUICK:
            item.add_marker(pytest.mark.quick)
        if "gpu" in item.keywords and gpus < 1:
            item.add_marker(pytest.mark.skip(reason="needs an NVIDIA GPU"))
        if "multi_gpu" in item.keywords and gpus < 2:
            item.add_marker(pytest.mark.skip(reason="needs 2+ NVIDIA GPUs of one host"))
    # The Triton compile checks last: their children compile in the background from the end
    # of collection (test_gemm_compile.py), so that by then they are done.
    items.sort(key=_compile_check)


def pytest_collection_finish(session):
    for item in session.items:
        if _compile_check(item):
            item.module.start(**item.callspec.params)
