"""Score tab: rank candidate continuations of a prompt by log-likelihood (the manual face of /v1/loglikelihood)."""
from __future__ import annotations

from functools import partial

import gradio as gr

from engine import EngineError, EngineHandle
from ui.feedback import not_ready_message, ready_engine, report_error
from ui.tokens import rank_scores, render_scored_continuations, score_table_rows, surprise_views

TABLE_HEADERS = ["Rank", "Continuation", "Log-likelihood", "Per token", "Probability", "Tokens", "Greedy"]
MAX_CONTINUATIONS = 32
EXAMPLE_PROMPT = "The capital of France is"
EXAMPLE_CONTINUATIONS = " Paris.\n London.\n a large city.\n Berlin."


async def score_continuations(handle: EngineHandle, prompt: str, continuations_text: str) -> tuple:
    """Score every continuation (one per line) after the prompt. -> (table rows, per-token HTML, notice)."""
    engine = ready_engine(handle)
    if engine is None:
        return [], "", f"\u26a0\ufe0f {not_ready_message(handle)}"
    continuations = parse_continuations(continuations_text)
    if not continuations:
        return [], "", report_error(EngineError("Enter at least one continuation, one per line."))
    if len(continuations) > MAX_CONTINUATIONS:
        return [], "", report_error(EngineError(f"Score at most {MAX_CONTINUATIONS} continuations at once."))
    try:
        scores = await engine.score(prompt, continuations)
    except EngineError as exc:
        return [], "", report_error(exc)
    ranked = rank_scores(continuations, scores)
    views = [(text, surprise_views(score, engine.tokenizer.token_text)) for text, score in ranked]
    rows = score_table_rows(ranked)
    notice = f"Most likely: **{rows[0][1]}**" if len(rows) > 1 else ""
    return rows, render_scored_continuations(views), notice


def parse_continuations(text: str | None) -> list[str]:
    """One continuation per line, kept exactly (a leading space matters: " Paris" is one token, "Paris" another)."""
    return [line.rstrip("\r") for line in (text or "").split("\n") if line.strip()]


def build_scoring_tab(handle: EngineHandle) -> None:
    """Lay out the Score tab and wire its event (inside a gr.Blocks context)."""
    gr.Markdown(
        "How likely is each continuation after the prompt? Ranked by total log-likelihood (the sum of the "
        "continuation tokens' logprobs; closer to 0 is more likely). *Greedy* means the model would have generated "
        "exactly this continuation. Start a continuation with a space when it follows a word."
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
    table = gr.Dataframe(
        headers=TABLE_HEADERS, datatype=["number", "str", "number", "number", "str", "number", "str"],
        interactive=False,
        label="Ranking", elem_id="score-table", wrap=True,
    )
    gr.Markdown("**Where the model was surprised** \u2014 hover or tap a token for its probability and the model's "
                "own top choice.")
    tokens_html = gr.HTML(elem_id="score-tokens")
    score.click(
        partial(score_continuations, handle), [prompt, continuations], [table, tokens_html, notice],
        concurrency_limit=None,
    )
