"""Postprocess, the step's third part: sampled tokens into their sequences, when a sequence ends (the finish rules,
in one function), and each request's outputs onto its stream. Engine thread only, except where a method says.

It owns the table of live requests: every request admitted and not yet ended is in it, with its stream, so that
each ends exactly once with a finish_reason (or the error that stopped it) and its KV blocks are freed.
"""
from __future__ import annotations

import time
from collections import deque

from engine.errors import GrammarError, StepFailedError
from engine.outputs import FINISH_ABORT, RequestOutput
from engine.request import Request, Sequence, TokenLogprob
from engine.decode.runner import StepLogits
from engine.sampler import sample
from engine.scheduler import ScheduledBatch, Scheduler
from engine.stream import RequestStream

_TOKENS_PER_S_WINDOW_S = 5.0


class Postprocessor:
    def __init__(self, scheduler: Scheduler, eos_ids: set[int] | frozenset[int], max_model_len: int) -> None:
        self._scheduler = scheduler
        self._eos_ids = eos_ids
        self._max_model_len = max_model_len
        self.requests: dict[str, tuple[Request, RequestStream]] = {}
        self.num_steps = 0
        self.num_generated_tokens = 0
        self._recent_tokens: deque[tuple[float, int]] = deque(maxlen=1000)  # (time, tokens sampled) per step

    def track(self, request: Request, stream: RequestStream) -> None:
        """From now on the request's outputs, its end and any failure go to this stream. First thing at admission:
        a failure while its sequences are made is delivered to it."""
        self.requests[request.request_id] = (request, stream)

    def postprocess(self, batch: ScheduledBatch, logits: StepLogits) -> None:
        for i, chunk_logits in logits.prompt_logits.items():
            seq = batch.seqs[i]
            seq.request.prompt_logprobs.add_chunk(seq.num_computed_tokens, chunk_logits)
        for i, hidden in logits.hidden_states.items():
            seq = batch.seqs[i]
            seq.request.embedding.add_chunk(seq.num_computed_tokens, hidden)
        self._scheduler.mark_computed(batch)
        sampling = [seq for seq, s in zip(batch.seqs, batch.samples) if s]
        results = sample(logits.sample_logits, sampling, self._eos_ids) if sampling else []
        # Counted before any output goes out: a consumer that has its last token must find it in stats().
        self._recent_tokens.append((time.monotonic(), len(results)))
        self.num_steps += 1
        self.num_generated_tokens += len(results)
        for seq, (token_id, logprob) in zip(sampling, results):
            self._append(seq, token_id, logprob)
        for seq, s in zip(batch.seqs, batch.samples):
            # A prompt-only request (max_tokens 0: scoring, echo, embeddings) ends once its prefill is done.
            if not s and seq.max_tokens == 0 and seq.num_computed_tokens >= seq.num_tokens:
                self._emit(seq, [], "", None, "length")

    def tokens_per_s(self) -> float:
        """Tokens sampled per second over the last few seconds. Any thread."""
        now = time.monotonic()
        recent = [n for t, n in list(self._recent_tokens) if now - t <= _TOKENS_PER_S_WINDOW_S]
        return sum(recent) / _TOKENS_PER_S_WINDOW_S

    def abort(self, request_id: str) -> None:
        """End a request silently (its consumer is gone or asked to stop) and free its blocks."""
        entry = self.requests.pop(request_id, None)
        if entry is None:
            return
        request, stream = entry
        for seq in request.sequences:
            if not seq.is_finished:
                self._scheduler.finish(seq)
        stream.end()

    def finish_all_as_aborted(self) -> None:
        """Every unfinished sample ends now with FINISH_ABORT, so each consumer sees how its request ended."""
        for request, _ in list(self.requests.values()):
            for seq in request.sequences:
                if not seq.is_finished:
                    self._emit(seq, [], seq.output_text.finish(), None, FINISH_ABORT)

    def fail(self, request_id: str, exc: Exception) -> None:
        """End a request with the error that stopped it (its consumer raises it) and free its blocks."""
        entry = self.requests.get(request_id)
        if entry is not None:
            error = StepFailedError(
                f"the engine failed while computing this request ({type(exc).__name__}; the server log has the "
                "details). The server goes on serving: the request can be retried."
            )
            error.__cause__ = exc
            entry[1].put(error)
        self.abort(request_id)

    def fail_all(self, exc: Exception) -> None:
        for request_id in list(self.requests):
            try:
                self.fail(request_id, exc)
            except Exception:  # its client has the error already; forget it rather than fail again
                self.requests.pop(request_id, None)

    def close_all(self) -> None:
        """The engine stops: every request's stream ends now, without a last output."""
        for request_id in list(self.requests):
            self.abort(request_id)

    def _append(self, seq: Sequence, token_id: int, logprob: TokenLogprob | None) -> None:
        if seq.grammar is not None and not seq.grammar.accept(token_id):  # only if a mask failed: fail this request
            error = GrammarError(f"the grammar refused token {token_id}: {seq.grammar.error}")
            self.fail(seq.request.request_id, error)
            return
        seq.token_ids.append(token_id)
        delta, finish_reason, stop_reason = self._finish_rules(seq, token_id)
        self._emit(seq, [token_id], delta, [logprob] if logprob is not None else None, finish_reason, stop_reason)

    def _finish_rules(self, seq: Sequence, token_id: int) -> tuple[str, str | None, str | int | None]:
        """Whether the sequence ends with the token just appended, and why: the text it adds (held back while it may
        still become a stop string), finish_reason ("stop", "length" or None) and stop_reason (the stop string or
        stop token id that matched). The one place that decides when a sample ends; max_tokens is resolved at
        admission (engine/admission.py) and the scheduler asks the same Sequence.has_token_budget."""
        params = seq.params
        finish_reason = stop_reason = None
        delta = ""
        if token_id in params.stop_token_ids:
            finish_reason, stop_reason = "stop", token_id
        elif token_id in self._eos_ids and not params.ignore_eos:
            finish_reason = "stop"
        else:
            delta, stopped = seq.output_text.append(token_id)
            if stopped:
                finish_reason, stop_reason = "stop", seq.output_text.stop_reason
        if finish_reason is None and seq.grammar is not None and seq.grammar.is_finished:
            finish_reason = "stop"  # the structured output is complete: nothing but an end could follow
        if finish_reason is None and (not seq.has_token_budget or seq.num_tokens >= self._max_model_len):
            finish_reason = "length"
        if finish_reason is not None and not isinstance(stop_reason, str):
            delta += seq.output_text.finish()  # nothing can become a stop string any more: release held text
        return delta, finish_reason, stop_reason

    def _emit(self, seq, token_ids, text, logprobs, finish_reason, stop_reason=None) -> None:
        request = seq.request
        entry = self.requests.get(request.request_id)
        if entry is None:
            return
        stream = entry[1]
        prompt_logprobs = None if request.prompt_logprobs is None else request.prompt_logprobs.take_for_emit()
        embedding = None if request.embedding is None else request.embedding.take_for_emit()
        out = RequestOutput(request.request_id, seq.index, token_ids, text, logprobs, finish_reason, stop_reason,
                            seq.num_prompt_tokens, seq.num_output_tokens, prompt_logprobs, seq.num_cached_tokens,
                            embedding)
        delivered = stream.put(out)
        if finish_reason is not None:
            seq.finish_reason, seq.stop_reason = finish_reason, stop_reason
            self._scheduler.finish(seq)
            request.num_finished += 1
            if request.num_finished == len(request.sequences):
                del self.requests[request.request_id]
                stream.end()
        if not delivered:  # the consumer's event loop is gone: nobody will read the rest
            self.abort(request.request_id)
