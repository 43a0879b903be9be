"""Pure functions: token logprobs -> highlighted HTML (colour by probability, alternatives on hover) and table rows."""
from __future__ import annotations

import html
import math
from dataclasses import dataclass
from typing import Callable, Sequence

from engine import ContinuationScore, TokenLogprob

TokenText = Callable[[int], str]  # token id -> its text, e.g. engine.tokenizer.token_text


@dataclass(frozen=True)
class TokenView:
    """One token as the UI shows it: its text, its logprob, the model's top alternatives and an optional note."""

    text: str
    logprob: float
    alternatives: tuple[tuple[str, float], ...] = ()
    note: str = ""

    @property
    def probability(self) -> float:
        return math.exp(self.logprob)


def token_views(
    logprobs: Sequence[TokenLogprob], token_text: TokenText, hidden_ids: frozenset[int] = frozenset()
) -> list[TokenView]:
    """Engine logprobs (ids) -> TokenViews (text) for display, leaving out `hidden_ids` (EOS: it adds no text)."""
    return [
        TokenView(token_text(entry.token_id), entry.logprob, tuple((token_text(t), lp) for t, lp in entry.top))
        for entry in logprobs
        if entry.token_id not in hidden_ids
    ]


def probability_colour(probability: float) -> str:
    """A light background from red (unlikely) through amber to green (certain); dark text stays readable on it."""
    clamped = min(max(probability, 0.0), 1.0)
    return f"hsl({round(120 * clamped)}, 85%, 82%)"


def format_probability(logprob: float) -> str:
    percent = 100 * math.exp(logprob)
    return f"{percent:.1f}%" if percent >= 0.1 else "<0.1%"


def quote_token(text: str) -> str:
    """A token in quotes with whitespace made visible, so ' Paris' and 'Paris' look different."""
    visible = text.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r")
    return f"\u201c{visible}\u201d"


def token_tooltip(token: TokenView) -> str:
    """Plain text for the hover tooltip: the token's probability, then the model's top alternatives."""
    lines = [f"{quote_token(token.text)}  {format_probability(token.logprob)}  (logprob {token.logprob:.3f})"]
    if token.alternatives:
        lines.append("Top alternatives:")
        for text, logprob in token.alternatives:
            marker = "\u25b8" if text == token.text else "\u2003"
            lines.append(f"{marker} {quote_token(text)}  {format_probability(logprob)}")
    if token.note:
        lines.append(token.note)
    return "\n".join(lines)


def render_tokens_html(tokens: Sequence[TokenView], legend: bool = True) -> str:
    """Tokens as coloured spans (a tooltip each), newlines as <br>, with no raw newline, so that Markdown renderers
    (the chatbot) keep the whole block as HTML."""
    spans = "".join(_render_token(token) for token in tokens)
    body = f'<div class="tern-tokens" style="white-space: pre-wrap; line-height: 1.9">{spans}</div>'
    return body + (LEGEND_HTML if legend else "")


def rank_scores(
    continuations: Sequence[str], scores: Sequence[ContinuationScore]
) -> list[tuple[str, ContinuationScore]]:
    """Continuations paired with their scores, most likely first (ties keep the input order)."""
    return sorted(zip(continuations, scores), key=lambda pair: -pair[1].logprob)


def score_table_rows(ranked: Sequence[tuple[str, ContinuationScore]]) -> list[list]:
    """Rows for the ranking table: rank, continuation, total and per-token log-likelihood, probability, number of
    tokens, greedy."""
    return [
        [rank, quote_token(text), round(score.logprob, 4), round(score.mean_logprob, 4),
         format_probability(score.logprob), len(score.token_ids), "yes" if score.is_greedy else "no"]
        for rank, (text, score) in enumerate(ranked, start=1)
    ]


def side_by_side_score_rows(
    model_ids: Sequence[str], rankings: Sequence[Sequence[tuple[str, ContinuationScore]]]
) -> tuple[list[str], list[list]]:
    """(headers, rows) ranking the same continuations under several models in one table: in the first model's order,
    each model's rank, total and per-token log-likelihood and whether it is greedy, side by side."""
    columns = ("Rank", "Log-likelihood", "Per token", "Greedy")
    headers = ["Continuation"] + [f"{column} ({model_id})" for model_id in model_ids for column in columns]
    by_model = [{text: (rank, score) for rank, (text, score) in enumerate(ranked, start=1)} for ranked in rankings]
    rows = []
    for text, _ in rankings[0]:
        row = [quote_token(text)]
        for ranks in by_model:
            rank, score = ranks[text]
            row += [rank, round(score.logprob, 4), round(score.mean_logprob, 4), "yes" if score.is_greedy else "no"]
        rows.append(row)
    return headers, rows


def total_logprob(tokens: Sequence[TokenView]) -> float:
    """The log-probability of the shown text: the sum of its tokens' logprobs."""
    return math.fsum(token.logprob for token in tokens)


def surprise_views(score: ContinuationScore, token_text: TokenText) -> list[TokenView]:
    """A scored continuation's tokens, each noting the model's own top choice where it differs (a surprise)."""
    views = []
    for token_id, logprob, top_id in zip(score.token_ids, score.token_logprobs, score.top_token_ids):
        note = "" if top_id == token_id else f"The model expected {quote_token(token_text(top_id))} here."
        views.append(TokenView(token_text(token_id), logprob, note=note))
    return views


def render_scored_continuations(ranked_views: Sequence[tuple[str, Sequence[TokenView]]]) -> str:
    """One labelled line of coloured tokens per continuation, in ranking order."""
    rows = "".join(
        f'<div class="tern-score-row"><span class="tern-score-rank">#{rank}</span>'
        f"{render_tokens_html(views, legend=False)}</div>"
        for rank, (_, views) in enumerate(ranked_views, start=1)
    )
    return f'<div class="tern-scores">{rows}</div>{LEGEND_HTML}'


LEGEND_HTML = (
    '<div class="tern-legend">Token probability: '
    + "".join(
        f'<span class="tern-legend-swatch" style="background-color: {probability_colour(p)}; color: #1f2937">'
        f"{label}</span>"
        for p, label in ((0.02, "&lt;5%"), (0.25, "25%"), (0.5, "50%"), (0.75, "75%"), (0.98, "&gt;95%"))
    )
    + " &middot; hover or tap a token for the alternatives</div>"
)


def _render_token(token: TokenView) -> str:
    text = token.text
    if not text:
        shown = '<span style="opacity: 0.6">\u2205</span>'  # a token with no text (a special token)
    else:
        shown = html.escape(text).replace("\r\n", "\n").replace("\n", "\u21b5<br>")
    style = f"background-color: {probability_colour(token.probability)}; color: #1f2937"
    title = html.escape(token_tooltip(token), quote=True).replace("\n", "&#10;")
    return f'<span class="tern-token" tabindex="0" style="{style}" title="{title}">{shown}</span>'
