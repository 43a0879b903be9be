"""Tern on Ray Serve, 2 replicas of a tiny random model: the API key, the 429 when every replica is full, a client's
disconnect aborting the replica's request, and a replica killed mid-load (its requests fail cleanly, the survivor
serves, Ray restarts the dead one)."""
from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from conftest import ARTIFACTS, deploy_on_ray, undeploy_from_ray

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "e2e"))
from test_browser import CHROMIUM, CHROMIUM_ARGS, LAST_BOT_TEXT, TIMEOUT_MS  # noqa: E402

pytestmark = pytest.mark.slow

KEY = "sk-ray-test"
TIMEOUT_S = 120.0
LONG = {"max_tokens": 1500, "extra_body": {"ignore_eos": True}}  # long enough to still run while the test acts


@pytest.fixture(scope="module")
def base_url(ray_serve, tiny_checkpoint):
    # 2 running + 2 waiting per replica: a burst of 12 fills both.
    deploy_on_ray("--model", str(tiny_checkpoint), "--served-model-name", "tern-tiny", "--api-key", KEY, "--max-num-seqs", "2", "--max-waiting", "2",
                  "--drain-timeout", "5", replicas=2)
    yield ray_serve
    undeploy_from_ray()


@pytest.fixture(scope="module")
def client(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0, timeout=TIMEOUT_S)


def metric_sum(base_url: str, name: str) -> tuple[float, int]:
    """(the metric summed over replicas, how many replicas reported it) from the ingress's merged /metrics."""
    values = re.findall(rf"^{name}\{{[^}}]*replica=\"[^\"]+\"[^}}]*\}} (\S+)$", httpx.get(f"{base_url}/metrics").text, re.M)
    return sum(float(v) for v in values), len(values)


def chat(**options) -> dict:
    return {"model": "tern-tiny", "messages": [{"role": "user", "content": "Tell me about terns."}], **options}


def test_the_api_key_is_asked_for_through_ray_and_probes_stay_open(base_url, client):
    with pytest.raises(openai.AuthenticationError) as caught:
        openai.OpenAI(base_url=f"{base_url}/v1", api_key="wrong", max_retries=0).models.list()
    assert caught.value.status_code == 401 and caught.value.body["type"] == "invalid_request_error"
    assert client.models.list().data[0].id == "tern-tiny"
    assert httpx.get(f"{base_url}/health").status_code == 200  # open, as on one server
    assert "tern_model_loaded" in httpx.get(f"{base_url}/metrics").text


def test_metrics_merge_every_replica_and_answers_name_their_replica(base_url, client):
    loaded, num_replicas = metric_sum(base_url, "tern_model_loaded")
    assert (loaded, num_replicas) == (2, 2)
    response = client.chat.completions.with_raw_response.create(**chat(max_tokens=2))
    assert response.headers["x-tern-replica"]  # which replica answered
    assert response.parse().choices[0].finish_reason == "length"


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is missing: `make chromium` installs it")
def test_a_person_logs_in_to_the_ui_through_ray_and_chats(base_url):
    """Gradio keeps a login (and the queue's events) in the memory of one replica: the page's cookie keeps the browser
    there, or the login would count on one replica and the chat be refused by the other."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.set_default_timeout(TIMEOUT_MS)
            page.goto(base_url)
            page.get_by_text("enter it as the password").wait_for()  # Tern's login message, not the UI
            page.get_by_label("username").fill("me")
            page.get_by_label("password").fill(KEY)
            page.get_by_role("button", name="Login").click()
            page.wait_for_selector("#chat-input textarea")
            page.fill("#chat-input textarea", "Where do terns nest?")
            page.click("#chat-send")
            page.wait_for_function(f"() => ({LAST_BOT_TEXT})().trim().length >= 5")  # a random model: any reply
            assert {c["name"] for c in page.context.cookies()} >= {"tern-replica"}
        except Exception:
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "ui-ray-login-failure.png"), full_page=True)
            raise
        finally:
            browser.close()


def test_every_replica_full_is_a_429_in_openais_shape_and_the_next_request_is_served(base_url):
    async def burst():
        async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=KEY, max_retries=0, timeout=TIMEOUT_S) as c:
            async def one(i: int):
                messages = [{"role": "user", "content": f"Request {i}: tell me about terns."}]
                try:
                    return await c.chat.completions.create(model="tern-tiny", messages=messages, **LONG)
                except openai.RateLimitError as exc:
                    return exc
            return await asyncio.gather(*(one(i) for i in range(12)))

    results = asyncio.run(burst())
    refused = [r for r in results if isinstance(r, openai.RateLimitError)]
    served = [r for r in results if not isinstance(r, Exception)]
    assert refused and served and len(refused) + len(served) == 12, results
    assert all(r.status_code == 429 and r.code == "rate_limit_exceeded" and r.type == "rate_limit_error"
               and int(r.response.headers["retry-after"]) >= 1 for r in refused)
    assert all(r.choices[0].finish_reason == "length" for r in served)
    again = httpx.post(f"{base_url}/v1/chat/completions", json=chat(max_tokens=2),
                       headers={"Authorization": f"Bearer {KEY}"}, timeout=TIMEOUT_S)
    assert again.status_code == 200


def wait_until_idle(base_url: str, timeout_s: float = 30.0) -> float:
    """Until no replica reports a running request (reports are up to a second old); returns the last count."""
    deadline = time.monotonic() + timeout_s
    while (running := metric_sum(base_url, "tern_num_requests_running")[0]) and time.monotonic() < deadline:
        time.sleep(0.25)
    return running


def test_a_client_that_disconnects_has_its_request_aborted_on_the_replica(base_url):
    headers = {"Authorization": f"Bearer {KEY}"}
    assert wait_until_idle(base_url) == 0  # what earlier tests sent has ended
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=chat(stream=True, max_tokens=3000,
                      ignore_eos=True), headers=headers, timeout=TIMEOUT_S) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        while not next(lines).startswith("data: "):
            pass
        deadline = time.monotonic() + 10
        while metric_sum(base_url, "tern_num_requests_running")[0] < 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert metric_sum(base_url, "tern_num_requests_running")[0] == 1
    # Closed after one chunk, thousands of tokens before its end: the replica's engine must drop it.
    assert wait_until_idle(base_url, timeout_s=20) == 0


def test_a_killed_replica_fails_its_requests_cleanly_the_other_serves_and_ray_restarts_it(base_url):
    import ray

    headers = {"Authorization": f"Bearer {KEY}"}
    assert wait_until_idle(base_url, timeout_s=60) == 0  # the UI test's reply may still be generating

    async def load():
        async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=TIMEOUT_S) as http:
            started: dict[int, str] = {}
            outcome: dict[int, str] = {}

            async def stream(i: int) -> None:
                # A system prompt of its own: no prefix in common, so the streams spread over both replicas.
                body = {"model": "tern-tiny", "stream": True, "max_tokens": 1200, "ignore_eos": True,
                        "messages": [{"role": "system", "content": f"Stream {i}."},
                                     {"role": "user", "content": "Tell me about terns."}]}
                async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                    started[i] = response.headers.get("x-tern-replica", f"none: {response.status_code}")
                    lines = [line async for line in response.aiter_lines()]
                events = [line for line in lines if line.startswith("data: ")]
                assert response.status_code == 200 and events[-1] == "data: [DONE]", (response.status_code, lines)
                errors = [json.loads(e[6:]) for e in events[:-1] if '"error"' in e]
                outcome[i] = "error" if errors else json.loads(events[-2][6:])["choices"][0]["finish_reason"]

            tasks = []
            for i in range(4):  # one after the other, so that each is placed knowing where the others run
                tasks.append(asyncio.create_task(stream(i)))
                while i not in started and not tasks[-1].done():
                    await asyncio.sleep(0.05)
            victim = started[0]
            ray.kill(ray.get_actor(f"SERVE_REPLICA::tern#TernReplica#{victim}", namespace="serve"), no_restart=True)
            # Meanwhile new requests go to the survivor, and are answered.
            during = []
            for i in range(3):
                response = await http.post("/v1/chat/completions", json=chat(max_tokens=2))
                during.append((response.status_code, response.headers.get("x-tern-replica")))
            await asyncio.wait_for(asyncio.gather(*tasks), timeout=TIMEOUT_S)  # never a hang
            return victim, started, outcome, during

    victim, started, outcome, during = asyncio.run(load())
    for i, replica in started.items():
        assert outcome[i] == ("error" if replica == victim else "length"), (i, replica, victim, outcome)
    assert all(status == 200 and replica != victim for status, replica in during), during
    # Ray starts a new replica; once Serve counts two running, both report. The dead one's last report stays on the
    # board until it is STALE_AFTER_S old (deploy/board.py), and the new one reports within a second of starting: until
    # both have happened the board lists the victim beside the survivor, or all three.
    from ray import serve

    def num_running() -> int:
        return serve.status().applications["tern"].deployments["TernReplica"].replica_states.get("RUNNING", 0)

    def reporting() -> set[str]:
        metrics = httpx.get(f"{base_url}/metrics").text
        return set(re.findall(r'^tern_model_loaded\{[^}]*replica="([^"]+)"[^}]*\} 1\.0$', metrics, re.M))

    def settled() -> bool:  # two running, two reporting, the victim not among them
        return num_running() == 2 and len(replicas := reporting()) == 2 and victim not in replicas

    deadline = time.monotonic() + 120
    while not settled() and time.monotonic() < deadline:
        time.sleep(1)
    assert num_running() == 2 and metric_sum(base_url, "tern_model_loaded") == (2, 2), reporting()
    assert victim not in reporting()
    seen = set()
    deadline = time.monotonic() + 60
    while len(seen) < 2 and time.monotonic() < deadline:  # short prompts, no prefix to follow: the replicas share them
        response = httpx.post(f"{base_url}/v1/completions", headers=headers, timeout=TIMEOUT_S,
                              json={"model": "tern-tiny", "prompt": "A tern", "max_tokens": 1})
        assert response.status_code == 200
        seen.add(response.headers["x-tern-replica"])
    assert len(seen) == 2 and victim not in seen
