"""`/metrics` of every replica in one scrape: each replica posts its own Prometheus text to a board (a small
Ray actor), and any replica answers a scrape with every posted text merged, each sample labelled with its
`replica`.

A replica posts its text when it answers a scrape and every `POST_INTERVAL_S` besides, so a scrape shows each
other replica as it was at most that long ago; a replica that has not posted for `STALE_AFTER_S` (it died, or
was scaled away) drops out.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

POST_INTERVAL_S = 2.0
STALE_AFTER_S = 10.0
BOARD_NAME = "omnistage-metrics-board"


class MetricsBoard:
    """The replicas' latest texts (a Ray actor: one per Serve application, named BOARD_NAME)."""

    def __init__(self) -> None:
        self._texts: dict[str, tuple[float, str]] = {}

    def post(self, replica: str, text: str) -> None:
        self._texts[replica] = (time.monotonic(), text)

    def texts(self) -> dict[str, str]:
        """The text of each replica heard from within STALE_AFTER_S."""
        now = time.monotonic()
        self._texts = {r: (t, text) for r, (t, text) in self._texts.items() if now - t <= STALE_AFTER_S}
        return {replica: text for replica, (_, text) in self._texts.items()}


def merged(texts: dict[str, str]) -> bytes:
    """One Prometheus exposition of `texts` (replica -> its exposition): each family once, its samples from
    every replica with a `replica` label."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(texts))
    return generate_latest(registry)


class _Merged(Collector):
    def __init__(self, texts: dict[str, str]) -> None:
        self.texts = texts

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for replica, text in sorted(self.texts.items()):
            for family in text_string_to_metric_families(text):
                into = families.setdefault(
                    family.name, Metric(family.name, family.documentation, family.type)
                )
                into.samples += _labelled(family.samples, replica)
        yield from families.values()


def _labelled(samples: Iterable, replica: str) -> list:
    return [s._replace(labels={**s.labels, "replica": replica}) for s in samples]
