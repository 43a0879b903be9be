"""bench/soak.py shortened: 16 clients for 20 s against the default server, a quarter of them leaving mid-stream or
before the first token. Afterwards every answer is complete and equals the same request sent alone, nothing runs
or waits, every KV block is free and the server's memory is where it was."""
from __future__ import annotations

import sys

import pytest
from conftest import ROOT, start_server, stop_server, wait_healthy

sys.path.insert(0, str(ROOT / "bench"))
import soak  # noqa: E402  (bench/ is scripts, not a package)


@pytest.mark.slow
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


# The soak's judge of a greedy answer that parted from the alone one (a pure function, tested on its own).
SUNFLOWER, EARTH = "\N{SUNFLOWER}".encode(), "\N{EARTH GLOBE EUROPE-AFRICA}".encode()


def _emoji_entries(second_logprob: float) -> list:
    """Alone: " I" then a sunflower spelled in byte tokens (shared 3-byte prefix, then its last byte), where the
    globe's last byte was the runner-up at second_logprob."""
    prefix, last, rival = SUNFLOWER[:3], SUNFLOWER[3:], EARTH[3:]
    return [(b" I", -0.1, [(b" I", -0.1), (b"\n", -3.0)]),
            (prefix, -0.05, [(prefix, -0.05)]),
            (last, -0.6, [(last, -0.6), (rival, second_logprob), (b"<|im_end|>", -4.0)])]


def test_a_rival_byte_token_within_the_margin_is_a_near_tie():
    verdict = soak._near_tie(_emoji_entries(-0.9), b" I" + EARTH, "length", may_stop=False)
    assert verdict.startswith("near tie"), verdict


def test_a_rival_byte_token_beyond_the_margin_is_wrong():
    verdict = soak._near_tie(_emoji_entries(-0.6 - soak.TIE_MARGIN_NATS - 0.5), b" I" + EARTH, "length", may_stop=False)
    assert verdict.startswith("wrong"), verdict


def test_text_no_rival_explains_is_wrong():
    verdict = soak._near_tie(_emoji_entries(-0.9), b" You", "length", may_stop=False)
    assert verdict.startswith("wrong"), verdict


def test_ending_where_the_end_of_turn_was_a_close_rival_is_a_near_tie():
    entries = _emoji_entries(-0.9)
    entries[1] = (entries[1][0], -0.7, [(entries[1][0], -0.7), (b"<|im_end|>", -1.2)])
    assert soak._near_tie(entries, b" I", "stop", may_stop=False).startswith("near tie")
