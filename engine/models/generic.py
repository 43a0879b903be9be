"""Fallback for architectures without a native implementation: any AutoModelForCausalLM, recomputed per step.

It keeps every engine feature (batching, sampling, stops, logprobs) but ignores the paged KV cache and runs the
whole sequence through transformers at every step, so it is correct but much slower than the native path.
"""
from __future__ import annotations

from collections import Counter

import torch

from engine.decode.runner import StepLogits
from engine.scheduler import ScheduledBatch


class RecomputeRunner:
    """engine.decode.runner.Runner for the generic path: every step eager, nothing compiled, captured or reserved."""

    decode_step = "eager"
    decode_graphs = False
    num_reserved_blocks = 0
    has_reserved_blocks_to_free = False

    def __init__(self, model, device: torch.device, pad_token_id: int = 0) -> None:
        self.model = model
        self.device = device
        self.pad_token_id = pad_token_id
        self.decode_steps: Counter = Counter()

    def free_reserved_blocks(self) -> None:
        pass

    def wait_for_compiled_decode(self, timeout_s: float | None = None) -> bool:
        return False

    def stop_compiling(self) -> None:
        pass

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> StepLogits:
        if batch.is_decode:
            self.decode_steps["eager"] += 1
        ends = [seq.num_computed_tokens + n for seq, n in zip(batch.seqs, batch.num_new_tokens)]
        width = max(ends)
        input_ids = torch.full((len(ends), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(ends), width), dtype=torch.long)
        for i, (seq, end) in enumerate(zip(batch.seqs, ends)):
            input_ids[i, :end] = torch.tensor(seq.token_ids[:end])
            attention_mask[i, :end] = 1
        # Right padding keeps every real token at its natural position, so no position_ids are needed.
        wants_hidden = any(batch.wants_hidden_states)
        output = self.model(input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device),
                            use_cache=False, output_hidden_states=wants_hidden)
        logits = output.logits.float()
        sample_rows = [logits[i, end - 1] for i, (end, s) in enumerate(zip(ends, batch.samples)) if s]
        sample_logits = torch.stack(sample_rows) if sample_rows else logits.new_empty(0, 0)
        prompt_logits = {
            i: logits[i, end - batch.num_new_tokens[i] : end]
            for i, (end, wanted) in enumerate(zip(ends, batch.wants_prompt_logits))
            if wanted
        }
        # transformers' last hidden state is the final norm's output, as the native models' forward returns.
        hidden_states = {
            i: output.hidden_states[-1][i, end - batch.num_new_tokens[i] : end]
            for i, (end, wanted) in enumerate(zip(ends, batch.wants_hidden_states))
            if wanted
        }
        return StepLogits(sample_logits, prompt_logits, hidden_states)
