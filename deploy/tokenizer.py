"""The served model's tokenizer alone, for the ingress: it tokenizes prompts to route them, and runs no model."""
from __future__ import annotations

from pathlib import Path

from engine import EngineConfig
from engine.text.tokens import TokenizerView


def load_tokenizer(engine_config: EngineConfig) -> TokenizerView:
    from transformers import AutoTokenizer

    from engine.weights import loader

    cache_dir = Path(engine_config.cache_dir) if engine_config.cache_dir else loader.default_cache_dir()
    folder, _ = loader.resolve_checkpoint(engine_config.model, cache_dir)
    return TokenizerView(AutoTokenizer.from_pretrained(folder))
