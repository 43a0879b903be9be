"""build_ui without a model: it builds before the engine loads, and no event serialises users behind a lock."""
from __future__ import annotations

import gradio as gr

from engine import EngineHandle
from ui import build_ui

GENERATING = {"generate_reply", "complete_text", "score_continuations"}


def _name(fn) -> str | None:
    fn = getattr(fn, "func", fn)  # handlers are bound to the handle with functools.partial
    return getattr(fn, "__name__", None)


def test_ui_builds_before_the_model_has_loaded():
    blocks = build_ui(EngineHandle())
    assert isinstance(blocks, gr.Blocks)
    labels = {block.label for block in blocks.blocks.values() if isinstance(block, gr.Tab)}
    assert labels == {"Chat", "Complete", "Score", "Server"}


def test_generating_events_run_concurrently_so_the_engine_can_batch_users():
    blocks = build_ui(EngineHandle())
    generating = [fn for fn in blocks.fns.values() if _name(fn.fn) in GENERATING]
    assert {_name(fn.fn) for fn in generating} == GENERATING
    assert all(fn.concurrency_limit is None and fn.queue for fn in generating)
    assert blocks._queue.default_concurrency_limit is None  # the quick events too
