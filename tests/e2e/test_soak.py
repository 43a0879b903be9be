"""bench/soak.py shortened: 16 clients for 20 s against the default server, a quarter of them leaving mid-stream or
before the first token. Afterwards every answer is complete and equals the same request sent alone, nothing runs
or waits, every KV block is free and the server's memory is where it was."""
from __future__ import annotations

import sys

import pytest
from conftest import ROOT, start_server, stop_server, wait_healthy

sys.path.insert(0, str(ROOT / "bench"))
import soak  # noqa: E402  (bench/ is scripts, not a package)

pytestmark = pytest.mark.slow


def test_a_short_soak_leaves_the_server_as_it_found_it():
    process, base_url, log_path = start_server(log_name="soak-server")  # default flags, as `make run`
    try:
        wait_healthy(process, base_url, log_path)
        config = soak.SoakConfig(clients=16, duration_s=20, warmup_s=5, idle_timeout_s=30)
        report = soak.run_soak(base_url, process.pid, config)
        print(report.summary())
        assert process.poll() is None, log_path.read_text()[-3000:]
        assert report.passed, report.summary()
        by_kind = report.by_kind()
        assert all(row["completed"] > 0 for row in by_kind.values()), report.summary()
        assert sum(row["abandoned"] for row in by_kind.values()) > 0, "no client left early: the soak tested less"
        assert report.rss_before_bytes and report.rss_after_bytes
    finally:
        stop_server(process)
