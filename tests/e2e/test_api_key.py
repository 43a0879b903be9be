"""With --api-key, nothing that runs the model answers without the key: not /v1, not the tokenizer routes, not the
UI's page, and not Gradio's own HTTP API (what gradio_client calls). Probes stay open. Tried as an outsider would:
raw HTTP on every Gradio route that can start an event, and gradio_client; then as the user would, with the key."""
from __future__ import annotations

import contextlib
import os

import anthropic
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import ARTIFACTS, start_server, stop_server, wait_healthy

pytestmark = pytest.mark.slow

API_KEY = "tern-test-key-3f7b21"
CHROMIUM = "/usr/bin/chromium"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def keyed_server():
    process, base_url, log_path = start_server(
        "--dtype", "float32", "--quantization", "none", "--no-compile", env={"TERN_API_KEY": API_KEY},
        log_name="keyed-server",
    )
    try:
        wait_healthy(process, base_url, log_path)
        yield base_url, log_path
    finally:
        stop_server(process)


def engine_work(base_url: str) -> tuple[float, float]:
    """(model steps run, tokens generated) since the server started, by every caller, the UI included."""
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    return values["tern_engine_steps_total"], values["tern_engine_generated_tokens_total"]


@contextlib.contextmanager
def logged_in(base_url: str):
    """A client holding the UI's session cookie, logged in as a person would: any name, the key as password."""
    with httpx.Client(base_url=base_url, timeout=60) as client:
        response = client.post("/login", data={"username": "anyone", "password": API_KEY})
        assert response.status_code == 200, response.text
        yield client


def complete_endpoint(named_endpoints: dict) -> str:
    """The Complete tab's handler: the one whose inputs start with the prompt and go on to sampling controls."""
    return next(name for name, spec in named_endpoints.items()
                if [p["label"] for p in spec["parameters"][:2]] == ["Prompt", "Show token probabilities"])


def test_every_route_that_runs_the_model_wants_the_key(keyed_server):
    base_url, log_path = keyed_server
    good = {"Authorization": f"Bearer {API_KEY}"}
    chat = {"messages": QUESTION, "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}, {"Authorization": f"Basic {API_KEY}"}):
        for method, path, body in [("POST", "/v1/chat/completions", chat), ("GET", "/v1/models", None),
                                   ("POST", "/v1/responses", {"input": "hi", "max_output_tokens": 2}),
                                   ("GET", "/v1/responses/resp_1", None), ("DELETE", "/v1/responses/resp_1", None),
                                   ("POST", "/v1/embeddings", {"input": "hi"}),
                                   ("POST", "/tokenize", {"prompt": "hi"}), ("POST", "/detokenize", {"tokens": [1]}),
                                   ("GET", "/tokenizer_info", None)]:
            response = httpx.request(method, f"{base_url}{path}", json=body, headers=headers, timeout=60)
            assert response.status_code == 401, (path, headers)
            error = response.json()["error"]
            assert error["code"] == "invalid_api_key" and set(error) == {"message", "type", "param", "code"}
            assert API_KEY not in response.text
    # The key is checked before the body is read: a caller without it learns nothing, not even that the JSON is bad.
    bad_json = httpx.post(f"{base_url}/v1/chat/completions", content=b"{oops", headers={"content-type": "application/json"})
    assert bad_json.status_code == 401
    # Probes and scrapers stay open.
    for path in ("/health", "/healthz", "/ready", "/readyz", "/metrics"):
        assert httpx.get(f"{base_url}{path}", timeout=30).status_code == 200, path
    # With the key, all of it works.
    assert httpx.post(f"{base_url}/tokenize", json={"prompt": "hi"}, headers=good).json()["count"] >= 1
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{base_url}/v1", api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    reply = client.chat.completions.create(model=client.models.list().data[0].id, messages=QUESTION, temperature=0)
    assert reply.choices[0].message.content == "The capital of France is Paris."
    assert API_KEY not in log_path.read_text()  # never logged


def test_anthropic_clients_send_the_key_as_x_api_key_or_bearer(keyed_server):
    """/v1/messages takes the key the ways Anthropic's clients send it; a wrong or missing one is a 401 in
    Anthropic's envelope, checked before the body is read."""
    base_url, _ = keyed_server
    body = {"model": "unused", "max_tokens": 1, "messages": QUESTION}
    for headers in ({}, {"x-api-key": "wrong"}, {"Authorization": "Bearer wrong"}, {"x-api-key": f"Bearer {API_KEY}"}):
        for path, payload in (("/v1/messages", body), ("/v1/messages/count_tokens", body)):
            response = httpx.post(f"{base_url}{path}", json=payload, headers=headers, timeout=60)
            assert response.status_code == 401, (path, headers)
            assert response.json()["type"] == "error" and response.json()["error"]["type"] == "authentication_error"
            assert API_KEY not in response.text
    # x-api-key is for these routes only: chat keeps OpenAI's Bearer.
    assert httpx.get(f"{base_url}/v1/models", headers={"x-api-key": API_KEY}, timeout=30).status_code == 401
    model = httpx.get(f"{base_url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).json()["data"][0]["id"]
    counted = httpx.post(f"{base_url}/v1/messages/count_tokens", json={**body, "model": model},
                         headers={"x-api-key": API_KEY, "anthropic-version": "2023-06-01"}, timeout=60)
    assert counted.status_code == 200 and counted.json()["input_tokens"] > 0
    # The SDK (which sends its api_key as a Bearer token) works with the key and raises AuthenticationError without.
    with_key = anthropic.Anthropic(base_url=base_url, api_key=API_KEY, max_retries=0, timeout=120)
    assert with_key.messages.create(model=model, max_tokens=1, messages=QUESTION).id.startswith("msg_")
    with_x_api_key = anthropic.Anthropic(base_url=base_url, auth_token=None, api_key=None, max_retries=0,
                                         default_headers={"x-api-key": API_KEY}, timeout=120)
    assert with_x_api_key.messages.count_tokens(model=model, messages=QUESTION).input_tokens > 0
    wrong = anthropic.Anthropic(base_url=base_url, api_key="wrong", max_retries=0, timeout=120)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        wrong.messages.create(model=model, max_tokens=1, messages=QUESTION)
    assert caught.value.body["error"]["type"] == "authentication_error"


def test_gradios_api_generates_nothing_without_the_key(keyed_server):
    base_url, _ = keyed_server
    with logged_in(base_url) as user:  # only to learn the endpoints' names, as a snooping outsider might elsewhere
        info = user.get("/gradio_api/info").json()
    names = [name.lstrip("/") for name in info["named_endpoints"]]
    assert complete_endpoint(info["named_endpoints"])  # the Complete tab's handler is among them
    before = engine_work(base_url)

    with httpx.Client(base_url=base_url, timeout=60) as outsider:
        assert outsider.get("/gradio_api/info").status_code == 401
        assert outsider.get("/config").status_code == 401
        page = outsider.get("/")
        assert page.status_code == 200 and "Tern" not in page.text.split("<title>")[-1][:40]  # the login page
        for name in names:
            call = outsider.post(f"/gradio_api/call/{name}", json={"data": ["The capital of France is"]})
            assert call.status_code == 401, name
            run = outsider.post(f"/gradio_api/run/{name}", json={"data": ["The capital of France is"]})
            assert run.status_code == 401, name
        for fn_index in range(len(names) + 8):  # the queue takes functions by index, named or not
            join = outsider.post("/gradio_api/queue/join", json={
                "fn_index": fn_index, "data": ["The capital of France is"], "session_hash": "outsider", "event_data": None,
            })
            assert join.status_code == 401, fn_index
        # A logged-out cookie of someone else's guess is no key either.
        outsider.cookies.set("access-token", "guess")
        assert outsider.post(f"/gradio_api/call/{names[0]}", json={"data": []}).status_code == 401

    from gradio_client import Client
    from gradio_client.exceptions import AuthenticationError

    with pytest.raises(AuthenticationError):
        Client(base_url, verbose=False)
    assert engine_work(base_url) == before  # not one step, not one token


def test_with_the_key_gradio_client_runs_the_ui(keyed_server):
    base_url, _ = keyed_server
    from gradio_client import Client

    wrong = httpx.post(f"{base_url}/login", data={"username": "anyone", "password": "wrong"}, timeout=60)
    assert wrong.status_code in (400, 401) and not wrong.cookies  # a wrong key gets no session
    client = Client(base_url, auth=("anyone", API_KEY), verbose=False)
    endpoints = client.view_api(print_info=False, return_format="dict")["named_endpoints"]
    assert endpoints  # the same API a key-less server would list
    steps_before, tokens_before = engine_work(base_url)
    # The Complete tab: prompt, token probabilities, temperature, top-p, top-k, max new tokens, seed, stops.
    result = client.predict("The capital of France is", False, 0.0, 1.0, 0, 4, None, "",
                            api_name=complete_endpoint(endpoints))
    assert "Paris" in str(result)
    steps_after, tokens_after = engine_work(base_url)
    assert steps_after > steps_before and tokens_after > tokens_before


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is missing: `make chromium` installs it")
def test_a_person_logs_in_with_the_key_and_chats(keyed_server):
    from playwright.sync_api import sync_playwright

    from test_browser import CHROMIUM_ARGS, LAST_BOT_TEXT, TIMEOUT_MS

    base_url, _ = keyed_server
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.set_default_timeout(TIMEOUT_MS)
            page.goto(base_url)
            page.get_by_text("enter it as the password").wait_for()  # Tern's login message, not the UI
            assert page.locator("#chat-input").count() == 0
            page.get_by_label("username").fill("me")
            page.get_by_label("password").fill("not the key")
            page.get_by_role("button", name="Login").click()
            page.get_by_text("Incorrect").wait_for()
            page.get_by_label("username").fill("me")  # the login form clears itself after a refusal
            page.get_by_label("password").fill(API_KEY)
            page.get_by_role("button", name="Login").click()
            page.wait_for_selector("#chat-input textarea")
            page.fill("#chat-input textarea", "What is the capital of France?")
            page.click("#chat-send")
            # The UI samples (a low temperature, not greedy): any reply the model streams back will do.
            page.wait_for_function(f"() => ({LAST_BOT_TEXT})().trim().length >= 5")
        except Exception:
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "ui-login-failure.png"), full_page=True)
            raise
        finally:
            with contextlib.suppress(Exception):
                browser.close()
