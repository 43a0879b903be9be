"""The web UI is built on its first visit, not at start: a server used only through /v1 never imports Gradio (its start
was ~3 s sooner for it on 2 cores, bench/startup.py), and the first visitors still get the whole UI, built once."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
from conftest import start_server, stop_server, wait_healthy

BUILT = "web UI built on its first request"


def test_the_ui_is_built_once_on_its_first_visits_and_a_server_that_built_it_still_exits_cleanly():
    process, base_url, log_path = start_server(log_name="lazy-ui")
    try:
        wait_healthy(process, base_url, log_path)
        assert httpx.get(f"{base_url}/v1/models", timeout=30).status_code == 200
        assert BUILT not in log_path.read_text()  # serving the API built nothing of the UI

        # A browser's first page load asks for the page and its parts at once: each gets its answer, one build.
        paths = ["/", "/config", "/theme.css", "/", "/gradio_api/info"]
        with ThreadPoolExecutor(len(paths)) as pool:
            answers = list(pool.map(lambda path: httpx.get(f"{base_url}{path}", timeout=120), paths))
        assert [a.status_code for a in answers] == [200] * len(paths), [(a.url, a.text[:200]) for a in answers]
        assert answers[0].headers["content-type"].startswith("text/html")
        assert answers[1].json()["mode"] == "blocks"  # Gradio's config of the UI's Blocks
        assert log_path.read_text().count(BUILT) == 1
        # Paths neither the API nor the UI has are still the UI's 404s, and the API keeps its own routes.
        assert httpx.get(f"{base_url}/no-such-page", timeout=30).status_code == 404
        assert httpx.get(f"{base_url}/v1/models", timeout=30).json()["data"]
    finally:
        stop_server(process)
    assert process.returncode == 0, log_path.read_text()[-3000:]
    assert log_path.read_text().count(BUILT) == 1
