"""Media parts decode at most `DECODING_AT_ONCE` at a time however many requests are prepared at once (the
server's threads for that are many: pipeline/preparing.py), and a failed decoding gives its turn back."""

from __future__ import annotations

import base64
import threading
from concurrent.futures import ThreadPoolExecutor

from omnistage import media
from omnistage.errors import InvalidMedia

PART = {
    "type": "image_url",
    "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"png").decode()},
}


class Decoder:
    """A stand-in image decoder that counts the decodings running at once. Each waits inside until
    `DECODING_AT_ONCE` are (a barrier, not a sleep: on a busy CPU the threads may start further apart than any
    sleep), so the count reaches the bound whenever that many turns are there, and a lost turn breaks the
    barrier after its timeout."""

    def __init__(self, fails: bool = False) -> None:
        self.fails, self.running, self.most = fails, 0, 0
        self.lock = threading.Lock()
        self.all_in = threading.Barrier(media.DECODING_AT_ONCE, timeout=30)

    def __call__(self, data: bytes) -> str:
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
        self.all_in.wait()
        with self.lock:
            self.running -= 1
        if self.fails:
            raise InvalidMedia("not an image")
        return "decoded"


def decode_many(count: int) -> list[dict | Exception]:
    def one(_: int) -> dict | Exception:
        try:
            return media.decode_part(PART, media.MediaPolicy(), "messages[0].content[0]")
        except InvalidMedia as exc:
            return exc

    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(one, range(count)))


def test_at_most_so_many_decodings_at_once(monkeypatch):
    decoder = Decoder()
    monkeypatch.setattr(media, "decode_image", decoder)
    results = decode_many(3 * media.DECODING_AT_ONCE)
    assert results == [{"type": "image", "image": "decoded"}] * (3 * media.DECODING_AT_ONCE)
    assert decoder.most == media.DECODING_AT_ONCE


def test_a_failed_decoding_gives_its_turn_back(monkeypatch):
    monkeypatch.setattr(media, "decode_image", Decoder(fails=True))
    failures = decode_many(2 * media.DECODING_AT_ONCE)
    assert all(
        isinstance(f, InvalidMedia) and "messages[0].content[0]: not an image" in str(f) for f in failures
    )
    decoder = Decoder()
    monkeypatch.setattr(media, "decode_image", decoder)
    assert decode_many(media.DECODING_AT_ONCE)[0] == {"type": "image", "image": "decoded"}
    assert decoder.most == media.DECODING_AT_ONCE  # every turn came back
