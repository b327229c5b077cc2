"""The routing kernel's oracle (kernels/moe_router.py), shared by its interpreter and GPU tests."""

import torch
import torch.nn.functional as F

# float32 weights within a few ulps; bf16 ones within one bf16 ulp, the most by which the roundings of two
# float32 weights a few ulps apart differ (and the interpreter truncates to bf16, where the GPU rounds)
RTOL = {torch.float32: 1e-6, torch.bfloat16: 2**-7}


def lower_ids_first(logits, top_k, renormalize, dtype):
    """`route_torch` with equal weights taken in the order of their ids, as the kernel takes them; torch.topk
    takes any of them."""
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    ids = probs.sort(dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = probs.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), ids


def assert_routes_alike(got, want):
    """The same experts in each row, in any order, each of the same weight."""
    (weights, ids), (want_weights, want_ids) = got, want
    assert weights.dtype == want_weights.dtype and ids.dtype == torch.int64
    ids, order = ids.sort(dim=-1)
    want_ids, want_order = want_ids.sort(dim=-1)
    assert torch.equal(ids, want_ids)
    weights, want_weights = weights.gather(1, order), want_weights.gather(1, want_order)
    torch.testing.assert_close(weights, want_weights, rtol=RTOL[weights.dtype], atol=0)
