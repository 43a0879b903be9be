"""Sampling controls shared by the Chat and Complete tabs, and the one mapping from their values to SamplingParams."""
from __future__ import annotations

from dataclasses import dataclass

import gradio as gr

from engine import InvalidRequestError, SamplingParams
from engine.text.grammar import Grammar

MAX_TOKENS_LIMIT = 4096  # the slider's top; the engine still refuses prompt + max tokens beyond the context
NUM_TOP_ALTERNATIVES = 5  # alternatives shown per token in the probability views


@dataclass
class SamplingControls:
    temperature: gr.Slider
    top_p: gr.Slider
    top_k: gr.Slider
    max_tokens: gr.Slider
    seed: gr.Textbox
    stop: gr.Textbox

    @property
    def inputs(self) -> list[gr.components.Component]:
        """In the order sampling_params() takes them."""
        return [self.temperature, self.top_p, self.top_k, self.max_tokens, self.seed, self.stop]


def build_sampling_controls(
    elem_prefix: str, default_max_tokens: int, default_temperature: float = 0.2, default_top_p: float = 0.9
) -> SamplingControls:
    """A collapsed "Sampling settings" panel. The defaults suit small chat models (SmolLM2 suggests 0.2 / 0.9)."""
    def elem_id(name: str) -> str:
        return f"{elem_prefix}-{name}"

    with gr.Accordion("Sampling settings", open=False, elem_id=elem_id("sampling")):
        with gr.Row():
            temperature = gr.Slider(
                0.0, 2.0, value=default_temperature, step=0.05, label="Temperature", elem_id=elem_id("temperature"),
                info="0 = always the most likely token (greedy)", min_width=200,
            )
            top_p = gr.Slider(
                0.05, 1.0, value=default_top_p, step=0.05, label="Top-p", elem_id=elem_id("top-p"),
                info="nucleus sampling; 1 = off", min_width=200,
            )
            top_k = gr.Slider(0, 200, value=0, step=1, label="Top-k", elem_id=elem_id("top-k"), info="0 = off",
                              min_width=200)
        with gr.Row():
            max_tokens = gr.Slider(
                1, MAX_TOKENS_LIMIT, value=default_max_tokens, step=1, label="Max new tokens",
                elem_id=elem_id("max-tokens"), min_width=200,
            )
            seed = gr.Textbox(
                label="Seed", placeholder="random", elem_id=elem_id("seed"), min_width=200, max_lines=1,
                info="a whole number reproduces a reply; blank = random",
            )
            stop = gr.Textbox(
                label="Stop sequences", elem_id=elem_id("stop"), placeholder="one per line, e.g. \\n\\n", lines=2,
                max_lines=6, info="generation ends before any of these; write \\n for a newline", min_width=200,
            )
    return SamplingControls(temperature, top_p, top_k, max_tokens, seed, stop)


def sampling_params(
    temperature: float,
    top_p: float,
    top_k: int,
    max_tokens: int,
    seed: str | int | None,
    stop: str,
    logprobs: int | None = NUM_TOP_ALTERNATIVES,
    grammar: Grammar | None = None,
) -> SamplingParams:
    """Control values -> SamplingParams; raises InvalidRequestError for values the engine refuses. `grammar` holds
    the reply to a JSON schema (the Chat tab compiles it: ui/schema.py)."""
    return SamplingParams(
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=int(top_k or 0),
        max_tokens=int(max_tokens),
        seed=parse_seed(seed),
        stop=parse_stop_sequences(stop),
        logprobs=logprobs,
        grammar=grammar,
    )


def parse_seed(seed: str | int | None) -> int | None:
    """Blank means a random seed; anything else must be a whole number."""
    if seed is None or isinstance(seed, int):
        return seed
    try:
        return int(seed.strip()) if seed.strip() else None
    except ValueError:
        raise InvalidRequestError(f"the seed must be a whole number, not {seed.strip()!r}", "seed") from None


def parse_stop_sequences(text: str | None) -> tuple[str, ...]:
    """One stop sequence per line; a typed \\n or \\t stands for a newline or a tab; blank lines are ignored."""
    sequences = []
    for line in (text or "").splitlines():
        line = line.rstrip("\r")
        if line.strip():
            sequences.append(line.replace("\\n", "\n").replace("\\t", "\t"))
    return tuple(sequences)
