"""Several models in the UI, in a real browser (Debian's chromium via Playwright) against one real server with two
models (the default one, loaded at start, and a tiny random one, loaded when first asked for) and an API key: the page
and the Compare tab's events need the key; Compare streams both answers side by side, each token's probabilities on
hover, each answer's total the sum of the shown logprobs; Score ranks under both in one table; the Server tab lists
both models with their state."""
from __future__ import annotations

import os
import re

import httpx
import pytest

from conftest import ARTIFACTS, start_server, stop_server, wait_healthy
from engine.weights.checkpoint import default_gguf_path

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
LAPTOP = {"width": 1366, "height": 900}
TIMEOUT_MS = 120_000  # generous: 2 shared CPU cores; every wait below is a bounded poll
API_KEY = "compare-secret"
SMOL, TINY = "smol", "tiny"
LOGPROB = re.compile(r"\(logprob (-?\d+\.\d+)\)")
TOTAL = re.compile(r"(\d+) tokens \u00b7 total logprob (-?\d+\.\d+)")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is missing: `make chromium` installs it"),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_checkpoint):
    models = tmp_path_factory.mktemp("compare") / "models.yaml"
    models.write_text("models:\n"
                      f"  - {{id: {SMOL}, path: '{default_gguf_path()}'}}\n"
                      f"  - {{id: {TINY}, path: '{tiny_checkpoint}', max_model_len: 512}}\n")
    process, base_url, log_path = start_server("--models", str(models), "--no-compile", env={"TERN_API_KEY": API_KEY},
                                               log_name="compare-server")
    try:
        wait_healthy(process, base_url, log_path)
        yield base_url
    finally:
        stop_server(process)


@pytest.fixture(scope="module")
def page(server):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport=LAPTOP)
        page.set_default_timeout(TIMEOUT_MS)
        page.goto(server)
        page.get_by_text("enter it as the password").wait_for()  # the login page, not the UI
        assert page.locator("#compare-run").count() == 0
        page.get_by_label("username").fill("me")
        page.get_by_label("password").fill(API_KEY)
        page.get_by_role("button", name="Login").click()
        page.wait_for_selector("#chat-input textarea")
        yield page
        browser.close()


def test_the_compare_events_need_the_key(server):
    with httpx.Client(base_url=server, timeout=60) as outsider:
        call = outsider.post("/gradio_api/call/compare", json={"data": [SMOL, TINY, "Chat", "hi", ""]})
        assert call.status_code == 401
        assert outsider.get("/gradio_api/info").status_code == 401
    with httpx.Client(base_url=server, timeout=60) as user:
        assert user.post("/login", data={"username": "anyone", "password": API_KEY}).status_code == 200
        assert "/compare" in user.get("/gradio_api/info").json()["named_endpoints"]


def test_compare_streams_two_answers_side_by_side_with_probabilities_on_hover(page):
    page.get_by_role("tab", name="Compare").click()
    page.locator("#compare-run").click()
    # Both answers stream in, each in its own column, side by side.
    page.wait_for_function("() => ['a', 'b'].every(side => "
                           "/seed \\d+/.test(document.querySelector(`#compare-status-${side}`).innerText))")
    statuses = [page.locator(f"#compare-status-{side}").inner_text() for side in "ab"]
    assert statuses[0].startswith(SMOL) and statuses[1].startswith(TINY), statuses
    left, right = (page.locator(f"#compare-answer-{side}").bounding_box() for side in "ab")
    assert left["x"] + left["width"] <= right["x"] + 1 and abs(left["y"] - right["y"]) < 5
    for side, status in zip("ab", statuses):
        tokens = page.locator(f"#compare-tokens-{side} .tern-token")
        titles = [tokens.nth(i).get_attribute("title") for i in range(tokens.count())]
        count, total = TOTAL.search(status).groups()
        shown = [float(LOGPROB.search(title).group(1)) for title in titles]
        assert int(count) == len(shown) > 0
        assert abs(float(total) - sum(shown)) <= 0.0005 * (len(shown) + 1)
        assert all("Top alternatives" in title and "%" in title for title in titles)
    # Hovering shows a token's probabilities; tapping (focusing) one opens them as a popover.
    first = page.locator("#compare-tokens-a .tern-token").first
    first.hover()
    first.click()
    assert page.evaluate("() => getComputedStyle(document.activeElement, '::after').content").count("%") >= 1
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "ui-compare.png"), full_page=True)


def test_score_ranks_the_same_continuations_under_both_models_in_one_table(page):
    page.get_by_role("tab", name="Score").click()
    page.locator("#score-second-model input").click()
    page.get_by_role("option", name=TINY).click()
    page.locator("#score-button").click()
    page.wait_for_function("() => document.querySelector('#score-table')?.innerText.includes('Per token (tiny)')")
    table = page.locator("#score-table").inner_text()
    assert "Log-likelihood (smol)" in table and "Log-likelihood (tiny)" in table and "Paris" in table
    page.get_by_text("Under tiny").wait_for()  # each model's surprises, one section each


def test_the_server_tab_lists_both_models_with_their_state(page):
    page.get_by_role("tab", name="Server").click()
    # Both loaded by now (Compare asked for the tiny one), the table refreshed every few seconds.
    page.wait_for_function("""() => {
      const text = document.querySelector('#server-models')?.innerText || '';
      return text.includes('tiny') && text.includes('smol') && !/not loaded|loading/.test(text);
    }""")
    assert page.locator("#server-models").inner_text().count("loaded") >= 2
