"""lm-evaluation-harness through the server, emulated.

The harness is too heavy to install for CI, so these tests send exactly the requests its `local-completions` and
`local-chat-completions` models send (lm_eval/models/openai_completions.py `_create_payload`, api_models.py
`create_message` / `model_call` / `batch_loglikelihood_requests`, utils.py `RemoteTokenizer` and
`check_remote_tokenizer_support`, gguf.py `get_result`), over its own transport (`requests`, with its header
`Authorization: Bearer <OPENAI_API_KEY or "">`), and read the answers the way it does. The log-likelihoods are checked
against the engine's own prompt logprobs (the `default_engine` fixture: the same model and dtype, in process).
"""
from __future__ import annotations

from operator import itemgetter

import pytest

from engine import SamplingParams

requests = pytest.importorskip("requests")  # lm-evaluation-harness's transport (installed here through gguf)

pytestmark = pytest.mark.slow

HEADERS = {"Authorization": "Bearer "}  # what the harness sends when OPENAI_API_KEY is unset
SEED = 1234  # the harness's default seed
# (context, continuation) pairs as a multiple-choice task hands them over.
EXAMPLES = [
    ("The capital of France is", " Paris"),
    ("The capital of France is", " London"),
    ("Question: What color is a clear sky?\nAnswer:", " blue"),
    ("1, 2, 3, 4,", " 5, 6"),
]


class RemoteTokenizer:
    """lm_eval.utils.RemoteTokenizer: the server's own tokenizer, through /tokenize and /detokenize."""

    def __init__(self, server: str) -> None:
        self.server = server
        self.info = requests.get(f"{server}/tokenizer_info", headers=HEADERS).json()

    def encode(self, text: str) -> list[int]:
        response = requests.post(f"{self.server}/tokenize", json={"prompt": text, "add_special_tokens": False})
        response.raise_for_status()
        return response.json()["tokens"]

    def decode(self, tokens: list[int]) -> str:
        return requests.post(f"{self.server}/detokenize", json={"tokens": tokens}).json()["prompt"]


def encode_pair(tokenizer: RemoteTokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm_eval.api.model.TemplateLM._encode_pair: a context's trailing spaces move into the continuation."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces > 0:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole = tokenizer.encode(context + continuation)
    context_ids = tokenizer.encode(context)
    return context_ids, whole[len(context_ids) :]


def loglikelihood_payload(model: str, prompt) -> dict:
    """LocalCompletionsAPI._create_payload(generate=False), field for field."""
    return {"model": model, "prompt": prompt, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": SEED, "echo": True}


def parse_logprobs(outputs: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    """LocalCompletionsAPI.parse_logprobs."""
    results = []
    for choice, ctxlen in zip(sorted(outputs["choices"], key=itemgetter("index")), ctxlens):
        token_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        is_greedy = all(token == max(top.values()) for token, top in zip(token_logprobs, top_logprobs))
        results.append((sum(token_logprobs), is_greedy))
    return results


def post(url: str, payload: dict) -> dict:
    response = requests.post(url, json=payload, headers=HEADERS, timeout=300)
    response.raise_for_status()  # the harness retries any error; a 4xx here is a failure
    return response.json()


@pytest.fixture(scope="module")
def tokenizer(live_server) -> RemoteTokenizer:
    return RemoteTokenizer(live_server)


@pytest.fixture(scope="module")
def model(live_server) -> str:
    return requests.get(f"{live_server}/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="module")
def pairs(tokenizer) -> list[tuple[list[int], list[int]]]:
    return [encode_pair(tokenizer, context, continuation) for context, continuation in EXAMPLES]


@pytest.fixture(scope="module")
def engine_scores(default_engine, pairs) -> list[tuple[float, bool]]:
    """The engine's own answer: prompt logprobs of context + continuation, summed over the continuation."""
    params = SamplingParams(max_tokens=0, prompt_logprobs=1)
    completions = default_engine.generate([context + continuation for context, continuation in pairs], params)
    scores = []
    for (context, _), completion in zip(pairs, completions):
        entries = completion.prompt_logprobs[len(context) :]
        greedy = all(entry.logprob >= entry.top[0][1] for entry in entries)
        scores.append((sum(entry.logprob for entry in entries), greedy))
    return scores


def assert_scores_match(scores: list[tuple[float, bool]], expected: list[tuple[float, bool]]) -> None:
    for (logprob, is_greedy), (expected_logprob, expected_greedy) in zip(scores, expected, strict=True):
        assert logprob == pytest.approx(expected_logprob, abs=1e-3)
        assert is_greedy == expected_greedy


def test_the_remote_tokenizer_probe_succeeds(live_server, tokenizer, default_tokenizer):
    """check_remote_tokenizer_support, then the ids the harness derives from the server's answers."""
    assert "eos_token" in tokenizer.info
    probe = requests.post(f"{live_server}/tokenize", json={"prompt": "test", "add_special_tokens": False}, headers=HEADERS)
    assert isinstance(probe.json()["tokens"], list)
    assert tokenizer.encode(tokenizer.info["eos_token"])[0] == default_tokenizer.eos_token_id  # eot_token_id
    assert tokenizer.encode(tokenizer.info["bos_token"])[0] == default_tokenizer.bos_token_id  # prefix_token_id
    ids = tokenizer.encode("Hello there, world")
    assert tokenizer.decode(ids) == "Hello there, world"


def test_loglikelihood_with_token_ids_one_request_per_example(live_server, model, pairs, engine_scores):
    """tokenized_requests=True (the default), batch_size=1: `prompt` is a list holding one list of token ids."""
    scores = []
    for context, continuation in pairs:
        outputs = post(f"{live_server}/v1/completions", loglikelihood_payload(model, [context + continuation]))
        scores += parse_logprobs(outputs, [len(context)])
    assert_scores_match(scores, engine_scores)
    (paris, paris_greedy), (london, london_greedy) = scores[:2]
    assert london < paris and paris_greedy and not london_greedy


def test_loglikelihood_with_token_ids_batched(live_server, model, pairs, engine_scores):
    """batch_size=4: one request, `prompt` a list of token-id lists; choices are matched by index."""
    outputs = post(f"{live_server}/v1/completions", loglikelihood_payload(model, [c + x for c, x in pairs]))
    assert sorted(choice["index"] for choice in outputs["choices"]) == [0, 1, 2, 3]
    assert_scores_match(parse_logprobs(outputs, [len(context) for context, _ in pairs]), engine_scores)


def test_loglikelihood_with_text_prompts(live_server, model, tokenizer, pairs, engine_scores):
    """tokenized_requests=False: the ids are decoded back to text ("assuming decoding is lossless"); a single
    prompt is sent as a string, a batch as a list of strings. The server's tokenization must match the client's."""
    texts = [tokenizer.decode(context + continuation) for context, continuation in pairs]
    ctxlens = [len(context) for context, _ in pairs]
    single = [parse_logprobs(post(f"{live_server}/v1/completions", loglikelihood_payload(model, text)), [ctxlen])[0]
              for text, ctxlen in zip(texts, ctxlens)]
    assert_scores_match(single, engine_scores)
    batched = parse_logprobs(post(f"{live_server}/v1/completions", loglikelihood_payload(model, texts)), ctxlens)
    assert_scores_match(batched, engine_scores)


def test_older_harness_and_gguf_model_requests(live_server, model, engine_scores):
    """Older harness versions sent max_tokens 0 with logprobs 10; the `gguf` model sends text with logprobs 10 and
    finds the continuation through text_offset (gguf.py get_result)."""
    for (context, continuation), (expected, expected_greedy) in zip(EXAMPLES, engine_scores):
        payload = {"prompt": context + continuation, "logprobs": 10, "temperature": 0.0, "max_tokens": 1, "echo": True}
        logprobs = post(f"{live_server}/v1/completions", payload)["choices"][0]["logprobs"]
        index = 0
        while logprobs["text_offset"][index] < len(context):
            index += 1
        assert sum(logprobs["token_logprobs"][index:-1]) == pytest.approx(expected, abs=1e-3)
        is_greedy = all(
            max(top, key=top.get) == token for token, top in zip(logprobs["tokens"][index:], logprobs["top_logprobs"][index:])
        )
        assert is_greedy == expected_greedy
        assert all(len(top) >= 10 for top in logprobs["top_logprobs"][1:])

        old = {**payload, "max_tokens": 0}
        logprobs = post(f"{live_server}/v1/completions", old)["choices"][0]["logprobs"]
        assert "".join(logprobs["tokens"]) == context + continuation  # the prompt only, every token of it
        assert logprobs["token_logprobs"][0] is None and None not in logprobs["token_logprobs"][1:]


def test_generate_until(live_server, model, tokenizer):
    """generate_until: `stop` is the task's `until` plus the EOS string, not capped at 4; with tokenized requests
    the prompt is a list of token-id lists, otherwise the text itself."""
    until = ["\n\n", "Question:", "</s>", "<|endoftext|>", "###"]
    context = "The capital of France is"
    texts = []
    for prompt in (context, [tokenizer.encode(context)]):
        payload = {
            "prompt": prompt, "model": model, "max_tokens": 24, "temperature": 0,
            "stop": [*until, tokenizer.info["eos_token"]], "seed": SEED,
        }
        outputs = post(f"{live_server}/v1/completions", payload)
        texts.append([choice["text"] for choice in sorted(outputs["choices"], key=itemgetter("index"))])
    assert texts == [[" Paris."], [" Paris."]]  # it would go on with "\n\nThe ..." without the stop strings


def test_local_chat_completions(live_server, model, tokenizer):
    """local-chat-completions: the messages carry an extra "type": "text" (the harness's JsonChatStr), stop is cut
    to 4 strings; the answer is read from choices[].message.content."""
    messages = [{"role": "user", "content": "What is the capital of France?", "type": "text"}]
    stop = ["\n\n", "Question:", tokenizer.info["eos_token"]][:4]
    payload = {"messages": messages, "model": model, "max_tokens": 24, "temperature": 0, "stop": stop, "seed": SEED}
    outputs = post(f"{live_server}/v1/chat/completions", payload)
    assert [choice["message"]["content"] for choice in outputs["choices"]] == ["The capital of France is Paris."]
