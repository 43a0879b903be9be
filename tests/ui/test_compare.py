"""Several models in the UI, handlers called directly on real registries of tiny random engines: Compare streams two
models side by side and at once, each answer with its logprob total; Score ranks under two models in one table; an
unloaded model loads on first use (and says so); Chat answers as the picked model; the Server tab shows every model's
state without loading any; every action releases its leases, also when stopped."""
from __future__ import annotations

import asyncio
import re
import time

import pytest

from engine import SamplingParams
from ui.chat import ChatSession, build_messages, generate_reply
from ui.compare import CHAT, COMPLETION, compare_models
from ui.complete import complete_text
from ui.scoring import score_continuations
from ui.server import refresh_server_tab

SHOWN_LOGPROB = re.compile(r"\(logprob (-?\d+\.\d+)\)")  # each token's hover text
TOTAL = re.compile(r"(\d+) tokens \u00b7 total logprob \*\*(-?\d+\.\d+)\*\*")
SEED = re.compile(r"seed (\d+)")
GREEDY = dict(temperature=0.0, top_p=1.0, top_k=0, max_tokens=12, seed="", stop="")


def collect(agen) -> list:
    async def run():
        return [out async for out in agen]

    return asyncio.run(run())


def compare(registry, model_a: str, model_b: str, prompt: str = "The three primary colours are", mode=COMPLETION,
            **overrides) -> list[tuple[str, str, str, str]]:
    """Every update of one comparison: (tokens HTML A, status A, tokens HTML B, status B)."""
    controls = {**GREEDY, **overrides}
    return collect(compare_models(registry, model_a, model_b, mode, prompt, "", *controls.values()))


def num_tokens(tokens_html: str) -> int:
    return tokens_html.count('class="tern-token"')


SHOWN_NUMBER = re.compile(r"(-?\d+\.(\d+))")


def alike(html_x: str, html_y: str) -> bool:
    """The same tokens with the same alternatives and numbers, each shown number within one step of its last digit.
    Logprobs move by ~1e-6 with what else shares the batch (the float sums run in another order), which a 3-digit
    display shows as one step now and then (-10.5275 rounds either way)."""
    parts_x, parts_y = SHOWN_NUMBER.split(html_x), SHOWN_NUMBER.split(html_y)
    if len(parts_x) != len(parts_y):
        return False
    # split() gives [text, number, decimals, text, number, decimals, ...]
    texts_alike = parts_x[::3] == parts_y[::3]
    numbers_alike = all(abs(float(x) - float(y)) <= 1.01 * 10.0 ** -min(len(dx), len(dy))
                        for x, dx, y, dy in zip(parts_x[1::3], parts_x[2::3], parts_y[1::3], parts_y[2::3]))
    return texts_alike and numbers_alike


def assert_released(registry) -> None:
    """No lease is held and no request runs, within a bounded wait (a cancelled request ends at the next step)."""
    deadline = time.monotonic() + 30
    while True:
        busy = [s.id for s in registry.statuses() if s.num_leases or (registry.handle(s.id).engine is not None
                                                                      and registry.handle(s.id).engine.has_requests)]
        if not busy:
            return
        assert time.monotonic() < deadline, f"still leased or running: {busy}"
        time.sleep(0.02)


def test_compare_streams_both_models_at_once_each_with_its_total(tiny_registry):
    registry = tiny_registry({"a": 0, "b": 1})
    engines = [registry.handle("a").engine, registry.handle("b").engine]

    async def watch():
        """Every update, with whether each model's engine was generating when it came."""
        updates = compare_models(registry, "a", "b", COMPLETION, "The three primary colours are", "",
                                 *{**GREEDY, "max_tokens": 64}.values())
        return [(update, [engine.has_requests for engine in engines]) async for update in updates]

    watched = asyncio.run(watch())
    html_a, status_a, html_b, status_b = watched[-1][0]
    # Both answers in full, and different: two models, not one twice.
    assert num_tokens(html_a) == num_tokens(html_b) == 64 and html_a != html_b
    assert status_a.startswith("**a**") and status_b.startswith("**b**")
    # Streamed, and at once rather than one after the other: both engines generate while the first tokens show.
    assert len(watched) > 3 and num_tokens(watched[0][0][0]) + num_tokens(watched[0][0][2]) < 128
    assert any(all(generating) for _, generating in watched)
    # Each total is the sum of the logprobs its tokens show on hover.
    for tokens_html, status in ((html_a, status_a), (html_b, status_b)):
        count, total = TOTAL.search(status).groups()
        shown = [float(value) for value in SHOWN_LOGPROB.findall(tokens_html)]
        assert int(count) == len(shown) == 64
        assert float(total) == pytest.approx(sum(shown), abs=0.0005 * (len(shown) + 1)) and float(total) < 0
    assert_released(registry)


def test_both_sides_get_the_same_seed_so_one_model_twice_answers_alike(tiny_registry):
    registry = tiny_registry({"a": 0, "b": 1})
    html_a, status_a, html_b, status_b = compare(registry, "a", "a", temperature=1.0, max_tokens=16)[-1]
    assert num_tokens(html_a) == 16 and alike(html_a, html_b)  # sampled, yet alike: one seed for both
    seed = SEED.search(status_a).group(1)
    assert SEED.search(status_b).group(1) == seed
    # The seed shown brings the same answers back.
    again = compare(registry, "a", "b", temperature=1.0, max_tokens=16, seed=seed)[-1]
    assert alike(again[0], html_a) and not alike(again[2], html_b)


def test_chat_mode_answers_in_each_models_template(tiny_registry):
    registry = tiny_registry({"a": 0, "b": 1})
    html_a, status_a, html_b, status_b = compare(registry, "a", "b", "What is the capital of France?", mode=CHAT,
                                                 max_tokens=6)[-1]
    assert num_tokens(html_a) == num_tokens(html_b) == 6 and "6 tokens" in status_a and "6 tokens" in status_b


def test_an_unloaded_model_loads_on_first_use_and_says_so(tiny_registry):
    registry = tiny_registry({"a": 0, "b": 1}, preload=False)
    assert [s.state for s in registry.statuses()] == ["unloaded", "unloaded"]
    updates = compare(registry, "a", "b", max_tokens=4)
    assert "Loading model `a`" in updates[0][1] and "Loading model `b`" in updates[0][3]
    assert num_tokens(updates[-1][0]) == num_tokens(updates[-1][2]) == 4
    assert [s.state for s in registry.statuses()] == ["loaded", "loaded"]
    # The same on the other tabs: Complete on a model that is not loaded yet.
    registry = tiny_registry({"c": 2}, preload=False)
    outputs = collect(complete_text(registry, "Hello", False, *GREEDY.values(), model="c"))
    assert "Loading model `c`" in outputs[0][2] and "12 generated" in outputs[-1][2]
    assert_released(registry)


def test_stop_mid_stream_aborts_both_requests_and_releases_both_leases(tiny_registry):
    registry = tiny_registry({"a": 0, "b": 1})

    async def stop_once_both_stream():
        seen = []

        async def drive():
            async for update in compare_models(registry, "a", "b", COMPLETION, "Once upon a time", "",
                                               *{**GREEDY, "max_tokens": 400}.values()):
                seen.append(update)

        task = asyncio.create_task(drive())
        while not (seen and num_tokens(seen[-1][0]) and num_tokens(seen[-1][2])):
            assert not task.done(), seen[-1] if seen else "no update"
            await asyncio.sleep(0.01)
        assert [s.num_leases for s in registry.statuses()] == [1, 1]  # held while they stream
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return seen

    seen = asyncio.run(stop_once_both_stream())
    assert_released(registry)
    assert num_tokens(seen[-1][0]) < 400


def test_compare_under_max_loaded_one_is_a_message_not_a_hang(tiny_registry):
    registry = tiny_registry({"a": 0, "b": 1}, max_loaded=1, preload=False)
    with pytest.warns(UserWarning, match="--max-loaded"):
        (_, status_a, _, status_b), = compare(registry, "a", "b")
    assert "at most 1 loaded" in status_a and status_a == status_b
    assert [s.num_leases for s in registry.statuses()] == [0, 0]


def test_score_ranks_the_same_continuations_under_two_models_in_one_table(tiny_registry):
    registry = tiny_registry({"a": 0, "b": 1})
    prompt, continuations = "The capital of France is", " Paris\n London\n a banana"

    def score(second_model=None):
        return collect(score_continuations(registry, prompt, continuations, "a", second_model))[-1]

    table, tokens_html, notice = score("b")
    assert table["headers"] == ["Continuation", "Rank (a)", "Log-likelihood (a)", "Per token (a)", "Greedy (a)",
                                "Rank (b)", "Log-likelihood (b)", "Per token (b)", "Greedy (b)"]
    rows = table["data"]
    assert [row[1] for row in rows] == [1, 2, 3]  # in model a's order
    assert sorted(row[5] for row in rows) == [1, 2, 3]
    # Each model's columns are what that model alone gives.
    alone_a = {row[1]: row[2] for row in score()[0]["data"]}
    table_b = collect(score_continuations(registry, prompt, continuations, "b"))[-1][0]
    alone_b = {row[1]: row[2] for row in table_b["data"]}
    assert {row[0]: row[2] for row in rows} == alone_a and {row[0]: row[6] for row in rows} == alone_b
    assert alone_a != alone_b  # two models, two rankings
    assert "Under <b>a</b>" in tokens_html and "Under <b>b</b>" in tokens_html and "`b` finds" in notice
    assert_released(registry)


def test_chat_answers_as_the_picked_model(tiny_registry):
    registry = tiny_registry({"a": 0, "b": 1})
    history = [{"role": "user", "content": "Hello", "tokens": None}]
    controls = dict(system_prompt="", session=ChatSession(), temperature=0.0, top_p=1.0, top_k=0, max_tokens=8,
                    seed="", stop="", schema_text="")
    replies = {model: collect(generate_reply(registry, history, **controls, model=model))[-1][1][-1]["content"]
               for model in ("a", "b")}
    engine_b = registry.handle("b").engine
    prompt_ids = engine_b.tokenizer.chat_prompt_ids(build_messages(history, ""))
    expected_b = engine_b.generate([prompt_ids], SamplingParams(temperature=0.0, max_tokens=8))[0].choices[0].text
    assert replies["b"] == expected_b and replies["a"] != replies["b"]
    assert_released(registry)


def test_the_server_tab_shows_every_model_with_its_state(tiny_registry):
    registry = tiny_registry({"a": 0, "b": 1}, preload=False)
    registry.acquire("b", timeout_s=120).release()
    models, facts, stats = refresh_server_tab(registry, "a")
    assert [(row[0], row[1]) for row in models] == [("a", "not loaded (loads on its first request)"), ("b", "loaded")]
    assert dict(facts) == {"Model id": "a", "Status": "not loaded (loads on its first request)"}
    assert stats == [["Engine", "not running yet"]]  # looking does not load it
    models, facts, stats = refresh_server_tab(registry, "b")
    assert dict(facts)["Model id"] == "b" and dict(stats)["Running requests"] == "0"
    assert registry.status("a").state == "unloaded"
