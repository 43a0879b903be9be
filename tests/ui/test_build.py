"""build_ui without a model: it builds before any engine loads, one model served looks as it always did, several get
a model picker on every tab and a Compare tab, and no event serialises users behind a lock."""
from __future__ import annotations

import gradio as gr

from engine import EngineConfig
from engine.registry import ModelRegistry, ModelSpec
from ui import build_ui

GENERATING = {"generate_reply", "complete_text", "score_continuations"}
PICKERS = {"chat-model", "complete-model", "score-model", "server-model-picker"}


def served(*ids: str) -> ModelRegistry:
    """A registry that is never started: nothing loads, as at the moment a server builds its UI."""
    return ModelRegistry([ModelSpec(model_id, EngineConfig(model=model_id)) for model_id in ids])


def _name(fn) -> str | None:
    fn = getattr(fn, "func", fn)  # handlers are bound to the registry with functools.partial
    return getattr(fn, "__name__", None)


def _by_id(blocks: gr.Blocks) -> dict:
    return {block.elem_id: block for block in blocks.blocks.values() if getattr(block, "elem_id", None)}


def _tabs(blocks: gr.Blocks) -> set[str]:
    return {block.label for block in blocks.blocks.values() if isinstance(block, gr.Tab)}


def test_ui_builds_before_the_model_has_loaded_and_one_model_shows_no_picker():
    blocks = build_ui(served("only"))
    assert isinstance(blocks, gr.Blocks)
    assert _tabs(blocks) == {"Chat", "Complete", "Score", "Server"}
    blocks_by_id = _by_id(blocks)
    assert all(blocks_by_id[picker].visible is False for picker in PICKERS)
    assert blocks_by_id["score-second-model"].visible is False and blocks_by_id["server-models"].visible is False


def test_several_models_get_a_picker_on_every_tab_and_a_compare_tab():
    blocks = build_ui(served("small", "large", "base"))
    assert _tabs(blocks) == {"Chat", "Complete", "Score", "Compare", "Server"}
    blocks_by_id = _by_id(blocks)
    for picker in PICKERS:
        assert blocks_by_id[picker].visible is not False and blocks_by_id[picker].value == "small"
        assert [choice[1] for choice in blocks_by_id[picker].choices] == ["small", "large", "base"]
    # Compare starts on two different models: the first two.
    assert (blocks_by_id["compare-model-a"].value, blocks_by_id["compare-model-b"].value) == ("small", "large")


def test_generating_events_run_concurrently_so_the_engine_can_batch_users():
    blocks = build_ui(served("small", "large"))
    generating = [fn for fn in blocks.fns.values() if _name(fn.fn) in GENERATING | {"compare_models"}]
    assert {_name(fn.fn) for fn in generating} == GENERATING | {"compare_models"}
    assert all(fn.concurrency_limit is None and fn.queue for fn in generating)
    assert blocks._queue.default_concurrency_limit is None  # the quick events too
