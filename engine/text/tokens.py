"""Tokenizer-facing helpers shared by the API and the UI: chat templates, token text and bytes, EOS ids."""
from __future__ import annotations

import inspect
from collections.abc import Sequence
from functools import cached_property, lru_cache

from engine.errors import NoChatTemplateError
from engine.text.fill_in_middle import FimTokens, find_fim_tokens
from engine.text.reasoning import ReasoningTags, detect_reasoning
from engine.text.tool_calls import Function, fallback_messages, native_messages

# End-of-turn markers of common chat templates; a model whose vocabulary has one stops on it like on EOS.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|end_of_text|>")


class TokenizerView:
    """Wraps a Hugging Face tokenizer with the few calls the engine's users need, cached where it pays."""

    def __init__(self, tokenizer, generation_eos: int | list[int] | None = None) -> None:
        self._hf = tokenizer
        self.vocab_size = len(tokenizer)
        vocab = tokenizer.get_vocab()  # once: a new dict of every token each call (~50 ms at 128k tokens)
        self.eos_ids = self._eos_ids(generation_eos, vocab)
        self._byte_decoder = _byte_decoder() if _is_byte_level(vocab) else None
        self.token_text = lru_cache(maxsize=65536)(self._token_text)
        self.token_bytes = lru_cache(maxsize=65536)(self._token_bytes)
        # Decided once here: whether replies carry <think> reasoning to split off (engine/text/reasoning.py).
        self.reasoning: ReasoningTags | None = detect_reasoning(vocab, self.chat_template)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._hf, "chat_template", None))

    @property
    def chat_template(self) -> str | None:
        return self._hf.chat_template if self.has_chat_template else None

    @property
    def special_tokens(self) -> dict[str, str | None]:
        """The end, beginning and padding tokens' text, as the tokenizer names them (None where it has none)."""
        return {"eos_token": self._hf.eos_token, "bos_token": self._hf.bos_token, "pad_token": self._hf.pad_token}

    @property
    def pad_token_id(self) -> int | None:
        return self._hf.pad_token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    functions: Sequence[Function] | None = None, template_kwargs: dict | None = None) -> str:
        """Chat messages (OpenAI's shape: assistant `tool_calls`, `tool` results) -> prompt text, with the functions
        the model may call. A template that renders tools gets them as transformers passes them; for one that does
        not, engine/text/tool_calls.py writes them (and earlier calls and results) as text. Tokenize the result with
        add_special_tokens=False: the template has the BOS. template_kwargs are more variables for the template (e.g.
        Qwen3's enable_thinking); the caller keeps them off the names apply_chat_template itself takes."""
        if not self.has_chat_template:
            raise NoChatTemplateError("this model's tokenizer has no chat template; use /v1/completions", "messages")
        if self.renders_tools:
            tools = [f.definition() for f in functions] if functions else None
            return self._hf.apply_chat_template(native_messages(messages), tools=tools, tokenize=False,
                                                add_generation_prompt=add_generation_prompt, **(template_kwargs or {}))
        return self._hf.apply_chat_template(fallback_messages(messages, functions), tokenize=False,
                                            add_generation_prompt=add_generation_prompt, **(template_kwargs or {}))

    def chat_prompt_ids(self, messages: list[dict], functions: Sequence[Function] | None = None,
                        template_kwargs: dict | None = None) -> list[int]:
        """The prompt for the assistant's next turn, as token ids: what the API and the UI submit for a chat."""
        return self.encode(self.render_chat(messages, True, functions, template_kwargs), add_special_tokens=False)

    @cached_property
    def reserved_template_names(self) -> frozenset[str]:
        """Names a caller's template variables may not take: apply_chat_template's own parameters (`return_dict`
        would change what it returns) and the variables it sets itself."""
        parameters = inspect.signature(self._hf.apply_chat_template).parameters
        own = {name for name, p in parameters.items() if p.kind is not inspect.Parameter.VAR_KEYWORD}
        return frozenset(own | {"messages", "add_generation_prompt", "tools", "documents"})

    @cached_property
    def renders_tools(self) -> bool:
        """Whether the chat template writes tool definitions itself: asked by rendering one conversation with and
        without a tool, since templates declare nothing."""
        if not self.has_chat_template:
            return False
        probe = [{"role": "user", "content": "hi"}]
        tool = Function("probe", {"type": "object", "properties": {}}, "A probe.").definition()
        try:
            with_tool = self._hf.apply_chat_template(probe, tools=[tool], tokenize=False)
        except Exception:  # a template that chokes on tools does not render them
            return False
        return with_tool != self._hf.apply_chat_template(probe, tokenize=False)

    @cached_property
    def fim_tokens(self) -> FimTokens | None:
        """This vocabulary's fill-in-the-middle tokens (engine/text/fill_in_middle.py), None where it has none."""
        return find_fim_tokens(self._hf.get_vocab())

    def fim_prompt_ids(self, fim: FimTokens, prefix: str | list[int], suffix: str) -> list[int]:
        """The prompt that asks for the text between prefix (text, or token ids used as given) and suffix."""
        prefix_ids = self.encode(prefix, add_special_tokens=False) if isinstance(prefix, str) else prefix
        return fim.prompt_ids(prefix_ids, self.encode(suffix, add_special_tokens=False))

    def _token_text(self, token_id: int) -> str:
        return self._hf.decode([token_id], skip_special_tokens=False)

    def _token_bytes(self, token_id: int) -> bytes:
        """The exact bytes a token stands for (a byte-level token may be part of a UTF-8 character)."""
        piece = self._hf.convert_ids_to_tokens(token_id)
        if self._byte_decoder is not None and piece is not None and all(c in self._byte_decoder for c in piece):
            return bytes(self._byte_decoder[c] for c in piece)
        if piece and piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6:
            return bytes([int(piece[3:5], 16)])  # SentencePiece byte-fallback token
        return self._token_text(token_id).encode("utf-8")

    def _eos_ids(self, generation_eos, vocab: dict[str, int]) -> frozenset[int]:
        ids: set[int] = set()
        if isinstance(generation_eos, int):
            ids.add(generation_eos)
        elif generation_eos:
            ids.update(generation_eos)
        if self._hf.eos_token_id is not None:
            ids.add(self._hf.eos_token_id)
        ids.update(vocab[t] for t in END_OF_TURN_TOKENS if t in vocab)
        return frozenset(ids)


def _is_byte_level(vocab: dict[str, int]) -> bool:
    # Byte-level BPE (GPT-2 style) spells a space as "Ġ"; SentencePiece uses "▁".
    return "Ġ" in vocab or "Ġthe" in vocab


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode table."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    codes = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, codes)}
