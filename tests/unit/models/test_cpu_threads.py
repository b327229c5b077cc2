import threading

import torch

from omnistage.models import cpu_threads
from omnistage.models.cpu_threads import shared_decoder_threads, shared_threads


def test_a_lone_caller_keeps_every_core_and_gets_its_count_back():
    before = torch.get_num_threads()
    with shared_threads() as share:
        assert share == cpu_threads._cores and torch.get_num_threads() == share
    assert torch.get_num_threads() == before


def test_callers_at_once_split_the_cores_among_them(monkeypatch):
    monkeypatch.setattr(cpu_threads, "_cores", 16)
    inside, leave = threading.Barrier(4), threading.Event()
    seen: list[tuple[int, int]] = []

    def work() -> None:
        with shared_threads() as share:
            inside.wait()
            seen.append((share, torch.get_num_threads()))  # the team size is this thread's own
            leave.wait()

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    inside.wait()
    leave.set()
    for t in threads:
        t.join()
    # a share is taken on entry (a frame's resize is short, so each frame takes it anew): the first in took
    # all 16, the second 8, the third 5, and each thread's team was its own share
    assert sorted(s for s, _ in seen) == [5, 8, 16] and all(s == n for s, n in seen)
    assert cpu_threads._torch_callers._inside == 0


def test_videos_decoding_at_once_split_the_cores_apart_from_torchs_callers(monkeypatch):
    monkeypatch.setattr(cpu_threads, "_cores", 16)
    before = torch.get_num_threads()
    with shared_decoder_threads() as first, shared_threads() as torch_share:
        with shared_decoder_threads() as second, shared_decoder_threads() as third:
            assert (first, second, third) == (16, 8, 5)
        assert torch_share == 16  # a video's resizes are not counted with the decoders
        with shared_decoder_threads() as again:
            assert again == 8 and torch.get_num_threads() == 16
    assert (
        torch.get_num_threads() == before
        and cpu_threads._decoders._inside == 0 == cpu_threads._torch_callers._inside
    )
