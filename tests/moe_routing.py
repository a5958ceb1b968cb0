"""The MoE routing check shared by the kernel tests and the whole-step tests: the experts a
router's logits pick (sigmoid scores + correction bias, top-k, ties to the lower id) and
their renormalized, scaled weights, tolerant only where two choices are within a few ulps;
and `recording`, which keeps the logits and routes of an experts op's calls."""

import torch

from glm5_kernels.moe import route_ref


def assert_routing(logits, bias, k, scaling, ids, weights):
    """ids as route_ref picks them (descending score + bias, ties to the lower id), except
    that where two experts' values are within a few FP32 ulps a sigmoid implementation may
    order them either way: each slot's value must then equal the reference's within 2^-21.
    Weights: from the kernel's own ids, as route_ref forms them, within 2^-20."""
    ref_ids = route_ref(logits, bias, k, scaling)[1]
    choice = torch.sigmoid(logits.double()) + bias.double()
    ids = ids.long()
    assert ((ids >= 0) & (ids < logits.shape[1])).all()
    assert (ids.sort(-1).values.diff(dim=-1) > 0).all(), "an expert picked twice"
    gap = (choice.gather(1, ids) - choice.gather(1, ref_ids)).abs()
    assert (gap <= 2.0**-21).all(), f"ids {ids.tolist()} != {ref_ids.tolist()}"
    tied = (logits == logits[:, :1]).all(-1)  # equal inputs: equal scores on every backend
    assert torch.equal(ids[tied], ref_ids[tied]), "exact ties not broken to the lower id"
    s = torch.sigmoid(logits.float()).gather(1, ids)
    want = s / (s.sum(-1, keepdim=True) + 1e-20) * scaling
    torch.testing.assert_close(weights, want, rtol=2.0**-20, atol=0)


def recording(run, seen: list):
    """An experts op's `_run` that also keeps each call's (router logits, MoeRows): the
    logits it routed from, given or (the router inside the routing launch) computed."""

    def recorded(x, m, logits, ids, weights, **kw):
        rows, out = run(x, m, logits, ids, weights, **kw)
        seen.append((logits, rows))
        return rows, out

    return recorded
