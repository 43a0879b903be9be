"""The Gradio UI in a real browser (Debian's chromium via Playwright) against the real server: chat streaming,
Stop, token probabilities, a JSON schema for the reply, scoring, and screenshots of every tab under test-artifacts/
(laptop and phone widths)."""
from __future__ import annotations

import json
import os
import re

import jsonschema
import pytest

from conftest import ARTIFACTS

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
    "--disable-sync", "--no-first-run",
]
LAPTOP = {"width": 1366, "height": 900}
PHONE = {"width": 390, "height": 844}
TIMEOUT_MS = 120_000  # generous: 2 shared CPU cores; every wait below is a bounded poll

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is missing: `make chromium` installs it"),
]

LAST_BOT_TEXT = """() => {
  const bots = document.querySelectorAll('#chat-log [data-testid=bot]');
  return bots.length ? bots[bots.length - 1].innerText : '';
}"""


@pytest.fixture(scope="module")
def page(live_server):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport=LAPTOP)
        page.set_default_timeout(TIMEOUT_MS)
        page.goto(live_server)
        page.wait_for_selector("#chat-input textarea")
        yield page
        browser.close()


def screenshot(page, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"ui-{name}.png"), full_page=True)


def set_number(page, elem_id: str, value: str) -> None:
    """Type into a slider's or number's text box and commit it, as a user would."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeoutError

    box = page.locator(f"#{elem_id} input[type=number]")
    box.wait_for()  # inside a panel that may still be opening
    # The slider follows once the value is committed; a click sent before then would use the old value. Right
    # after the page loads, Gradio can drop the commit (seen in about one full-suite run in three), so type it
    # again, as a user would, a bounded number of times.
    for attempt in range(4):
        box.fill(value)
        box.press("Tab")
        try:
            page.wait_for_function(
                "([id, value]) => document.querySelector(`#${id} input[type=range]`).value === value",
                arg=[elem_id, value], timeout=15_000,
            )
            return
        except PlaywrightTimeoutError:
            if attempt == 3:
                raise


def open_tab(page, name: str) -> None:
    page.get_by_role("tab", name=name).click()


def last_bot_text(page) -> str:
    return page.evaluate(LAST_BOT_TEXT)


def wait_for_reply(page, pattern: str) -> None:
    """Until the last reply matches and the chat's progress indicator has gone (the reply is complete)."""
    page.wait_for_function(f"() => /{pattern}/.test(({LAST_BOT_TEXT})())")
    page.wait_for_function(
        "() => document.querySelector('#chat-log [data-testid=status-tracker]').classList.contains('hide')"
    )


def test_chat_streams_a_reply(page):
    page.locator("#chat-sampling").click()  # the collapsed sampling panel
    set_number(page, "chat-temperature", "0")
    page.fill("#chat-input textarea", "What is the capital of France?")
    page.click("#chat-send")
    wait_for_reply(page, "Paris")
    assert "The capital of France is Paris" in last_bot_text(page)
    screenshot(page, "chat")


def test_token_probabilities_colour_each_token(page):
    page.locator("#chat-show-probs input[type=checkbox]").check()
    tokens = page.locator("#chat-log [data-testid=bot] .tern-token")
    tokens.first.wait_for()
    assert tokens.count() >= 5
    colours = {tokens.nth(i).evaluate("e => getComputedStyle(e).backgroundColor") for i in range(tokens.count())}
    assert all(c.startswith("rgb") for c in colours) and len(colours) >= 2, colours
    title = tokens.nth(1).get_attribute("title")
    assert "%" in title and "Top alternatives" in title  # what hovering shows
    assert "Paris" in "".join(tokens.nth(i).inner_text() for i in range(tokens.count()))
    tokens.nth(5).click()  # tapping (focusing) a token opens the same details as a styled popover
    screenshot(page, "chat-token-probabilities")
    page.locator("#chat-show-probs input[type=checkbox]").uncheck()
    page.wait_for_function("() => !document.querySelector('#chat-log .tern-token')")


def test_stop_ends_a_reply_mid_stream(page):
    set_number(page, "chat-max-tokens", "1500")
    page.fill("#chat-input textarea", "Write a very long story about a dragon who learns to paint.")
    page.click("#chat-send")
    page.wait_for_function(f"() => ({LAST_BOT_TEXT})().length > 40")  # streaming has begun
    page.click("#chat-stop")
    # The engine drops the request: the Server tab's live load returns to zero running requests.
    open_tab(page, "Server")
    page.wait_for_function(
        "() => /Running requests\\s*0\\b/.test(document.querySelector('#server-stats').innerText)"
    )
    open_tab(page, "Chat")
    stopped = last_bot_text(page)
    assert len(stopped) > 40
    # After the engine is idle the reply no longer grows; a later server refresh still finds it unchanged.
    open_tab(page, "Server")
    page.wait_for_function("() => /Running requests\\s*0\\b/.test(document.querySelector('#server-stats').innerText)")
    open_tab(page, "Chat")
    assert last_bot_text(page) == stopped
    set_number(page, "chat-max-tokens", "256")


def test_score_ranks_two_continuations(page):
    open_tab(page, "Score")
    page.fill("#score-prompt textarea", "The capital of France is")
    page.fill("#score-continuations textarea", " a banana.\n Paris.")
    page.click("#score-button")
    page.locator("#score-tokens .tern-token").first.wait_for()
    table = page.locator("#score-table").inner_text()
    assert table.index("Paris") < table.index("banana"), table  # the likelier continuation ranks first
    assert re.search(r"Most likely: .*Paris", page.locator("#score-notice").inner_text())
    screenshot(page, "score")


def test_complete_tab_streams_with_logprobs(page):
    open_tab(page, "Complete")
    page.fill("#complete-prompt textarea", "The three primary colours are")
    page.locator("#complete-show-probs input[type=checkbox]").check()
    page.click("#complete-generate")
    page.wait_for_function("() => /finished/.test(document.querySelector('#complete-status').innerText)")
    assert page.locator("#complete-output textarea").input_value().strip()
    assert page.locator("#complete-tokens .tern-token").count() >= 1
    screenshot(page, "complete")


def test_server_tab_shows_model_and_sdk_snippet(page, live_server):
    open_tab(page, "Server")
    page.wait_for_function("() => /base_url/.test(document.querySelector('#server-snippet').innerText)")
    assert f'base_url="{live_server}/v1"' in page.locator("#server-snippet").inner_text()
    # The facts table fills in its own update, which may come after the snippet's.
    page.wait_for_function("() => /SmolLM2/.test(document.querySelector('#server-model').innerText)")
    facts = page.locator("#server-model").inner_text()
    assert "SmolLM2-135M-Instruct" in facts and "float32" in facts and "8,192 tokens" in facts
    screenshot(page, "server")


def test_phone_width_keeps_the_chat_usable(page):
    page.set_viewport_size(PHONE)
    try:
        open_tab(page, "Chat")
        assert "The capital of France is Paris" in page.locator("#chat-log").inner_text()  # the chat is intact
        send = page.locator("#chat-send").bounding_box()
        assert send is not None and send["x"] + send["width"] <= PHONE["width"]  # no sideways scrolling to send
        screenshot(page, "phone-chat")
        open_tab(page, "Score")
        screenshot(page, "phone-score")
    finally:
        page.set_viewport_size(LAPTOP)


def test_chat_json_schema_gives_an_indented_validated_reply(page):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}, "country": {"type": "string", "maxLength": 30}},
        "required": ["city", "country"],
        "additionalProperties": False,
    }
    open_tab(page, "Chat")
    page.click("#chat-clear")
    page.wait_for_function("() => !document.querySelector('#chat-log [data-testid=bot]')")
    page.locator("#chat-json").click()  # the collapsed "JSON output" panel
    page.fill("#chat-schema textarea", json.dumps(schema, indent=2))
    page.fill("#chat-input textarea", "What is the capital of France? Answer in JSON.")
    page.click("#chat-send")
    wait_for_reply(page, "Valid JSON")
    bubble = page.locator("#chat-log [data-testid=bot]").last
    code = bubble.locator("pre code").inner_text().strip()
    value = json.loads(code)
    jsonschema.validate(value, schema)
    assert code == json.dumps(value, indent=2)  # shown indented, whatever whitespace the model wrote
    assert bubble.get_by_text("\u2713 Valid JSON: it matches the schema.").is_visible()
    screenshot(page, "chat-json-schema")
    page.fill("#chat-schema textarea", "")  # back to free text for whatever runs next


LONG_STORY = "Write a very long story about a dragon who learns to paint."
SENDING = ["#chat-input textarea", "#chat-send", "#chat-retry"]  # what could start a second reply


def start_long_reply(page) -> None:
    """A fresh conversation whose reply streams for minutes (greedy, 1500 tokens: it does not end by itself), once
    its first words are shown."""
    open_tab(page, "Chat")
    page.click("#chat-clear")
    page.wait_for_function("() => !document.querySelector('#chat-log [data-testid=bot]')")
    if not page.locator("#chat-max-tokens input[type=number]").is_visible():
        page.locator("#chat-sampling").click()  # the collapsed sampling panel (when this test runs alone)
    set_number(page, "chat-temperature", "0")
    set_number(page, "chat-max-tokens", "1500")
    page.fill("#chat-input textarea", LONG_STORY)
    page.click("#chat-send")
    wait_for_more_reply(page, "")


def wait_for_more_reply(page, shown: str, num_chars: int = 40) -> str:
    """Until the last reply has grown num_chars past `shown`; -> the reply then."""
    page.wait_for_function(f"n => ({LAST_BOT_TEXT})().length >= n", arg=len(shown) + num_chars)
    return last_bot_text(page)


def wait_until_sending_is_possible(page) -> None:
    page.wait_for_function(
        "selectors => selectors.every(s => !document.querySelector(s).disabled)", arg=SENDING
    )


def test_no_second_message_while_a_reply_streams(page):
    start_long_reply(page)
    assert page.locator("#chat-input textarea").input_value() == ""  # the message went into the conversation
    # Nothing can start a second reply: the textbox, Send and Retry are disabled, and the textbox says why.
    assert all(page.locator(selector).is_disabled() for selector in SENDING)
    assert "wait for the reply" in page.locator("#chat-input textarea").get_attribute("placeholder")
    shown = last_bot_text(page)
    page.locator("#chat-send").click(force=True)  # what a user can still try: click anyway, press Enter
    page.locator("#chat-retry").click(force=True)
    page.locator("#chat-input textarea").click(force=True)
    page.keyboard.press("Enter")
    # The one reply goes on where it was (Retry did not restart it), and no second turn has appeared.
    later = wait_for_more_reply(page, shown)
    assert later.startswith(shown)
    assert page.locator("#chat-log [data-testid=user]").count() == 1
    assert page.locator("#chat-log [data-testid=bot]").count() == 1
    screenshot(page, "chat-replying")
    # Stop ends it, and sending works again.
    page.click("#chat-stop")
    wait_until_sending_is_possible(page)
    assert page.locator("#chat-input textarea").get_attribute("placeholder") == "Type a message and press Enter"
    page.fill("#chat-input textarea", "What is the capital of France?")
    page.press("#chat-input textarea", "Enter")
    wait_for_reply(page, "Paris")  # a reply that ends by itself: the model's end of text
    wait_until_sending_is_possible(page)
    # The cursor is back in the textbox, so the next message can be typed straight away.
    page.wait_for_function("() => document.activeElement === document.querySelector('#chat-input textarea')")
    assert page.locator("#chat-log [data-testid=user]").count() == 2
    assert page.locator("#chat-log [data-testid=bot]").count() == 2
    # Retry answers the last turn again, in place: it locks sending while it replies, and unlocks when done.
    page.click("#chat-retry")
    page.wait_for_function("() => document.querySelector('#chat-send').disabled")
    wait_for_reply(page, "Paris")
    wait_until_sending_is_possible(page)
    assert page.locator("#chat-log [data-testid=user]").count() == 2
    assert page.locator("#chat-log [data-testid=bot]").count() == 2


def test_clear_mid_stream_ends_the_reply_and_sending_works_again(page):
    start_long_reply(page)
    page.click("#chat-clear")
    page.wait_for_function("() => !document.querySelector('#chat-log [data-testid=bot]')")
    wait_until_sending_is_possible(page)
    # The engine dropped the request: the Server tab's live load returns to zero running requests.
    open_tab(page, "Server")
    page.wait_for_function("() => /Running requests\\s*0\\b/.test(document.querySelector('#server-stats').innerText)")
    open_tab(page, "Chat")
    # Nothing came back after the clear, and the next message starts a new conversation.
    assert page.locator("#chat-log [data-testid=bot]").count() == 0
    page.fill("#chat-input textarea", "What is the capital of France?")
    page.press("#chat-input textarea", "Enter")
    wait_for_reply(page, "Paris")
    assert page.locator("#chat-log [data-testid=user]").count() == 1


def test_token_probabilities_switch_while_a_reply_streams(page):
    checkbox = page.locator("#chat-show-probs input[type=checkbox]")
    checkbox.uncheck()
    start_long_reply(page)
    tokens = page.locator("#chat-log [data-testid=bot] .tern-token")
    checkbox.check()
    tokens.first.wait_for()  # at once, not when the reply ends
    assert page.locator("#chat-legend").is_visible()
    # The reply keeps streaming, coloured token by token.
    page.wait_for_function(
        "n => document.querySelectorAll('#chat-log [data-testid=bot] .tern-token').length >= n",
        arg=tokens.count() + 10,
    )
    assert page.locator("#chat-send").is_disabled()  # still replying
    screenshot(page, "chat-token-probabilities-streaming")
    checkbox.uncheck()
    page.wait_for_function("() => !document.querySelector('#chat-log .tern-token')")
    wait_for_more_reply(page, last_bot_text(page))  # plain text again, still streaming
    assert tokens.count() == 0 and not page.locator("#chat-legend").is_visible()
    page.click("#chat-stop")
    wait_until_sending_is_possible(page)
    set_number(page, "chat-max-tokens", "256")
