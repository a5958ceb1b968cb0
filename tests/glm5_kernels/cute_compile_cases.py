"""Child of test_cute_compile.py: compiles every CuTe DSL kernel configuration the ops use for
one architecture (CUTE_DSL_ARCH, set by the parent) with PTX kept in the working directory,
and prints what it compiled."""

import sys
from pathlib import Path

from glm5_kernels.mhc import cute_mhc
from glm5_kernels.mhc.boundary import EXPAND, GIVEN, POST, tokens_a_cluster

CONFIG = dict(hidden=4096, rms_eps=1e-6, hc_eps=1e-6, norm_eps=1e-5, post_mult=2.0,
              sinkhorn_iters=20, pdl=True)  # fmt: skip


def mhc_cases() -> int:
    """Every mode at one token a cluster, the post at every tokens-a-cluster a plan uses,
    BF16 mix weights once; with comb deferred (`pend_in`: the previous boundary's comb
    balanced here, `pend_out`: this one's left as logits), every mode that takes or leaves a
    comb and the post at every tokens-a-cluster."""
    f32 = ("float32", "float32", "float32", "bfloat16")
    bf16 = ("bfloat16", "bfloat16", "bfloat16", "float32")
    given, expand, post = GIVEN, EXPAND, POST
    # What a GPU that runs 11..16 clusters at once plans (an H100: 14) at 1..64 tokens.
    tbs = sorted({tokens_a_cluster(m, c) for m in range(1, 65) for c in range(11, 17)})
    cases = [(given, False, False, 1, f32), (expand, False, True, 1, f32),
             (post, True, False, 1, f32), (post, False, True, 1, bf16)]  # fmt: skip
    cases += [(post, False, True, tb, f32) for tb in tbs]
    cases = [(*case, False, False) for case in cases]
    cases += [(given, False, False, 1, f32, False, True),
              (expand, False, True, 1, f32, False, True),
              (post, True, False, 1, f32, True, False)]  # fmt: skip
    cases += [(post, False, True, tb, f32, True, True) for tb in tbs]
    cases = [(*case, 2) for case in cases]
    # Built for one CTA an SM (what the benchmark's sweep times beside): the post at 4 and
    # 8 tokens a cluster (32 and 64 tokens where 8 such clusters fit).
    cases += [(post, False, True, tb, f32, False, False, 1) for tb in (4, 8)]
    compiled = []
    for n, (mode, head, store, tb, weights, pend_in, pend_out, per_sm) in enumerate(cases):
        kernel = cute_mhc.compile_boundary(cute_mhc.slot_dtypes(weights), mode=mode, head=head,
                                           store=store, tb=tb, pend_in=pend_in,
                                           pend_out=pend_out, per_sm=per_sm, **CONFIG)  # fmt: skip
        compiled.append(kernel)
        for kept in Path().glob("*CuteBoundary*.ptx"):  # the DSL names it by the function
            pend = "-in" * pend_in + "-out" * pend_out + "-wide" * (per_sm == 1)
            kept.rename(f"mhc-{n}-{'head' if head else 'mix'}{pend}.ptx")
    # The benchmark's timestamped build (benchmarks/boundary.py --phases), one token a cluster.
    stamped = cute_mhc.compile_boundary(cute_mhc.slot_dtypes(f32), mode=post, head=False,
                                        store=True, tb=1, **CONFIG, phases=True)  # fmt: skip
    assert all(stamped is not c for c in compiled)
    (kept,) = Path().glob("*CuteBoundary*.ptx")
    ptx = kept.read_text()
    assert "%globaltimer" in ptx and "%clock64" in ptx, "no timestamps in the phases build"
    kept.rename("stamped.ptx")  # not one of the mhc-*.ptx the parent checks for the design
    # Once a process: asked again (another decode's boundary), the same kernel, no compile.
    mode, head, store, tb, weights, _, _, _ = cases[0]
    again = cute_mhc.compile_boundary(cute_mhc.slot_dtypes(weights), mode=mode, head=head,
                                      store=store, tb=tb, **CONFIG)  # fmt: skip
    assert again is compiled[0] and len({id(c) for c in compiled}) == len(cases)
    assert not list(Path().glob("*CuteBoundary*.ptx"))  # nothing compiled again
    return len(cases)


if __name__ == "__main__":
    print(f"{sys.argv[1]}: compiled {mhc_cases()} CuTe mHC kernels")
