"""Score tab: rank candidate continuations of a prompt by log-likelihood (the manual face of /v1/loglikelihood), under
one model or, side by side in one table, under two."""
from __future__ import annotations

import asyncio
from functools import partial

import gradio as gr

from engine import EngineError
from engine.registry import Lease, ModelRegistry
from ui.feedback import report_error
from ui.models import build_model_picker, lease_model, loading_message, needs_loading
from ui.tokens import (quote_token, rank_scores, render_scored_continuations, score_table_rows,
                       side_by_side_score_rows, surprise_views)

TABLE_HEADERS = ["Rank", "Continuation", "Log-likelihood", "Per token", "Probability", "Tokens", "Greedy"]
MAX_CONTINUATIONS = 32
EXAMPLE_PROMPT = "The capital of France is"
EXAMPLE_CONTINUATIONS = " Paris.\n London.\n a large city.\n Berlin."
NO_SECOND_MODEL = "(none)"


async def score_continuations(registry: ModelRegistry, prompt: str, continuations_text: str, model: str | None = None,
                              second_model: str | None = None):
    """Score every continuation (one per line) after the prompt, under `model` and, when one is picked, under
    `second_model` too (both at once). Yields (table, per-token HTML, notice): first "loading model X…" when a model
    must load, then the ranking. Holds a lease on each model while it scores."""
    continuations = parse_continuations(continuations_text)
    if not continuations:
        yield _table([]), "", report_error(EngineError("Enter at least one continuation, one per line."))
        return
    if len(continuations) > MAX_CONTINUATIONS:
        yield _table([]), "", report_error(EngineError(f"Score at most {MAX_CONTINUATIONS} continuations at once."))
        return
    try:
        model_ids = [registry.resolve(model)]
        if second_model and second_model != NO_SECOND_MODEL and registry.resolve(second_model) != model_ids[0]:
            model_ids.append(registry.resolve(second_model))  # the same model twice is one ranking
        loading = [model_id for model_id in model_ids if needs_loading(registry, model_id)]
        if loading:
            yield _table([]), "", " ".join(loading_message(model_id) for model_id in loading)
        scored = await asyncio.gather(*(_score_under(registry, model_id, prompt, continuations)
                                        for model_id in model_ids))
    except EngineError as exc:
        yield _table([]), "", report_error(exc)
        return
    yield _ranking(model_ids, continuations, scored)


def parse_continuations(text: str | None) -> list[str]:
    """One continuation per line, kept exactly (a leading space matters: " Paris" is one token, "Paris" another)."""
    return [line.rstrip("\r") for line in (text or "").split("\n") if line.strip()]


def build_scoring_tab(registry: ModelRegistry) -> None:
    """Lay out the Score tab and wire its event (inside a gr.Blocks context)."""
    gr.Markdown(
        "How likely is each continuation after the prompt? Ranked by total log-likelihood (the sum of the "
        "continuation tokens' logprobs; closer to 0 is more likely). *Greedy* means the model would have generated "
        "exactly this continuation. Start a continuation with a space when it follows a word."
    )
    with gr.Row():
        model = build_model_picker(registry, "score-model")
        second_model = gr.Dropdown(
            choices=[NO_SECOND_MODEL, *registry.ids], value=NO_SECOND_MODEL, label="Compare with",
            elem_id="score-second-model", visible=len(registry.ids) > 1, filterable=False,
            info="optional: rank the same continuations under a second model, in the same table",
        )
    with gr.Row(equal_height=False):
        with gr.Column(min_width=300):
            prompt = gr.Textbox(label="Prompt", value=EXAMPLE_PROMPT, lines=3, max_lines=12, elem_id="score-prompt")
        with gr.Column(min_width=300):
            continuations = gr.Textbox(
                label="Candidate continuations (one per line)", value=EXAMPLE_CONTINUATIONS, lines=4, max_lines=16,
                elem_id="score-continuations",
            )
    score = gr.Button("Score", variant="primary", elem_id="score-button")
    notice = gr.Markdown(elem_id="score-notice")
    table = gr.Dataframe(headers=TABLE_HEADERS, interactive=False, label="Ranking", elem_id="score-table", wrap=True)
    gr.Markdown("**Where the model was surprised** \u2014 hover or tap a token for its probability and the model's "
                "own top choice.")
    tokens_html = gr.HTML(elem_id="score-tokens")
    score.click(
        partial(score_continuations, registry), [prompt, continuations, model, second_model],
        [table, tokens_html, notice], concurrency_limit=None,
    )


async def _score_under(registry: ModelRegistry, model_id: str, prompt: str, continuations: list[str]):
    """(scores, token_text) of the continuations under one model, leased while it scores."""
    lease: Lease = await lease_model(registry, model_id)
    with lease:
        scores = await lease.engine.score(prompt, continuations)
        return scores, lease.engine.tokenizer.token_text


def _ranking(model_ids: list[str], continuations: list[str], scored: list) -> tuple:
    """(table, per-token HTML, notice) for one model's ranking, or two models' side by side (ranked by the first)."""
    rankings = [rank_scores(continuations, scores) for scores, _ in scored]
    sections = []
    for model_id, ranked, (_, token_text) in zip(model_ids, rankings, scored):
        views = [(text, surprise_views(score, token_text)) for text, score in ranked]
        title = f'<div class="tern-score-model">Under <b>{model_id}</b></div>' if len(model_ids) > 1 else ""
        sections.append(title + render_scored_continuations(views))
    if len(model_ids) == 1:
        rows = score_table_rows(rankings[0])
        table = _table(rows)
        notice = f"Most likely: **{rows[0][1]}**" if len(rows) > 1 else ""
    else:
        headers, rows = side_by_side_score_rows(model_ids, rankings)
        table = _table(rows, headers)
        firsts = [ranked[0][0] for ranked in rankings]
        notice = " \u00b7 ".join(f"`{model_id}` finds **{quote_token(first)}** most likely"
                                 for model_id, first in zip(model_ids, firsts))
    return table, "".join(sections), notice


def _table(rows: list[list], headers: list[str] = TABLE_HEADERS) -> dict:
    """The ranking table's value with its headers: two models' tables have columns per model."""
    return {"headers": headers, "data": rows}
