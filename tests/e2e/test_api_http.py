"""Raw HTTP against the real server: SSE framing and [DONE], error bodies and status codes for a table of bad inputs,
X-Request-ID, /health, /ready, /metrics, /openapi.json, the tokenizer routes and /v1/loglikelihood."""
from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import ARTIFACTS, SERVER_PIDS

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The capital of France is"
ANY = object()  # a table cell that is not checked


@pytest.fixture(scope="module")
def http(live_server):
    with httpx.Client(base_url=live_server, timeout=120.0) as client:
        yield client


def events(response: httpx.Response) -> list[str]:
    """The data of each SSE event, checking the framing: `data: <one line>` events separated by a blank line."""
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    body = response.text
    assert body.endswith("\n\n")
    pieces = body[:-2].split("\n\n")
    assert all(piece.startswith("data: ") and "\n" not in piece for piece in pieces), body
    return [piece[len("data: ") :] for piece in pieces]


def assert_error_shape(response: httpx.Response) -> dict:
    """OpenAI's error body: exactly {"error": {"message", "type", "param", "code"}}, code a string or null."""
    body = response.json()
    assert list(body) == ["error"], body  # never FastAPI's {"detail": ...}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
    assert error["code"] is None or isinstance(error["code"], str)
    assert error["param"] is None or isinstance(error["param"], str)
    return error


def metrics(http: httpx.Client) -> dict[str, float]:
    """Every sample of /metrics as "name{label=value,...}" -> value, the `model` label left out: this server serves
    one model, so each model series has one sample, labelled with its id; HTTP requests are counted under it or, when
    they named no model (or got no further than its check), under "", and the two are added up here."""
    response = http.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    model_id = http.get("/v1/models").json()["data"][0]["id"]
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            assert sample.labels.get("model", model_id) in (model_id, "")  # "": a request that named none
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model")
            key = f"{sample.name}{{{labels}}}" if labels else sample.name
            samples[key] = samples.get(key, 0.0) + sample.value
    return samples


# Server-sent events.
def test_chat_stream_framing_and_done(http):
    response = http.post(CHAT, json={"messages": MESSAGES, "temperature": 0, "stream": True})
    assert response.headers["cache-control"] == "no-cache"
    data = events(response)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0]["delta"] == {} and chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert [c["choices"][0]["finish_reason"] for c in chunks].count("stop") == 1
    assert all("usage" not in c or c["usage"] is None for c in chunks)  # not asked for
    whole = http.post(CHAT, json={"messages": MESSAGES, "temperature": 0}).json()
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert streamed == whole["choices"][0]["message"]["content"] == "The capital of France is Paris."


def test_include_usage_adds_one_last_chunk_and_nulls_elsewhere(http):
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    data = events(http.post(COMPLETIONS, json=body))
    assert data[-1] == "[DONE]"
    *chunks, last = [json.loads(d) for d in data[:-1]]
    assert all(c["usage"] is None and len(c["choices"]) == 1 for c in chunks)
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == " Paris.\n"
    assert last["choices"] == [] and last["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                                                       "prompt_tokens_details": {"cached_tokens": 0}}


def test_a_refused_stream_is_a_plain_4xx_not_an_event_stream(http):
    response = http.post(CHAT, json={"messages": MESSAGES, "stream": True, "model": "gpt-4o"})
    assert response.status_code == 404 and response.headers["content-type"] == "application/json"
    assert assert_error_shape(response)["code"] == "model_not_found"


# Bad inputs: each a 4xx in OpenAI's shape, never a 500 or a hang.
HI = [{"role": "user", "content": "hi"}]
BAD_INPUTS = [
    # (what, path, JSON body or raw bytes, status, param, code)
    ("malformed JSON", CHAT, b'{"messages": [', 400, None, ANY),
    ("a JSON array, not an object", CHAT, b"[1, 2]", 400, None, "invalid_type"),
    ("no body at all", COMPLETIONS, b"", 400, None, ANY),
    ("no messages", CHAT, {"temperature": 0}, 400, "messages", "missing_required_parameter"),
    ("messages as a string", CHAT, {"messages": "hi"}, 400, "messages", "invalid_type"),
    ("content as a number", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", "invalid_type"),
    ("an unknown role", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role", ANY),
    ("no prompt", COMPLETIONS, {"max_tokens": 1}, 400, "prompt", "missing_required_parameter"),
    ("a prompt of the wrong type", COMPLETIONS, {"prompt": 5}, 400, "prompt", "invalid_type"),
    ("an empty prompt", COMPLETIONS, {"prompt": ""}, 400, "prompt", "invalid_value"),
    ("an empty token-id prompt in a batch", COMPLETIONS, {"prompt": [[1, 2], []]}, 400, "prompt", "invalid_value"),
    ("max_tokens as a word", COMPLETIONS, {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens", "invalid_type"),
    ("negative max_tokens", COMPLETIONS, {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens", "invalid_value"),
    ("negative max_completion_tokens", CHAT, {"messages": HI, "max_completion_tokens": -5}, 400, "max_completion_tokens",
     "invalid_value"),
    ("top_p above 1", CHAT, {"messages": HI, "top_p": 1.5}, 400, "top_p", "invalid_value"),
    ("temperature above 2", COMPLETIONS, {"prompt": "hi", "temperature": 2.5}, 400, "temperature", "invalid_value"),
    ("n too large", CHAT, {"messages": HI, "n": 1000}, 400, "n", "invalid_value"),
    ("top_logprobs above 20", CHAT, {"messages": HI, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", "invalid_value"),
    ("top_logprobs without logprobs", CHAT, {"messages": HI, "top_logprobs": 2}, 400, "top_logprobs", ANY),
    ("completion logprobs above 20", COMPLETIONS, {"prompt": "hi", "logprobs": 21}, 400, "logprobs", "invalid_value"),
    ("a token id outside the vocabulary", COMPLETIONS, {"prompt": [1, 10**6]}, 400, "prompt", "invalid_value"),
    ("a negative token id", COMPLETIONS, {"prompt": [[5, -1]]}, 400, "prompt", "invalid_value"),
    ("an unknown model", CHAT, {"model": "gpt-4o", "messages": HI}, 404, "model", "model_not_found"),
    ("prompt + max_tokens beyond the context", COMPLETIONS, {"prompt": "hi", "max_tokens": 10**6}, 400, "max_tokens",
     "context_length_exceeded"),
    ("a prompt longer than the context", COMPLETIONS, {"prompt": [100] * 9000, "max_tokens": 1}, 400, ANY,
     "context_length_exceeded"),
    ("suffix", COMPLETIONS, {"prompt": "hi", "suffix": "!"}, 400, "suffix", "unsupported_parameter"),
    ("best_of above n", COMPLETIONS, {"prompt": "hi", "best_of": 3}, 400, "best_of", "unsupported_parameter"),
    ("an image part", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages[0].content[0]", "unsupported_content_type"),
    ("a tool of another type", CHAT, {"messages": HI, "tools": [{"type": "web_search", "function": {"name": "f"}}]},
     400, "tools[0].type", "unsupported_parameter"),
    ("a tool_choice naming no tool", CHAT, {"messages": HI, "tools": [{"type": "function", "function": {"name": "f"}}],
     "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice", "invalid_value"),
    ("a Responses input item of another type", "/v1/responses", {"input": [{"type": "web_search_call", "id": "ws_1"}]}, 400,
     "input[0].type", "unsupported_parameter"),
    ("a response_format of an unknown type", CHAT, {"messages": HI, "response_format": {"type": "xml"}}, 400,
     "response_format", "unsupported_parameter"),
    ("a JSON schema that cannot be compiled", CHAT, {"messages": HI, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(("}}}}, 400,
     "response_format", "invalid_value"),
    ("stream_options without stream", CHAT, {"messages": HI, "stream_options": {"include_usage": True}}, 400,
     "stream_options", ANY),
    ("a logit_bias key that is no token id", CHAT, {"messages": HI, "logit_bias": {"Paris": 5}}, 400, "logit_bias", ANY),
    ("a logit_bias out of range", CHAT, {"messages": HI, "logit_bias": {"5": 500}}, 400, "logit_bias", "invalid_value"),
    ("stop of the wrong type", COMPLETIONS, {"prompt": "hi", "stop": [1]}, 400, "stop", "invalid_type"),
    ("a seed beyond int64", COMPLETIONS, {"prompt": "hi", "seed": 2**64}, 400, "seed", "invalid_value"),
    ("unpaired scoring lists", "/v1/loglikelihood", {"prompts": ["a", "b"], "continuations": [" c"]}, 400, "continuations",
     ANY),
    ("an empty continuation", "/v1/loglikelihood", {"prompts": ["a"], "continuations": [""]}, 400, "continuations", ANY),
    ("tokenize without text", "/tokenize", {}, 400, "prompt", ANY),
    ("detokenize ids outside the vocabulary", "/detokenize", {"tokens": [10**6]}, 400, "tokens", "invalid_value"),
    ("an unknown /v1 route", "/v1/audio/speech", {"input": "x"}, 404, None, "unknown_url"),
]


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "code"), [case[1:] for case in BAD_INPUTS], ids=[case[0] for case in BAD_INPUTS]
)
def test_bad_inputs_are_4xx_in_openais_shape(http, path, body, status, param, code):
    if isinstance(body, bytes):
        response = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        response = http.post(path, json=body)
    assert response.status_code == status, response.text
    assert response.headers["x-request-id"]
    error = assert_error_shape(response)
    assert error["type"] == "invalid_request_error"
    if param is not ANY:
        assert error["param"] == param
    if code is not ANY:
        assert error["code"] == code
    if code == "context_length_exceeded":
        assert "maximum context length" in error["message"]


def test_the_server_still_serves_after_the_bad_inputs(http):
    assert http.get("/health").status_code == 200
    response = http.post(COMPLETIONS, json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0})
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == " Paris."


def test_unknown_fields_are_ignored(http):
    body = {"messages": HI, "max_tokens": 2, "parallel_tool_calls": False, "metadata": {"a": "b"}, "service_tier": "auto"}
    assert http.post(CHAT, json=body).status_code == 200


# Request ids.
def test_every_response_carries_a_request_id_the_logs_use_too(http, live_server):
    mine = f"test-{time.monotonic_ns()}"
    response = http.post(COMPLETIONS, json={"prompt": PROMPT, "max_tokens": 1}, headers={"X-Request-ID": mine})
    assert response.headers["x-request-id"] == mine
    body = {"messages": HI, "max_tokens": 1, "stream": True}
    with http.stream("POST", CHAT, json=body, headers={"X-Request-ID": "s-1"}) as stream:
        assert stream.headers["x-request-id"] == "s-1"
        stream.read()
    assert http.post(CHAT, json={"messages": 5}, headers={"X-Request-ID": "e-1"}).headers["x-request-id"] == "e-1"
    # Without one (or with one unfit for a log line) each response gets a fresh id, the UI's and the schema's too.
    ids = [http.get(path).headers["x-request-id"] for path in ("/health", "/v1/models", "/openapi.json", "/")]
    ids.append(http.get("/health", headers={"X-Request-ID": "two words " + "x" * 200}).headers["x-request-id"])
    assert len(set(ids)) == len(ids) and all(ids)
    log = ARTIFACTS / f"live-server-{live_server.rsplit(':', 1)[1]}.log"
    deadline = time.monotonic() + 30
    while mine not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.2)  # bounded poll: the log line is written as the response goes out
    assert f'{mine} "POST /v1/completions" 200' in log.read_text()


# Status routes.
def test_health_and_ready(http):
    health = http.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    ready = http.get("/ready")
    assert ready.status_code == 200 and ready.json()["ready"] is True


def test_metrics_count_requests_tokens_and_latencies(http):
    before = metrics(http)
    response = http.post(COMPLETIONS, json={"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200
    http.post(CHAT, json={"messages": 5})
    after = metrics(http)

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert grew("tern_http_requests_total{method=POST,route=/v1/completions,status=200}") == 1
    assert grew("tern_http_requests_total{method=POST,route=/v1/chat/completions,status=400}") == 1
    assert grew("tern_prompt_tokens_total") == 5 and grew("tern_completion_tokens_total") == 3
    assert grew("tern_time_to_first_token_seconds_count") == 1
    assert grew("tern_inter_token_latency_seconds_count") == 2
    assert "tern_inter_token_latency_seconds_bucket{le=+Inf}" in after
    for gauge in ("tern_num_requests_running", "tern_num_requests_waiting", "tern_kv_cache_usage_ratio"):
        assert gauge in after
    assert 0.0 <= after["tern_kv_cache_usage_ratio"] <= 1.0


def _wake_ups(pid: int) -> int:
    """How many times the server's threads (its event loop, the engine's, every other) have gone to sleep and been
    woken so far. A thread that ended takes its count with it: that only lowers the total."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
        except FileNotFoundError:  # the thread ended between the listing and the read
            continue
        total += int(next(line.split()[1] for line in status.splitlines()
                          if line.startswith("voluntary_ctxt_switches")))
    return total


IDLE_WAKE_UPS = 100  # the evidence gathered: ~1.3 s of an idle server (~75 a second), ~0.1 s of a busy-polling one
MAX_IDLE_WAKE_UPS_PER_S = 250


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads the threads' counters from Linux's /proc")
def test_an_idle_server_leaves_the_cpu_alone(http, live_server):
    # Gradio's queue polls every 1 ms by default (~870 wake-ups a second here, ~6% of a core); each one takes a core
    # and the GIL from the engine's threads. ui/__init__.py slows the polling down to 20 ms (~75 a second, ~1.3%).
    # An engine thread that waited with a short timeout instead of on its condition would poll the same way.
    # Idle means no compile under way and no request left over from an earlier test (a stream whose client left is
    # aborted in the background): both share the GIL, so the waits below end on those events, bounded.
    deadline = time.monotonic() + 900
    while http.get("/v1/models").json()["data"][0]["decode_step"] == "compiling" and time.monotonic() < deadline:
        time.sleep(1)
    deadline = time.monotonic() + 60
    while (before := metrics(http))["tern_num_requests_running"] + before["tern_num_requests_waiting"] > 0:
        assert time.monotonic() < deadline, "requests of earlier tests are still in the engine after 60 s"
        time.sleep(0.2)
    # The window ends once the server has woken IDLE_WAKE_UPS times (or, quieter still, at a bounded deadline), not
    # after a fixed sleep. Why a slow or busy machine cannot fail it: an idle server's threads are all blocked, each
    # until a timer or an event; other load can only delay a timer, never fire it sooner, and a blocked thread has
    # no GIL to contend for. So a slower machine stretches the window for the same count, lowering the rate. The
    # window starts before the first count and ends after the last, so the test's own delays only lengthen it.
    pid = SERVER_PIDS[live_server]
    started = time.monotonic()
    first, deadline = _wake_ups(pid), started + 30
    while (woken := _wake_ups(pid) - first) < IDLE_WAKE_UPS and time.monotonic() < deadline:
        time.sleep(0.02)
    per_second = woken / (time.monotonic() - started)
    assert per_second < MAX_IDLE_WAKE_UPS_PER_S, f"the idle server's threads woke {per_second:.0f} times a second"
    assert metrics(http)["tern_engine_steps_total"] == before["tern_engine_steps_total"]  # no model step while idle


def test_the_server_holds_its_kv_pool_and_weights_in_huge_pages(http, live_server):
    """app.py asks torch's allocator for transparent huge pages (THP_MEM_ALLOC_ENABLE), and the KV pool's own
    memory follows it: the 1 GiB pool, resident whole soon after start, and the weights sit in 2 MB pages, which
    decode steps stream through with 512x fewer page walks. Where the kernel offers them only on request (madvise)
    nothing else gives them; half the pool leaves room for a fragmented machine's fallback to small pages."""
    offered = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not offered.exists() or "[never]" in offered.read_text():
        pytest.skip("this kernel offers no transparent huge pages")
    deadline = time.monotonic() + 120
    while not ((card := http.get("/v1/models").json()["data"][0])["kv_cache_resident"] and card["weights_settled"]):
        assert time.monotonic() < deadline, "the KV pool never became resident, or the weights never settled"
        time.sleep(0.2)
    rollup = Path(f"/proc/{SERVER_PIDS[live_server]}/smaps_rollup").read_text()
    huge_kb = next(int(line.split()[1]) for line in rollup.splitlines() if line.startswith("AnonHugePages:"))
    assert huge_kb * 1024 >= card["kv_cache_bytes"] // 2 > 0


# The schema.
def test_openapi_describes_every_route_and_field(http):
    schema = http.get("/openapi.json").json()
    paths = schema["paths"]
    for path, method in [
        (CHAT, "post"), (COMPLETIONS, "post"), ("/v1/models", "get"), ("/v1/models/{model_id}", "get"),
        ("/v1/loglikelihood", "post"), ("/tokenize", "post"), ("/detokenize", "post"), ("/tokenizer_info", "get"),
        ("/health", "get"), ("/ready", "get"), ("/metrics", "get"),
    ]:
        assert method in paths[path], path
        assert "422" not in paths[path][method]["responses"]  # clients never get FastAPI's 422
    fields = schema["components"]["schemas"]
    chat_fields = set(fields["ChatCompletionRequest"]["properties"])
    assert chat_fields >= {
        "messages", "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stop", "stream",
        "stream_options", "seed", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs",
        "user", "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
    }
    assert set(fields["CompletionRequest"]["properties"]) >= {"prompt", "echo", "logprobs", "max_tokens", "suffix"}
    assert set(fields["ErrorDetail"]["properties"]) == {"message", "type", "param", "code"}
    assert "text/event-stream" in paths[CHAT]["post"]["responses"]["200"]["content"]


# Tokenizer routes (what lm-evaluation-harness's remote tokenizer probes) and scoring.
def test_tokenizer_info_tokenize_and_detokenize(http, default_tokenizer):
    info = http.get("/tokenizer_info").json()
    assert info["eos_token"] == default_tokenizer.eos_token == "<|im_end|>"
    assert info["bos_token"] == default_tokenizer.bos_token
    assert "im_start" in info["chat_template"] and info["model_max_length"] >= 2048
    tokens = http.post("/tokenize", json={"prompt": "Hello world", "add_special_tokens": False}).json()
    assert tokens["tokens"] == default_tokenizer.encode("Hello world", add_special_tokens=False)
    assert tokens["count"] == len(tokens["tokens"])
    chat = http.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    assert chat == default_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert http.post("/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": "Hello world"}


def test_loglikelihood_scores_continuations(http):
    body = {"prompts": [PROMPT, PROMPT], "continuations": [" Paris", " London"]}
    scores = http.post("/v1/loglikelihood", json=body).json()
    assert set(scores) == {"ll", "is_greedy", "tokens"}
    paris, london = scores["ll"]
    assert london < paris < 0 and scores["is_greedy"] == [True, False]
    assert [len(t) for t in scores["tokens"]] == [1, 1]
    # The same number as the echoed prompt's logprob of " Paris".
    echo = http.post(COMPLETIONS, json={"prompt": PROMPT + " Paris", "echo": True, "logprobs": 0, "max_tokens": 0}).json()
    assert echo["choices"][0]["logprobs"]["token_logprobs"][-1] == pytest.approx(paris, abs=1e-4)
    # Token ids work too.
    ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    by_ids = http.post("/v1/loglikelihood", json={"prompts": [ids], "continuations": [scores["tokens"][0]]}).json()
    assert by_ids["ll"][0] == pytest.approx(paris, abs=1e-4)
