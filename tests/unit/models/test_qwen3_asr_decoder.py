"""The Qwen3-ASR decoder's layers compiled as the GPU engine compiles them, here with Inductor on the CPU."""

import torch
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

from omnistage.engine.attention import AttentionMetadata, TorchReferenceBackend
from omnistage.models.loader import LoadOptions
from omnistage.models.qwen3_asr.decoder import load_decoder
from omnistage.models.qwen3_asr.tiny import make_tiny

PAGE = 16


class OpaqueBackend(TorchReferenceBackend):
    """The reference backend behind the graph break the Triton one makes (`CudaAttentionBackend.forward`)."""

    @torch.compiler.disable
    def forward(self, q, k, v, kv_cache, meta, scale):
        return super().forward(q, k, v, kv_cache, meta, scale)


def test_compiled_layers_add_no_residual_into_a_projection(tmp_path):
    """A residual added to a projection's output in the same compiled graph becomes `addmm(residual, ...)`, which on
    a GPU first copies the residual into the output (a device-to-device memcpy a layer a step), then accumulates
    onto it. The layers leave the MLP's residual add to the next layer's input norm, so no graph holds an addmm;
    and the compiled decoder agrees with the eager one, prefill and decode."""
    decoder = load_decoder(make_tiny(tmp_path), LoadOptions(torch.float32, "cpu"), OpaqueBackend())
    cfg = decoder.config
    ids = torch.randint(0, cfg.vocab_size, (11,), generator=torch.Generator().manual_seed(0))

    def steps() -> list[torch.Tensor]:
        kv = [torch.zeros(2, 4, PAGE, cfg.num_key_value_heads, cfg.head_dim) for _ in decoder.model.layers]
        prefill = AttentionMetadata.build([(0, 7, [0]), (0, 4, [1])], PAGE)
        positions = torch.cat([torch.arange(7), torch.arange(4)]).expand(3, -1)
        decode = AttentionMetadata.build([(7, 1, [0]), (4, 1, [1])], PAGE)
        return [
            decoder(ids, positions, kv, prefill),
            decoder(ids[:2], torch.tensor([[7, 4]] * 3), kv, decode),
        ]

    torch._dynamo.reset()
    try:
        with torch.inference_mode():
            eager = steps()
            for layer in decoder.model.layers:
                layer.compile(dynamic=True)
            compiled, codes = run_and_get_code(steps)
    finally:
        torch._dynamo.reset()
    assert codes and not any("addmm" in code for code in codes)
    for ours, want in zip(compiled, eager, strict=True):
        torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-5)


def test_every_layer_calls_the_same_compiled_variants(tmp_path):
    """The engine compiles every layer with `dynamic=True`: the layers share one code object, whose variants dynamo
    caps (8 by default); past the cap, calls silently run eagerly. The first layer must be called with arguments of
    the same types as the others (a None residual there made variants of its own, and the H200 run hit the cap):
    over a server's step shapes, the whole stack compiles no more variants than one layer does."""
    decoder = load_decoder(make_tiny(tmp_path), LoadOptions(torch.float32, "cpu"), OpaqueBackend())
    cfg, layers = decoder.config, decoder.model.layers
    assert len(layers) > 1
    ids = torch.randint(0, cfg.vocab_size, (64,), generator=torch.Generator().manual_seed(0))
    shapes = [[(0, n, [0, 1, 2, 3])] for n in (64, 17, 2, 1)] + [
        [(5, 1, [b]) for b in range(n)] for n in (8, 4, 1)
    ]

    def variants() -> int:
        torch._dynamo.reset()
        counters.clear()
        for layer in decoder.model.layers:
            layer.compile(dynamic=True, backend="eager")  # the guards are dynamo's, whatever the backend
        with torch.inference_mode():
            for chunks in shapes:
                kv = [
                    torch.zeros(2, 8, PAGE, cfg.num_key_value_heads, cfg.head_dim)
                    for _ in decoder.model.layers
                ]
                tokens = sum(count for _, count, _ in chunks)
                positions = torch.cat([torch.arange(start, start + n) for start, n, _ in chunks]).expand(
                    3, -1
                )
                decoder(ids[:tokens], positions, kv, AttentionMetadata.build(chunks, PAGE))
        return counters["stats"]["unique_graphs"]

    try:
        stack = variants()
        decoder.model.layers = layers[:1]
        assert stack == variants()
    finally:
        decoder.model.layers = layers
        torch._dynamo.reset()
