"""Prompt chunks over long contexts through a varlen kernel (`engine/attention/long_prefill.py`) on the GPU:
torch's FlashAttention (this torch has it with GQA and the causal alignment the engine needs) and omnistage's
Triton kernel (`kernels/long_attention.py`) both pass the start-up check, and a long step through either equals
the paged kernel's (the Thinker's and the Talker's head layouts, bfloat16)."""

import dataclasses

import pytest
import torch

from omnistage.engine.attention import AttentionMetadata, backend_for, long_prefill
from omnistage.kernels.attention import paged_attention, write_kv

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PAGE = 16


@pytest.mark.parametrize("kernel", ["flash", "triton"])
@pytest.mark.parametrize(("heads", "kv_heads"), [(32, 4), (16, 2)])
def test_a_long_chunk_beside_decode_rows_equals_the_paged_kernel(heads, kv_heads, kernel):
    device = torch.device("cuda")
    backend = backend_for(device, long_kernel=kernel)
    assert backend.flash is not None  # type: ignore[attr-defined]  # the GPU machine has the kernel
    generator = torch.Generator(device).manual_seed(0)
    chunks = [(10_000, 2048), (5_000, 1), (300, 1)]
    order = torch.randperm(1200, device=device, generator=generator).tolist()  # pages scattered
    tables, at = [], 0
    for cached, new in chunks:
        count = -(-(cached + new) // PAGE)
        tables.append(order[at : at + count])
        at += count
    meta = AttentionMetadata.build([(c, n, t) for (c, n), t in zip(chunks, tables)], PAGE, device)
    assert long_prefill.applies(meta, torch.bfloat16)
    cache = torch.randn(
        2, 1200, PAGE, kv_heads, 128, device=device, dtype=torch.bfloat16, generator=generator
    )
    rows = sum(n for _, n in chunks)
    q, k, v = (
        torch.randn(rows, h, 128, device=device, dtype=torch.bfloat16, generator=generator)
        for h in (heads, kv_heads, kv_heads)
    )
    write_kv(cache, k, v, meta.slot_mapping)
    scale = 128**-0.5
    paged = paged_attention(q, cache, meta, scale)
    flash = backend.attend(q, cache, meta, scale)
    assert flash.shape == paged.shape and flash.dtype == paged.dtype
    # relative to the output's size (~0.01 a value over 10k random keys): bfloat16 rounding, not a stray mask
    error = (flash.float() - paged.float()).norm() / paged.float().norm()
    assert error < 1e-2, error


@pytest.mark.parametrize("pack", [False, True])
def test_the_triton_kernel_equals_flash_attention_on_ragged_sequences(pack):
    # a fresh 8,192-row prompt, a chunk after 10k cached keys and a short one, in one call as a step makes them;
    # the tiles one head's and a K/V head's packed group's
    from omnistage.kernels.long_attention import LONG_TILES, long_attention

    device = torch.device("cuda")
    flash = long_prefill.flash_varlen(device)
    assert flash is not None
    generator = torch.Generator(device).manual_seed(1)
    chunks = [(0, 8192), (10_000, 2048), (300, 77)]
    cu_q = torch.tensor([0, 8192, 10_240, 10_317], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 8192, 20_240, 20_617], dtype=torch.int32, device=device)
    q = torch.randn(10_317, 32, 128, device=device, dtype=torch.bfloat16, generator=generator)
    k, v = torch.randn(2, 20_617, 4, 128, device=device, dtype=torch.bfloat16, generator=generator)
    args = (q, k, v, cu_q, cu_k, max(n for _, n in chunks), max(c + n for c, n in chunks), 128**-0.5)
    tiles = dataclasses.replace(LONG_TILES, pack=pack)
    want, got = flash(*args).float(), long_attention(*args, tiles).float()
    for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):  # each sequence on its own: none masked wrongly
        error = (got[a:b] - want[a:b]).norm() / want[a:b].norm()
        assert error < 1e-2, (a, b, error)
