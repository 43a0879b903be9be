"""Fill-in-the-middle: which FIM tokens a tokenizer has, and the prompt that asks a model for the text between a
prefix and a suffix.

Two families of FIM tokens are known: StarCoder's `<fim_prefix>`, `<fim_suffix>`, `<fim_middle>` (StarCoder,
StarCoder2, SantaCoder) and Qwen2.5-Coder's `<|fim_prefix|>`, `<|fim_suffix|>`, `<|fim_middle|>`. Both are trained in
PSM order (prefix, suffix, middle), so the prompt is `<fim_prefix>{prefix}<fim_suffix>{suffix}<fim_middle>` and the
model writes the middle. A tokenizer with neither family (SmolLM2's vocabulary, the default model's, keeps StarCoder's
`<repo_name>`-style tokens but not the FIM ones) has no FIM: the caller refuses the request.
"""
from __future__ import annotations

from dataclasses import dataclass

# Each family as (prefix, suffix, middle) token texts, in the order they are looked for.
FIM_FAMILIES = (
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
)


@dataclass(frozen=True)
class FimTokens:
    """The ids of one family's three FIM tokens in a vocabulary."""

    prefix_id: int
    suffix_id: int
    middle_id: int

    def prompt_ids(self, prefix_ids: list[int], suffix_ids: list[int]) -> list[int]:
        """The PSM prompt: the model's answer is the middle."""
        return [self.prefix_id, *prefix_ids, self.suffix_id, *suffix_ids, self.middle_id]


def find_fim_tokens(vocab: dict[str, int]) -> FimTokens | None:
    """The first family whose three tokens are all single tokens of `vocab` (token text -> id), or None."""
    for family in FIM_FAMILIES:
        ids = [vocab.get(text) for text in family]
        if all(token_id is not None for token_id in ids):
            return FimTokens(*ids)
    return None
