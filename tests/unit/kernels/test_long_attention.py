"""The Triton kernel of `kernels/long_attention.py` (prompt rows over contiguous keys, the long-prefill path's
varlen call) against plain attention, run on the CPU by Triton's interpreter (see tests/triton_interpreter.py);
run directly: `TRITON_INTERPRET=1 pytest tests/unit/kernels/test_long_attention.py`."""

import pytest
import torch
from triton_interpreter import INTERPRETING, patch_interpreter, run_in_interpreter

pytest.importorskip("triton")

if not INTERPRETING:

    def test_kernel_in_the_interpreter():
        run_in_interpreter(__file__)

else:
    patch_interpreter()

    import torch.nn.functional as F

    from omnistage.engine.attention import long_prefill
    from omnistage.kernels.long_attention import LongTiles, long_attention

    SMALL = LongTiles(rows=16, keys=16, warps=4, stages=1, tma=False)

    def _reference(q, k, v, cu_q, cu_k, scale):
        """Each sequence's rows over its keys in float64, the causal mask aligned at the last key."""
        out = torch.zeros(q.shape, dtype=torch.float64)
        for b in range(len(cu_q) - 1):
            q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
            mask = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool).tril(k1 - k0 - (q1 - q0))
            out[q0:q1] = F.scaled_dot_product_attention(
                *(t.double().transpose(0, 1) for t in (q[q0:q1], k[k0:k1], v[k0:k1])),
                attn_mask=mask,
                scale=scale,
                enable_gqa=True,
            ).transpose(0, 1)
        return out

    def _case(chunks, heads, kv_heads, dim, dtype, seed):
        """(q, k, v, cu_q, cu_k) for sequences of (cached, rows): each its rows after its cached keys."""
        g = torch.Generator().manual_seed(seed)
        rows = sum(n for _, n in chunks)
        keys = sum(c + n for c, n in chunks)
        q = torch.randn(rows, heads, dim, generator=g).to(dtype)
        k, v = (torch.randn(keys, kv_heads, dim, generator=g).to(dtype) for _ in range(2))
        cu_q = torch.tensor([0, *torch.tensor([n for _, n in chunks]).cumsum(0).tolist()], dtype=torch.int32)
        cu_k = torch.tensor(
            [0, *torch.tensor([c + n for c, n in chunks]).cumsum(0).tolist()], dtype=torch.int32
        )
        return q, k, v, cu_q, cu_k

    @pytest.mark.parametrize(
        ("chunks", "tiles"),
        [
            ([(0, 40)], SMALL),  # a fresh prompt: tiles along the diagonal, the last one partial
            ([(37, 32)], SMALL),  # rows after cached keys that are no multiple of a key block; whole tiles
            ([(0, 16), (50, 9), (5, 33), (0, 1)], SMALL),  # ragged sequences, one a single row
            (
                [(70, 48)],
                LongTiles(rows=32, keys=16, warps=4, stages=1, tma=False),
            ),  # keys seen by every row, unmasked
            (
                [(20, 40), (3, 17)],
                LongTiles(rows=16, keys=32, warps=4, stages=1, tma=False),
            ),  # key blocks over 16 rows
            ([(0, 16), (50, 9), (5, 33), (0, 1)], LongTiles(16, 16, 4, 1, tma=True)),  # blocks by descriptors
            ([(70, 48)], LongTiles(rows=32, keys=16, warps=4, stages=1, tma=True)),
            # a K/V head's group packed in a tile's rows: 8 tokens of 2 heads, the decode rows beside a chunk
            ([(0, 40), (33, 1), (20, 1), (50, 9)], LongTiles(16, 16, 4, 1, tma=False, pack=True)),
            ([(0, 40), (33, 1), (20, 1), (50, 9)], LongTiles(16, 16, 4, 1, tma=True, pack=True)),
            ([(70, 48)], LongTiles(rows=32, keys=16, warps=4, stages=1, tma=True, pack=True)),
        ],
    )
    def test_equals_plain_attention(chunks, tiles):
        q, k, v, cu_q, cu_k = _case(
            chunks, heads=4, kv_heads=2, dim=16, dtype=torch.float32, seed=len(chunks)
        )
        scale = 16**-0.5
        out = long_attention(q, k, v, cu_q, cu_k, 0, 0, scale, tiles=tiles)
        torch.testing.assert_close(out.double(), _reference(q, k, v, cu_q, cu_k, scale), atol=1e-5, rtol=1e-5)

    @pytest.mark.parametrize("tma", [False, True])
    def test_a_packed_group_padded_to_a_power_of_two(tma):
        # 6 query heads over 2 K/V heads: groups of 3, padded to 4 rows a token, the padding row never stored
        q, k, v, cu_q, cu_k = _case(
            [(25, 30), (9, 1), (0, 7)], heads=6, kv_heads=2, dim=16, dtype=torch.float32, seed=11
        )
        tiles = LongTiles(16, 16, 4, 1, tma=tma, pack=True)
        out = long_attention(q, k, v, cu_q, cu_k, 0, 0, 0.25, tiles=tiles)
        torch.testing.assert_close(out.double(), _reference(q, k, v, cu_q, cu_k, 0.25), atol=1e-5, rtol=1e-5)
        with pytest.raises(ValueError, match="whole groups"):
            long_attention(
                q,
                k,
                v,
                cu_q,
                cu_k,
                0,
                0,
                0.25,
                tiles=LongTiles(rows=2, keys=16, warps=4, stages=1, pack=True),
            )

    def test_half_precision_and_a_wide_group():
        # 8 query heads over 1 K/V head, 32-wide heads, float16 as the engine's 16-bit steps
        q, k, v, cu_q, cu_k = _case(
            [(25, 30), (0, 20)], heads=8, kv_heads=1, dim=32, dtype=torch.float16, seed=5
        )
        out = long_attention(q, k, v, cu_q, cu_k, 0, 0, 0.3, tiles=SMALL)
        assert out.dtype == torch.float16
        torch.testing.assert_close(out.double(), _reference(q, k, v, cu_q, cu_k, 0.3), atol=2e-3, rtol=2e-3)

    @pytest.mark.parametrize("tma", [False, True])
    @pytest.mark.parametrize("offset", [0, 1])
    def test_strided_queries_and_keys(tma, offset):
        # q, k and v as views of one projection's output, as a layer's split leaves them; one element in, no
        # view is 16-byte aligned and descriptors cannot address them: the pointers' loads take them instead
        g = torch.Generator().manual_seed(3)
        fused = torch.randn(24 * 129, generator=g)[offset : offset + 24 * 128].view(24, 128)
        q = fused[:, :64].view(24, 4, 16)
        k = fused[:, 64:96].view(24, 2, 16)
        v = fused[:, 96:].view(24, 2, 16)
        cu = torch.tensor([0, 24], dtype=torch.int32)
        tiles = LongTiles(16, 16, 4, 1, tma=tma)
        out = long_attention(q, k, v, cu, cu, 0, 0, 0.25, tiles=tiles)
        torch.testing.assert_close(out.double(), _reference(q, k, v, cu, cu, 0.25), atol=1e-5, rtol=1e-5)

    @pytest.mark.parametrize("dim", [8, 24])
    def test_heads_padded_to_a_power_of_two(dim):
        q, k, v, cu_q, cu_k = _case([(9, 20)], heads=6, kv_heads=2, dim=dim, dtype=torch.float32, seed=dim)
        out = long_attention(q, k, v, cu_q, cu_k, 0, 0, 0.3, tiles=SMALL)
        assert out.shape == q.shape and out.is_contiguous()
        torch.testing.assert_close(out.double(), _reference(q, k, v, cu_q, cu_k, 0.3), atol=1e-5, rtol=1e-5)

    def test_heads_too_wide():
        q = torch.zeros(2, 2, 320)
        cu = torch.tensor([0, 2], dtype=torch.int32)
        with pytest.raises(ValueError, match="at most 256"):
            long_attention(q, q, q, cu, cu, 2, 2, 1.0)

    def test_the_engine_option_picks_it_where_it_agrees(monkeypatch):
        # `--long-prefill-kernel`'s choice, each kernel through the start-up check the engine runs before taking
        # it, here on the interpreter, whose bfloat16 arithmetic is wrong (the check kept in float16)
        from omnistage.engine import attention

        monkeypatch.setattr(long_prefill, "CHECK_DTYPE", torch.float16)
        pick, cpu = attention._varlen.__wrapped__, torch.device("cpu")
        assert pick(cpu, "flash") is None  # torch's FlashAttention: a CUDA device's alone
        varlen = pick(cpu, "triton")
        assert varlen is not None
        q, k, v, cu_q, cu_k = _case([(30, 20)], heads=4, kv_heads=2, dim=16, dtype=torch.float16, seed=7)
        torch.testing.assert_close(
            varlen(q, k, v, cu_q, cu_k, 20, 50, 0.25).double(),
            _reference(q, k, v, cu_q, cu_k, 0.25),
            atol=2e-3,
            rtol=2e-3,
        )
        with pytest.raises(ValueError, match="flash or triton"):
            pick(cpu, "cudnn")

    def test_a_kernel_that_differs_is_not_taken(monkeypatch):
        from omnistage.kernels import long_attention as module

        monkeypatch.setattr(long_prefill, "CHECK_DTYPE", torch.float16)
        monkeypatch.setattr(module, "LONG_TILES", SMALL)
        assert long_prefill.triton_varlen(torch.device("cpu")) is not None
        monkeypatch.setattr(module, "long_attention", lambda q, *args: torch.zeros_like(q))
        assert long_prefill.triton_varlen(torch.device("cpu")) is None

    def test_the_backend_warms_the_long_prefill_kernel_for_its_layout():
        # a call of the model's layout at start builds the Triton kernel's one variant for it, which no warm-up
        # step of a 2,048-token budget reaches (it takes 4,096 keys)
        from omnistage.engine.attention.cuda import CudaAttentionBackend

        calls = []

        def varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale):
            calls.append(
                (q.shape, k.shape, v.shape, q.dtype, cu_q.tolist(), cu_k.tolist(), max_q, max_k, scale)
            )
            return torch.zeros_like(q)

        backend = CudaAttentionBackend(flash=varlen)
        backend.warm_up(32, 4, 128, torch.float16, torch.device("cpu"))
        rows = long_prefill.MIN_ROWS
        assert calls == [
            (
                (rows, 32, 128),
                (2 * rows, 4, 128),
                (2 * rows, 4, 128),
                torch.float16,
                [0, rows],
                [0, 2 * rows],
                rows,
                2 * rows,
                128**-0.5,
            )
        ]
        backend.warm_up(32, 4, 128, torch.float32, torch.device("cpu"))  # a float32 model never gathers
        CudaAttentionBackend(flash=None).warm_up(32, 4, 128, torch.float16, torch.device("cpu"))
        assert len(calls) == 1
