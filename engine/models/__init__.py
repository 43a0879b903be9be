"""Model implementations: native Llama-family with paged attention, and a generic transformers wrapper."""
from engine.models.llama import NATIVE_MODEL_TYPES, LlamaForCausalLM

__all__ = ["NATIVE_MODEL_TYPES", "LlamaForCausalLM"]
