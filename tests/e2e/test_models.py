"""Several models in one server (--models): one real server with the default model (loaded at start), two tiny random
models and one that cannot load, under --max-loaded 2, driven with the real `openai` and `anthropic` SDKs: each id
answers as itself, a model loads on demand while another streams (the stream goes on), the least recently used idle
model is evicted for a newcomer, an idle one unloads after its keep-alive, a failed load leaves the others serving,
an unknown id is a 404 naming the served ones."""
from __future__ import annotations

import threading
import time

import anthropic
import httpx
import openai
import pytest

from engine.weights.checkpoint import default_gguf_path
from conftest import start_server, stop_server, wait_healthy

pytestmark = pytest.mark.slow

DEFAULT, TINY_A, TINY_B, BROKEN = "smol", "tiny-a", "tiny-b", "broken"
TIMEOUT_S = 120.0  # 2 shared CPU cores: a bound, never an assertion on speed
WAIT_S = 120.0
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_checkpoint):
    folder = tmp_path_factory.mktemp("models")
    not_a_model = folder / "notes"  # exists, but is no checkpoint: it fails when first asked for
    not_a_model.mkdir()
    (folder / "models.yaml").write_text(
        "models:\n"
        f"  - {{id: {DEFAULT}, path: '{default_gguf_path()}'}}\n"
        f"  - {{id: {TINY_A}, path: '{tiny_checkpoint}', max_model_len: 512}}\n"
        f"  - {{id: {TINY_B}, path: '{tiny_checkpoint}', keep_alive: 2}}\n"
        f"  - {{id: {BROKEN}, path: '{not_a_model}'}}\n")
    process, base_url, log_path = start_server("--models", str(folder / "models.yaml"), "--no-compile",
                                               "--keep-alive", "-1", "--max-loaded", "2", log_name="models-server")
    try:
        wait_healthy(process, base_url, log_path)
        yield base_url
    finally:
        stop_server(process)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S)


def states(server: str) -> dict[str, str]:
    return {card["id"]: card["state"] for card in httpx.get(f"{server}/v1/models", timeout=30).json()["data"]}


def wait_for_state(server: str, model: str, state: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while (now := states(server)[model]) != state:
        assert time.monotonic() < deadline, f"{model} is {now}, never {state}"
        time.sleep(0.1)


def metric(server: str, line_start: str) -> float:
    for line in httpx.get(f"{server}/metrics", timeout=30).text.splitlines():
        if line.startswith(line_start + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def ask(client: openai.OpenAI, model: str, max_tokens: int = 3):
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=max_tokens, **GREEDY)


def test_models_are_listed_with_their_state_and_each_id_answers_as_itself(server, client):
    listed = states(server)
    assert list(listed) == [DEFAULT, TINY_A, TINY_B, BROKEN] and listed[DEFAULT] == "loaded"
    health = httpx.get(f"{server}/health", timeout=30).json()
    assert health["model"] == DEFAULT and health["models"] == listed
    for model in (DEFAULT, TINY_A):
        reply = ask(client, model)
        assert reply.model == model and reply.usage.completion_tokens == 3
    default = ask(client, "")  # no model named: the first one
    assert default.model == DEFAULT
    card = client.models.retrieve(TINY_A)
    assert card.state == "loaded" and card.max_model_len == 512  # its own --models options
    info = httpx.get(f"{server}/tokenizer_info", params={"model": TINY_A}, timeout=30).json()
    assert info["model_max_length"] == 512


def test_a_stored_response_continues_on_another_model(client):
    first = client.responses.create(model=TINY_A, input="Hi", max_output_tokens=3, temperature=0)
    second = client.responses.create(model=DEFAULT, input="And?", previous_response_id=first.id,
                                     max_output_tokens=3, temperature=0)
    assert (first.model, second.model) == (TINY_A, DEFAULT)
    assert second.usage.input_tokens > client.responses.create(model=DEFAULT, input="And?", max_output_tokens=3,
                                                               temperature=0).usage.input_tokens  # history included


def test_a_model_loads_on_demand_while_another_streams_uninterrupted(server, client):
    client.chat.completions.create(model=DEFAULT, messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
    stream = client.completions.create(model=DEFAULT, prompt="Once upon a time", max_tokens=120, stream=True,
                                       stream_options={"include_usage": True}, **GREEDY)
    first = next(iter(stream))
    assert first.choices[0].text is not None
    if states(server)[TINY_B] == "loaded":  # whichever tiny model is loaded now, ask for the other
        newcomer = TINY_A
    else:
        newcomer = TINY_B
    was = states(server)[newcomer]
    reply = ask(client, newcomer)  # loads it (evicting the idle tiny one, never the streaming one)
    still_running = metric(server, f'tern_num_requests_running{{model="{DEFAULT}"}}')
    rest = list(stream)
    assert reply.model == newcomer and was == "unloaded"
    assert still_running == 1  # the load happened while the stream ran
    assert rest[-2].choices[0].finish_reason == "length" and rest[-1].usage.completion_tokens == 120
    assert states(server)[DEFAULT] == "loaded"


def test_a_stream_holds_its_model_until_it_ends_or_its_client_leaves(server):
    leases = f'tern_model_leases{{model="{DEFAULT}"}}'
    body = {"model": DEFAULT, "prompt": "Hi", "max_tokens": 1000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=TIMEOUT_S) as response:
        lines = response.iter_lines()  # kept: a dropped iterator closes the stream
        next(lines)  # streaming: its model is leased
        assert metric(server, leases) == 1
    deadline = time.monotonic() + WAIT_S  # the client left: the lease goes with the response
    while metric(server, leases) != 0:
        assert time.monotonic() < deadline, "the lease outlived its stream"
        time.sleep(0.1)


def test_the_least_recently_used_idle_model_is_evicted_for_a_newcomer(server, client):
    ask(client, TINY_A)  # loaded beside the default model (--max-loaded 2)
    ask(client, DEFAULT)  # now the default model is the more recently used
    evicted = metric(server, f'tern_model_unloads_total{{model="{TINY_A}",reason="evicted"}}')
    assert ask(client, TINY_B).model == TINY_B
    now = states(server)  # (tiny-b may already have idled out: its keep-alive is 2 s)
    assert (now[DEFAULT], now[TINY_A]) == ("loaded", "unloaded")
    assert metric(server, f'tern_model_unloads_total{{model="{TINY_A}",reason="evicted"}}') == evicted + 1


def test_an_idle_model_unloads_after_its_keep_alive_and_loads_again_when_asked(server, client):
    loads = metric(server, f'tern_model_loads_total{{model="{TINY_B}"}}')
    ask(client, TINY_B)
    wait_for_state(server, TINY_B, "unloaded")  # its keep_alive: 2 s
    assert metric(server, f'tern_model_unloads_total{{model="{TINY_B}",reason="idle"}}') >= 1
    assert ask(client, TINY_B).model == TINY_B
    assert metric(server, f'tern_model_loads_total{{model="{TINY_B}"}}') >= loads + 1
    assert httpx.get(f"{server}/health", timeout=30).status_code == 200  # liveness never fails for an idle model


def test_a_model_that_fails_to_load_says_why_and_the_others_serve_on(server, client):
    with pytest.raises(openai.APIStatusError) as caught:
        ask(client, BROKEN)
    assert caught.value.status_code == 503
    message = caught.value.response.json()["error"]["message"]
    assert f"`{BROKEN}`" in message and "config.json" in message  # which model, and why
    card = next(c for c in httpx.get(f"{server}/v1/models", timeout=30).json()["data"] if c["id"] == BROKEN)
    assert card["state"] == "failed" and "config.json" in card["error"]
    assert ask(client, TINY_A).model == TINY_A


def test_an_unknown_model_is_a_404_naming_the_served_ones(client):
    with pytest.raises(openai.NotFoundError) as caught:
        ask(client, "gpt-4o")
    message = caught.value.response.json()["error"]["message"]
    assert all(f"`{model}`" in message for model in (DEFAULT, TINY_A, TINY_B, BROKEN))


def test_anthropics_messages_route_serves_the_model_named_and_errors_in_its_shape(server):
    claude = anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0, timeout=TIMEOUT_S)
    message = claude.messages.create(model=TINY_A, max_tokens=3, messages=[{"role": "user", "content": "Hi"}])
    assert message.model == TINY_A and message.usage.output_tokens <= 3
    counted = claude.messages.count_tokens(model=TINY_A, messages=[{"role": "user", "content": "Hi"}])
    assert counted.input_tokens > 0
    with pytest.raises(anthropic.NotFoundError) as caught:
        claude.messages.create(model="claude-x", max_tokens=3, messages=[{"role": "user", "content": "Hi"}])
    assert caught.value.body["type"] == "error" and "`tiny-a`" in caught.value.body["error"]["message"]


def test_two_requests_for_an_unloaded_model_load_it_once(server, client):
    wait_for_state(server, TINY_B, "unloaded")  # its keep-alive
    loads = metric(server, f'tern_model_loads_total{{model="{TINY_B}"}}')
    replies = []
    threads = [threading.Thread(target=lambda: replies.append(ask(client, TINY_B))) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT_S)
    assert [r.model for r in replies] == [TINY_B, TINY_B]
    assert metric(server, f'tern_model_loads_total{{model="{TINY_B}"}}') == loads + 1
