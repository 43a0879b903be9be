"""Limits that protect the real server, over raw HTTP: a body over --max-body-size is a 413 whether it says its
length or comes chunked; what one request may ask for has upper bounds (400 naming the field); a prompt over the
context is a 400 naming both numbers on every route that takes one. The server keeps serving after each. And CORS:
allowed origins get their headers, others none, and a server without --cors-origins sends none."""
from __future__ import annotations

import contextlib
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest

from conftest import start_server, stop_server, wait_healthy

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MAX_BODY_SIZE = 16384
MAX_MODEL_LEN = 256
HI = [{"role": "user", "content": "hi"}]
ORIGIN = "https://app.example"
LONG_TEXT = "The quick brown fox jumps over the lazy dog. " * 40  # ~400 tokens: over a 256-token context


@pytest.fixture(scope="module")
def limited_server():
    """A small body limit and a short context, so that going over either costs little; CORS for two origins."""
    process, base_url, log_path = start_server(
        "--dtype", "float32", "--quantization", "none", "--no-compile",
        "--max-body-size", str(MAX_BODY_SIZE), "--max-model-len", str(MAX_MODEL_LEN),
        "--cors-origins", f"{ORIGIN}, http://localhost:3000",
        log_name="limited-server",
    )
    try:
        wait_healthy(process, base_url, log_path)
        yield base_url
    finally:
        stop_server(process)


@pytest.fixture
def http(limited_server):
    with httpx.Client(base_url=limited_server, timeout=120) as client:
        yield client


def wait_answering(process, base_url: str, log_path, timeout_s: float = 120.0) -> None:
    """Until the server answers HTTP at all (with or without a model)."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert process.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
        with contextlib.suppress(httpx.HTTPError):
            httpx.get(f"{base_url}/health", timeout=2)
            return
        time.sleep(0.25)


def raw_exchange(base_url: str, head: str, body_pieces: list[bytes] = ()) -> tuple[int, dict[str, str], bytes]:
    """Send a request head (and body pieces) over a plain socket; -> (status, headers, body) of the answer."""
    url = urlsplit(base_url)
    with socket.create_connection((url.hostname, url.port), timeout=60) as sock:
        sock.sendall(head.replace("\n", "\r\n").encode() + b"\r\n")
        for piece in body_pieces:
            sock.sendall(piece)
        data = b""
        while b"\r\n\r\n" not in data:
            data += sock.recv(65536) or b""
        head_bytes, body = data.split(b"\r\n\r\n", 1)
        status_line, *header_lines = head_bytes.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in header_lines)}
        while len(body) < int(headers["content-length"]):
            chunk = sock.recv(65536)
            assert chunk, "the connection closed before the answer was complete"
            body += chunk
    return int(status_line.split()[1]), headers, body


def assert_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert list(body) == ["error"] and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error"
    return body["error"]


def test_a_declared_length_over_the_limit_is_413_before_any_body_is_sent(limited_server):
    head = (f"POST {CHAT} HTTP/1.1\nHost: test\nContent-Type: application/json\n"
            f"Content-Length: {10 * 1024 * 1024}\n")
    status, headers, body = raw_exchange(limited_server, head)  # no body byte ever sent: the answer comes anyway
    assert status == 413 and headers["x-request-id"]
    assert httpx.Response(413, content=body).json()["error"]["code"] == "request_too_large"


def test_a_chunked_body_over_the_limit_is_413(limited_server):
    head = f"POST {CHAT} HTTP/1.1\nHost: test\nContent-Type: application/json\nTransfer-Encoding: chunked\n"
    chunk = b"x" * 1024
    pieces = [b"%x\r\n%s\r\n" % (len(chunk), chunk)] * (2 * MAX_BODY_SIZE // len(chunk)) + [b"0\r\n\r\n"]
    status, headers, body = raw_exchange(limited_server, head, pieces)
    assert status == 413 and headers["x-request-id"]
    error = httpx.Response(413, content=body).json()["error"]
    assert error["code"] == "request_too_large" and str(MAX_BODY_SIZE) in error["message"]


def test_an_ordinary_client_sending_too_much_reads_the_413_and_the_server_goes_on(http):
    """The client sends its whole body before it reads; the server drops the rest rather than resetting."""
    messages = [{"role": "user", "content": "x" * (4 * MAX_BODY_SIZE)}]
    error = assert_error(http.post(CHAT, json={"messages": messages}), 413)
    assert error["code"] == "request_too_large"
    answer = http.post(COMPLETIONS, json={"prompt": "The capital of France is", "max_tokens": 2, "temperature": 0})
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == " Paris."


BOUNDS = [
    # (what, path, body, param)
    ("n above 16", CHAT, {"messages": HI, "n": 17}, "n"),
    ("top_logprobs above 20", CHAT, {"messages": HI, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("completion logprobs above 20", COMPLETIONS, {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("max_tokens past the context", CHAT, {"messages": HI, "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    ("17 stop strings", COMPLETIONS, {"prompt": "hi", "stop": [f"s{i}" for i in range(17)]}, "stop"),
    ("a stop string of 513 characters", CHAT, {"messages": HI, "stop": ["x" * 513]}, "stop"),
    ("65 stop token ids", COMPLETIONS, {"prompt": "hi", "stop_token_ids": list(range(65))}, "stop_token_ids"),
    ("301 logit_bias entries", CHAT, {"messages": HI, "logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ("129 prompts", COMPLETIONS, {"prompt": ["hi"] * 129, "max_tokens": 1}, "prompt"),
    ("129 scoring pairs", "/v1/loglikelihood", {"prompts": ["a"] * 129, "continuations": [" b"] * 129}, "prompts"),
]


@pytest.mark.parametrize(("path", "body", "param"), [case[1:] for case in BOUNDS], ids=[case[0] for case in BOUNDS])
def test_each_bound_is_a_400_naming_the_field(http, path, body, param):
    assert assert_error(http.post(path, json=body), 400)["param"] == param


def test_at_the_bounds_requests_are_served(http):
    body = {"prompt": ["The capital of France is"] * 128, "max_tokens": 1, "temperature": 0, "n": 1,
            "stop": [f"s{i}" for i in range(16)], "logprobs": 20}
    response = http.post(COMPLETIONS, json=body)
    assert response.status_code == 200 and len(response.json()["choices"]) == 128


def test_a_prompt_over_the_context_is_a_400_naming_both_numbers_on_every_route(http):
    num_tokens = http.post("/tokenize", json={"prompt": LONG_TEXT}).json()["count"]
    chat_tokens = http.post("/tokenize", json={"messages": [{"role": "user", "content": LONG_TEXT}]}).json()["count"]
    assert num_tokens > MAX_MODEL_LEN
    for path, body, param, prompt_tokens in [
        (CHAT, {"messages": [{"role": "user", "content": LONG_TEXT}]}, "messages", chat_tokens),
        (COMPLETIONS, {"prompt": LONG_TEXT}, "prompt", num_tokens),
        (COMPLETIONS, {"prompt": [100] * 300, "max_tokens": 1}, "prompt", 300),
        ("/v1/loglikelihood", {"prompts": [LONG_TEXT], "continuations": [" yes"]}, "prompts", None),
    ]:
        error = assert_error(http.post(path, json=body), 400)
        assert error["code"] == "context_length_exceeded" and error["param"] == param, path
        assert f"maximum context length is {MAX_MODEL_LEN} tokens" in error["message"]
        if prompt_tokens is not None:
            assert f"{prompt_tokens} in the prompt" in error["message"], error["message"]
    assert http.get("/health").status_code == 200


# CORS.
def preflight(base_url: str, origin: str, path: str = CHAT) -> httpx.Response:
    headers = {"Origin": origin, "Access-Control-Request-Method": "POST",
               "Access-Control-Request-Headers": "authorization, content-type"}
    return httpx.options(f"{base_url}{path}", headers=headers, timeout=30)


def cors_headers(response: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in response.headers.items() if k.startswith("access-control-")}


def test_an_allowed_origin_gets_cors_headers_on_the_api(http, limited_server):
    for path in (CHAT, "/v1/models", "/tokenize"):
        allowed = preflight(limited_server, ORIGIN, path)
        assert allowed.status_code == 200
        assert allowed.headers["access-control-allow-origin"] == ORIGIN
        assert "POST" in allowed.headers["access-control-allow-methods"]
        assert "authorization" in allowed.headers["access-control-allow-headers"].lower()
    answer = http.post(CHAT, json={"messages": HI, "max_tokens": 1}, headers={"Origin": "http://localhost:3000"})
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == "http://localhost:3000"
    # The UI is same-origin: ours leaves it alone (Gradio has its own CORS handling, for localhost pages).
    assert "access-control-allow-origin" not in http.get("/", headers={"Origin": ORIGIN}).headers


def test_a_disallowed_origin_gets_no_cors_headers(http, limited_server):
    refused = preflight(limited_server, "https://evil.example")
    assert refused.status_code == 400 and cors_headers(refused) == {}
    answer = http.post(CHAT, json={"messages": HI, "max_tokens": 1}, headers={"Origin": "https://evil.example"})
    assert answer.status_code == 200 and cors_headers(answer) == {}  # served; the browser keeps it from the page


def test_a_server_without_cors_origins_sends_none(tmp_path):
    """Any server started without --cors-origins; one whose model cannot load starts in seconds and still answers."""
    (tmp_path / "config.json").write_text("{}")
    process, base_url, log_path = start_server("--model", str(tmp_path), log_name="no-cors-server")
    try:
        wait_answering(process, base_url, log_path)
        assert cors_headers(preflight(base_url, ORIGIN)) == {}
        answer = httpx.post(f"{base_url}{CHAT}", json={"messages": HI}, headers={"Origin": ORIGIN}, timeout=30)
        assert answer.status_code == 503 and cors_headers(answer) == {}
    finally:
        stop_server(process)
