"""The SDK end-to-end tests (chat, completions, streaming, logprobs, errors, the async client) and the UI, through
Ray Serve with 2 replicas of the default model: the same tests as tests/e2e/test_api_sdk.py, run again with
`live_server` being Tern on Ray."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from conftest import deploy_on_ray, undeploy_from_ray

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "e2e"))
from test_api_sdk import (  # noqa: E402,F401  (collected here again, against Ray)
    client, model,
    test_chat_answers_and_stops_by_itself_when_max_tokens_is_left_out,
    test_streamed_chat_has_openais_sequence_and_the_same_text,
    test_without_include_usage_no_chunk_carries_usage,
    test_n_gives_that_many_choices_and_usage_counts_them_all,
    test_stop_strings_and_stop_token_ids_end_the_text_without_showing_it,
    test_length_limits_max_completion_tokens_max_tokens_min_tokens_and_ignore_eos,
    test_seed_makes_sampling_repeatable,
    test_chat_logprobs_are_openais_content_list,
    test_streamed_logprobs_add_up_to_the_streamed_text,
    test_completion_of_a_text_prompt,
    test_completion_prompts_as_strings_token_ids_and_batches,
    test_echo_with_logprobs_returns_the_prompt_and_offsets_from_its_start,
    test_streamed_completion_matches_the_whole_one,
    test_client_mistakes_are_the_sdks_4xx_exceptions_with_openais_fields,
    test_the_async_client_runs_everything_concurrently,
)
from test_browser import CHROMIUM, CHROMIUM_ARGS, LAPTOP, TIMEOUT_MS, last_bot_text, set_number, wait_for_reply  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def live_server(ray_serve, default_checkpoint):
    """As tests/conftest.py's live_server (fp32, unquantized: transformers' answers), on Ray with 2 replicas; the
    decode step is not compiled (two background compiles would hold both cores for minutes)."""
    deploy_on_ray("--dtype", "float32", "--quantization", "none", replicas=2)
    yield ray_serve
    undeploy_from_ray()


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is missing: `make chromium` installs it")
def test_the_ui_loads_and_chats_through_ray_on_one_replica(live_server):
    """Gradio keeps each session (its queue's events) in one process: the page pins the browser to the replica
    that served it (a cookie), so the chat's events all reach that replica."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport=LAPTOP)
            page.set_default_timeout(TIMEOUT_MS)
            page.goto(live_server)
            page.wait_for_selector("#chat-input textarea")
            [cookie] = [c for c in page.context.cookies() if c["name"] == "tern-replica"]
            page.locator("#chat-sampling").click()
            set_number(page, "chat-temperature", "0")
            page.fill("#chat-input textarea", "What is the capital of France?")
            page.click("#chat-send")
            wait_for_reply(page, "Paris")
            assert "The capital of France is Paris" in last_bot_text(page)
            assert cookie["value"] and cookie["httpOnly"]
        finally:
            browser.close()
