"""Model implementations: the native families on the paged KV cache, one module each, and the generic
transformers wrapper (generic.py) for every other architecture."""
from __future__ import annotations

from torch import nn

from engine.models import gemma, llama, phi3
from engine.models.gemma import GemmaForCausalLM
from engine.models.llama import LlamaForCausalLM
from engine.models.phi3 import Phi3ForCausalLM

# config.model_type -> the class that serves it natively. Anything else takes the generic path, which recomputes
# the whole sequence at every step.
NATIVE_MODELS: dict[str, type[nn.Module]] = {
    **{model_type: LlamaForCausalLM for model_type in llama.MODEL_TYPES},
    **{model_type: GemmaForCausalLM for model_type in gemma.MODEL_TYPES},
    **{model_type: Phi3ForCausalLM for model_type in phi3.MODEL_TYPES},
}

__all__ = ["NATIVE_MODELS", "GemmaForCausalLM", "LlamaForCausalLM", "Phi3ForCausalLM"]
