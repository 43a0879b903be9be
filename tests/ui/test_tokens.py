"""Fast tests of the UI's pure functions: logprobs -> coloured HTML with tooltips, score tables, input parsing."""
from __future__ import annotations

import math
import re

import gradio as gr
import pytest

from engine import ContinuationScore, InvalidRequestError, TokenLogprob
from ui.sampling import parse_seed, parse_stop_sequences, sampling_params
from ui.scoring import parse_continuations
from ui.server import base_url, format_bytes, format_count
from ui.tokens import (
    TokenView,
    format_probability,
    probability_colour,
    quote_token,
    rank_scores,
    render_tokens_html,
    score_table_rows,
    surprise_views,
    token_tooltip,
    token_views,
)

VOCAB = {0: "Hello", 1: ",", 2: " world", 3: "\n", 4: "<script>alert(1)</script>", 5: "<|im_end|>", 6: '"quoted"'}


def test_colour_runs_from_red_for_unlikely_to_green_for_certain():
    hue = lambda p: int(re.match(r"hsl\((\d+),", probability_colour(p)).group(1))  # noqa: E731
    assert hue(0.0) == 0 and hue(1.0) == 120
    assert hue(0.1) < hue(0.5) < hue(0.9)
    assert probability_colour(1.7) == probability_colour(1.0)  # clamped


def test_probabilities_are_readable_percentages():
    assert format_probability(0.0) == "100.0%"
    assert format_probability(math.log(0.25)) == "25.0%"
    assert format_probability(-20.0) == "<0.1%"


def test_token_views_map_ids_to_text_and_skip_hidden_ids():
    logprobs = [TokenLogprob(0, -0.1, [(0, -0.1), (2, -2.5)]), TokenLogprob(5, -0.01, [(5, -0.01)])]
    views = token_views(logprobs, VOCAB.get, hidden_ids=frozenset({5}))
    assert views == [TokenView("Hello", -0.1, (("Hello", -0.1), (" world", -2.5)))]


def test_each_token_is_a_coloured_span_whose_tooltip_lists_the_alternatives():
    token = TokenView(" world", math.log(0.6), ((" world", math.log(0.6)), (" there", math.log(0.3))))
    html = render_tokens_html([token], legend=False)
    assert html.count('class="tern-token"') == 1
    assert f"background-color: {probability_colour(0.6)}" in html
    title = re.search(r'title="([^"]*)"', html).group(1)
    assert "60.0%" in title and "Top alternatives" in title and "\u201c there\u201d  30.0%" in title
    assert "&#10;" in title  # one alternative per line


def test_chosen_token_is_marked_among_its_alternatives():
    tooltip = token_tooltip(TokenView("a", -0.5, (("b", -0.2), ("a", -0.5))))
    lines = tooltip.splitlines()
    assert lines[2].startswith("\u2003") and lines[3].startswith("\u25b8")


def test_model_and_user_text_is_escaped():
    nasty = TokenView(VOCAB[4], -1.0, ((VOCAB[6], -1.0),))
    html = render_tokens_html([nasty])
    assert "<script>" not in html
    assert "&lt;script&gt;" in html
    assert '"quoted"' not in html  # a quote inside the title attribute would end it


def test_newlines_become_breaks_so_markdown_keeps_the_block_whole():
    html = render_tokens_html([TokenView("a\n\nb", -0.1), TokenView("\n", -0.2)])
    assert "\n" not in html
    assert html.count("<br>") == 3


def test_empty_token_text_stays_visible():
    assert "\u2205" in render_tokens_html([TokenView("", -0.1)], legend=False)


def test_quote_token_shows_whitespace():
    assert quote_token(" Paris") == "\u201c Paris\u201d"
    assert quote_token("a\nb\t") == "\u201ca\\nb\\t\u201d"


def _score(logprobs: list[float], greedy: bool, top_ids: list[int] | None = None) -> ContinuationScore:
    ids = list(range(len(logprobs)))
    return ContinuationScore(sum(logprobs), greedy, ids, logprobs, top_ids if top_ids is not None else ids)


def test_scores_rank_most_likely_first_with_per_token_average_and_greedy():
    ranked = rank_scores([" banana", " Paris"], [_score([-6.0, -4.0], False), _score([-0.5], True)])
    rows = score_table_rows(ranked)
    assert [row[1] for row in rows] == ["\u201c Paris\u201d", "\u201c banana\u201d"]
    assert rows[0][:4] == [1, "\u201c Paris\u201d", -0.5, -0.5] and rows[0][-1] == "yes"
    assert rows[1][:4] == [2, "\u201c banana\u201d", -10.0, -5.0] and rows[1][-2:] == [2, "no"]


def test_surprise_view_names_the_models_own_choice_where_it_differs():
    views = surprise_views(_score([-0.1, -5.0], False, top_ids=[0, 2]), VOCAB.get)
    assert views[0].note == ""
    assert views[1].note == "The model expected \u201c world\u201d here."
    assert "The model expected" in render_tokens_html(views)


def test_stop_sequences_one_per_line_with_escaped_newlines():
    assert parse_stop_sequences("User:\n\\n\\n\n\n  \n") == ("User:", "\n\n")
    assert parse_stop_sequences(None) == ()


def test_seed_blank_is_random_and_junk_is_a_readable_error():
    assert parse_seed("") is None and parse_seed("  ") is None and parse_seed(None) is None
    assert parse_seed(" 42 ") == 42
    with pytest.raises(InvalidRequestError, match="whole number"):
        parse_seed("forty")


def test_sampling_controls_map_to_engine_params():
    params = sampling_params(0.0, 0.9, 40, 32, "7", "END")
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens, params.seed, params.stop) == (
        0.0, 0.9, 40, 32, 7, ("END",)
    )
    assert params.logprobs == 5  # always recorded, so the probability view can be turned on afterwards


def test_continuations_keep_their_leading_space():
    assert parse_continuations(" Paris\r\n\n London\n   \n") == [" Paris", " London"]


def test_base_url_follows_the_browsers_host_and_proxy_headers():
    assert base_url(gr.Request(headers={"host": "127.0.0.1:8000"})) == "http://127.0.0.1:8000/v1"
    forwarded = {"host": "internal:7860", "x-forwarded-proto": "https", "x-forwarded-host": "x.hf.space"}
    proxied = gr.Request(headers=forwarded)
    assert base_url(proxied) == "https://x.hf.space/v1"


def test_sizes_are_human_readable():
    assert format_count(134_515_008) == "134.5M" and format_count(999) == "999"
    assert format_bytes(3 << 29) == "1.5 GiB" and format_bytes(512) == "512 B"
