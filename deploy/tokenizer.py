"""The served model's tokenizer alone, for the ingress: it tokenizes prompts to route them, and runs no model."""
from __future__ import annotations

from engine import EngineConfig
from engine.text.tokens import TokenizerView


def load_tokenizer(engine_config: EngineConfig) -> TokenizerView:
    from transformers import AutoTokenizer

    from engine.weights import checkpoint

    folder, _ = checkpoint.resolve_checkpoint(engine_config.model, engine_config.cache_path)
    return TokenizerView(AutoTokenizer.from_pretrained(folder))
