"""The encoder rows a text stage holds on a GPU (engine/stages/media_hold.py): rows that leave the device are
copied to pinned host memory behind the work that reads them, and come back equal after the allocator has
reused their blocks; a small pool that preempts media requests whose rows left runs them all to their end with
every page back and no rows held."""

import numpy as np
import pytest
import torch
from PIL import Image

from omnistage import LLM, SamplingParams
from omnistage.engine.sequence import Sequence
from omnistage.engine.stages.encoders import MultimodalEmbeds
from omnistage.engine.stages.media_hold import MediaHold

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


class State:
    def __init__(self, mm):
        self.mm = mm


def test_rows_come_back_equal_after_their_blocks_were_reused():
    device = torch.device("cuda")
    at = np.arange(3, 4099)
    rows = torch.randn(len(at), 2048, device=device, dtype=torch.bfloat16)
    deepstack = torch.randn(3, len(at), 2048, device=device, dtype=torch.bfloat16)
    want = (rows.clone(), deepstack.clone())
    position = torch.from_numpy(at).to(device)
    empty = np.zeros(0, dtype=np.int64)
    mm = MultimodalEmbeds(torch.from_numpy(empty).to(device), None, position, rows, deepstack, empty, at)
    seq = Sequence("v", list(range(4200)), 4, data=State(mm))
    hold: MediaHold[str] = MediaHold(limit=1 << 30)
    hold.hold(seq, mm)
    del rows, deepstack, mm
    torch.cuda._sleep(50_000_000)  # the copies queue behind work still running
    seq.num_computed_tokens = 4100
    hold.release()
    for _ in range(4):  # take the released blocks back and write over them
        torch.full((len(at) * 4, 2048), 7.0, device=device, dtype=torch.bfloat16)
    seq.num_computed_tokens = 0
    assert hold.needs_restore([seq])
    hold.restore([seq], device)
    torch.cuda.synchronize()
    assert torch.equal(seq.data.mm.image_embeds, want[0]) and torch.equal(seq.data.mm.deepstack, want[1])
    assert hold.held_bytes == want[0].nbytes + want[1].nbytes


def test_preempted_media_requests_run_to_their_end(tiny_checkpoint):
    rng = np.random.default_rng(3)
    chats = []
    for i in range(5):
        clip = (0.3 * rng.standard_normal(8000 + 4000 * i)).astype(np.float32)
        image = Image.fromarray(rng.integers(0, 256, (56, 84, 3), dtype=np.uint8))
        content = [
            {"type": "image", "image": image},
            {"type": "audio", "audio": clip},
            {"type": "text", "text": "?"},
        ]
        chats.append([{"role": "user", "content": content}])
    # compiled layers are not what this tests, and their builds took the file past 120 s on a fresh machine
    llm = LLM(
        model=str(tiny_checkpoint), device="cuda", dtype="float32", page_size=4, num_kv_pages=24,
        max_num_batched_tokens=16, prefix_caching=False, compile=False,
    )  # fmt: skip
    engine = llm.engine
    restores = []
    restore = engine.media.restore

    def watched(waiting, device):
        restores.append(sum(s.data.mm is not None and s.data.mm.offloaded is not None for s in waiting))
        restore(waiting, device)

    engine.media.restore = watched
    outputs = llm.chat(chats, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outputs] == [16] * 5
    assert sum(restores) >= 1
    assert engine.media.held_bytes == 0 and not engine.media.holding
    assert engine.pool.num_free == engine.pool.num_pages
