"""`kernels/moe_router.py` on the CPU, against the torch path (`moe.route_torch`).

Under Triton's interpreter (tests/triton_interpreter.py) the kernel selects the torch path's experts with the
same weights, equal logits going to the lower expert id. There `wrap_triton` hands back the bare kernel, which
fake tensors cannot run, so the custom op compiles only with compiled Triton: the parent process (no GPU)
checks that a region compiled with dynamic shapes traces it into one kernel call, without launching it.
"""

import pytest
import torch
from routing_oracle import assert_routes_alike, lower_ids_first
from triton_interpreter import INTERPRETING, patch_interpreter, run_in_interpreter

from omnistage.models.layers.moe import route_torch

pytest.importorskip("triton")

if not INTERPRETING:

    def test_kernel_in_the_interpreter():
        run_in_interpreter(__file__)

    @torch.no_grad()
    def test_a_compiled_region_calls_the_kernel_once_for_any_token_count():
        from torch._dynamo.exc import BackendCompilerFailed
        from torch._functorch.aot_autograd import aot_module_simplified

        from omnistage.kernels.moe_router import route_topk

        graphs = []

        def record(gm, example_inputs):
            def stop(graph, inputs):
                graphs.append(graph)
                raise NotImplementedError("launching the kernel needs a GPU")

            return aot_module_simplified(gm, example_inputs, fw_compiler=stop)

        gate = torch.nn.Linear(32, 128, bias=False)
        route = torch.compile(
            lambda x: route_topk(gate(x), 8, True, x.dtype), fullgraph=True, dynamic=True, backend=record
        )
        with pytest.raises(BackendCompilerFailed):
            route(torch.randn(5, 32))
        (graph,) = graphs
        ops = [node.target for node in graph.graph.nodes if node.op == "call_function"]
        kernels = [op for op in ops if op is torch.ops.higher_order.triton_kernel_wrapper_functional]
        assert len(kernels) == 1 and "omnistage" not in str(ops)  # the op is gone, its kernel is in the graph
        (call,) = (n for n in graph.graph.nodes if n.target is kernels[0])
        # the grid's size is the token count, an input of the graph rather than a constant
        assert isinstance(call.kwargs["grid"][0][0], torch.fx.Node)

else:
    patch_interpreter()

    from omnistage.kernels.moe_router import route_topk

    def random_logits(num_tokens, num_experts, seed, dtype=torch.float32):
        """float32: normal, so no two equal; bf16: each row a shuffle of distinct values, so again no tie."""
        g = torch.Generator().manual_seed(seed)
        if dtype == torch.float32:
            return torch.randn(num_tokens, num_experts, generator=g) * 3
        order = torch.rand(num_tokens, num_experts, generator=g).argsort(dim=-1)
        return ((order - num_experts // 2) * 2**-4).bfloat16()

    @pytest.mark.parametrize(
        ("num_tokens", "num_experts", "top_k", "renormalize"),
        [
            (1, 128, 8, True),  # a decode step at the released sizes
            (37, 128, 8, True),
            (37, 128, 8, False),
            (5, 64, 4, True),
            (6, 60, 6, False),  # experts not a power of two
            (3, 512, 8, True),
            (4, 8, 1, True),  # one expert: tl.topk's smallest k is 2
            (3, 6, 6, True),  # every expert
        ],
    )
    def test_routes_as_the_torch_path(num_tokens, num_experts, top_k, renormalize):
        logits = random_logits(num_tokens, num_experts, seed=num_tokens + num_experts)
        got = route_topk(logits, top_k, renormalize, torch.float32)
        assert_routes_alike(got, route_torch(logits, top_k, renormalize, torch.float32))

    @pytest.mark.parametrize(("num_tokens", "renormalize"), [(1, True), (9, False)])
    def test_bf16_logits_give_bf16_weights(num_tokens, renormalize):
        logits = random_logits(num_tokens, 128, seed=num_tokens, dtype=torch.bfloat16)
        got = route_topk(logits, 8, renormalize, torch.bfloat16)
        assert_routes_alike(got, route_torch(logits, 8, renormalize, torch.bfloat16))

    def test_ties_go_to_the_lower_ids():
        g = torch.Generator().manual_seed(0)
        logits = torch.randint(-3, 4, (9, 64), generator=g).float()  # a few values: ties at every rank
        logits[0] = 1.0
        logits[1, ::2] = -0.0  # as 0.0: their weights are equal
        logits[1, 1::2] = 0.0
        got = route_topk(logits, 4, True, torch.float32)
        assert_routes_alike(got, lower_ids_first(logits, 4, True, torch.float32))
        assert got[1][0].sort().values.tolist() == [0, 1, 2, 3] == got[1][1].sort().values.tolist()

    def test_rows_of_a_wider_tensor():
        wide = random_logits(6, 80, seed=1)
        got = route_topk(wide[:, :64], 4, True, torch.float32)
        assert_routes_alike(got, route_torch(wide[:, :64], 4, True, torch.float32))

    def test_refuses_more_experts_than_there_are_and_strided_columns():
        logits = random_logits(2, 8, seed=0)
        with pytest.raises(ValueError, match="top 9 of 8"):
            route_topk(logits, 9, True, torch.float32)
        with pytest.raises(ValueError, match="unit column stride"):
            route_topk(logits.t(), 2, True, torch.float32)
