"""TernBoard: one small Ray Serve deployment that every replica reports to each second (its Prometheus metrics,
whether it has requests), so the ingress can answer /metrics for all replicas at once and a shutdown can tell them
all to drain. Ray's handles reach one replica per call; this is how an order reaches every one."""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

REPORT_PERIOD_S = 1.0
STALE_AFTER_S = 10.0  # a replica that has not reported for this long is gone (dead, or stopped)


class TernBoard:
    def __init__(self) -> None:
        self._reports: dict[str, tuple[float, str, bool]] = {}  # replica -> (when, metrics text, has requests)
        self._is_draining = False

    def report(self, replica_id: str, metrics_text: str, has_requests: bool) -> bool:
        """A replica's report; the answer says whether to drain."""
        self._reports[replica_id] = (time.monotonic(), metrics_text, has_requests)
        return self._is_draining

    def drain(self) -> None:
        """Shutting down: every replica drains at its next report (new requests get 503, running ones finish)."""
        self._is_draining = True

    def replicas(self) -> dict[str, bool]:
        """The replicas that reported lately -> whether they still have requests."""
        return {rid: busy for rid, (_, _, busy) in self._live().items()}

    def metrics(self) -> str:
        """Every live replica's metrics in one Prometheus exposition, each sample labelled with its replica."""
        return merge_metrics({rid: text for rid, (_, text, _) in self._live().items()})

    def _live(self) -> dict[str, tuple[float, str, bool]]:
        oldest = time.monotonic() - STALE_AFTER_S
        return {rid: report for rid, report in sorted(self._reports.items()) if report[0] >= oldest}


def merge_metrics(texts: dict[str, str]) -> str:
    """Prometheus texts of several replicas -> one, each family once, each sample with a `replica` label."""
    families: dict[str, Metric] = {}
    for replica_id, text in texts.items():
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            for sample in family.samples:
                merged.add_sample(sample.name, {**sample.labels, "replica": replica_id}, sample.value)
    registry = CollectorRegistry()
    registry.register(_Fixed(list(families.values())))
    return generate_latest(registry).decode()


class _Fixed:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self):
        return self.families
