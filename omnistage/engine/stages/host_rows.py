"""A prompt's encoder rows copied to the host for its prefix-cache keys (prefix.py), without waiting.

The keys hash the bytes of the audio and vision rows, so those bytes must be on the host before the request is
queued. Reading the rows back with a blocking copy would wait for everything queued on the stream, the step
launched ahead among it (decode_ahead.py): the device would then idle while the host prepares the next step,
on every step that admits a request with media. So the rows are copied into pinned memory behind the encoders'
work (`copy_rows`), an event marks the copy's end, and the admission queues the request once the event has
passed (`HostRows.ready`): a step or two later, the device kept busy meanwhile.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class HostRows:
    """The audio rows [Na, H] and the vision rows [Ni, H] of a prompt on the host (None: it has none), and the
    event after their copies (None: copied already, as from a CPU)."""

    audio: torch.Tensor | None
    image: torch.Tensor | None
    copied: torch.cuda.Event | None = None

    def ready(self) -> bool:
        """Whether the copies have ended, so that the host may read the rows."""
        return self.copied is None or self.copied.query()

    def wait(self) -> None:
        """Wait for the copies (only the work queued before them)."""
        if self.copied is not None:
            self.copied.synchronize()


def copy_rows(audio: torch.Tensor | None, image: torch.Tensor | None) -> HostRows:
    """The rows on the host: from a GPU, copied into pinned memory behind the work queued on the stream,
    not waited for; from the CPU, as they are."""
    on_gpu = [t for t in (audio, image) if t is not None and t.is_cuda]
    if not on_gpu:
        return HostRows(audio, image)
    audio, image = (to_host(t) for t in (audio, image))
    copied = torch.cuda.Event()
    copied.record(torch.cuda.current_stream(on_gpu[0].device))
    return HostRows(audio, image, copied)


def to_host(t: torch.Tensor | None) -> torch.Tensor | None:
    """A copy of `t` on the host, queued behind the work that reads it, not waited for (pinned off the CPU);
    a tensor already on the host as it is."""
    if t is None or not t.is_cuda:
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t.detach(), non_blocking=True)
