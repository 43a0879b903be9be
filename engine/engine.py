"""Engine: owns model, tokenizer and KV cache; a background thread runs schedule -> run -> postprocess.

Requests enter through submit() from any thread; only the engine thread touches the scheduler, the KV cache and
the model. Each request's outputs travel back through its own RequestStream.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import random
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field

import torch

from engine import loader
from engine.config import EngineConfig, batched_tokens_for
from engine.decode_path import build_runner
from engine.errors import (
    ContextLengthExceededError, DrainingError, GrammarError, InvalidRequestError, QueueFullError, StepFailedError,
)
from engine.grammar import GrammarCompiler
from engine.info import EngineInfo
from engine.kv_cache import BlockAllocator, KVCache, blocks_needed
from engine.loader import LoadedModel
from engine.outputs import FINISH_ABORT, Completion, ContinuationScore, RequestOutput
from engine.request import Request, Sequence, TokenLogprob
from engine.runner import StepLogits
from engine.sampler import sample
from engine.scheduler import ScheduledBatch, Scheduler
from engine.stops import OutputText
from engine.stream import RequestStream
from engine.tokens import TokenizerView

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_kv_blocks_used: int  # by requests (their prompts, outputs and cached prefixes)
    num_kv_blocks_free: int
    num_preemptions: int
    tokens_per_s: float  # generated tokens per second over the last few seconds
    num_prefix_cache_hits: int = 0  # KV blocks reused from the prefix cache since start
    num_steps: int = 0  # model steps run since start, for every caller (the API, the UI, scoring)
    num_generated_tokens: int = 0  # tokens sampled since start, for every caller
    num_kv_blocks_reserved: int = 0  # held by the engine itself: the compiled decode step's warm-up, while it runs
    decode_steps: dict[str, int] = field(default_factory=dict)  # decode steps run, by what ran them (Runner)

    @property
    def kv_cache_usage(self) -> float:
        total = self.num_kv_blocks_used + self.num_kv_blocks_free
        return self.num_kv_blocks_used / total if total else 0.0


def _load_leaving_a_core(config: EngineConfig) -> LoadedModel:
    """loader.load on one intra-op thread fewer than the steps use. The server builds its web app (Python, a core's
    work) while the model loads; on 2 cores a 2-thread OpenMP team then waits in each of the load's thousands of
    small parallel regions for the thread the OS has parked. On the 2-core VM with other processes running, the
    default model loaded in 2.3-3.0 s on 2 threads and 0.5-0.6 s on 1 (a 1B Q4_0 file: 11-12 s and 3-5 s). The
    count is this thread's own (OpenMP's), restored before any step runs."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(max(num_threads - 1, 1))
    try:
        return loader.load(config, repack_threads=num_threads)
    finally:
        torch.set_num_threads(num_threads)


class Engine:
    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None) -> None:
        self.config = config or EngineConfig()
        self._lock = threading.Condition()
        self._running = False
        self._stopped = False
        self._is_draining = False  # drain(): submit() refuses from now on
        self._is_aborting_all = False  # abort_all() asked; the engine thread ends every request at its next turn
        # Every torch operation of the engine (loading, cache allocation, every step) runs on this one thread.
        # On few cores, a second thread running OpenMP regions (the caller's, had it loaded the model) makes
        # libgomp throttle every team's spin-waits: decode measured ~40% slower than from a single thread.
        setup_failure: list[BaseException] = []
        setup_done = threading.Event()

        def engine_thread() -> None:
            try:
                self._setup(loaded)
            except BaseException as exc:  # handed to the constructor's caller below
                setup_failure.append(exc)
                return
            finally:
                setup_done.set()
            with self._lock:
                while not (self._running or self._stopped):
                    self._lock.wait()
            if self._running:
                self._loop()

        self._thread: threading.Thread | None = threading.Thread(target=engine_thread, name="tern-engine", daemon=True)
        self._thread.start()
        setup_done.wait()
        if setup_failure:
            self._thread = None
            raise setup_failure[0]

    def _setup(self, loaded: LoadedModel | None) -> None:
        self.loaded = loaded or _load_leaving_a_core(self.config)
        model, hf_config = self.loaded.model, self.loaded.hf_config
        self.device, self.dtype = self.loaded.device, self.loaded.dtype
        if self.device.type == "cuda":
            # cuDNN's SDPA (PyTorch's first choice on Hopper) builds a plan per new sequence length, ~0.2 s each:
            # every prompt of a new length would pay it. Flash and memory-efficient attention do not.
            torch.backends.cuda.enable_cudnn_sdp(False)
        self.model_name = self.loaded.name
        generation_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        self.tokenizer = TokenizerView(self.loaded.tokenizer, generation_eos or hf_config.eos_token_id)
        self.vocab_size = hf_config.vocab_size
        # Structured output: response formats -> grammars, compiled on the callers' threads (never this one).
        self.grammars = GrammarCompiler(self.loaded.tokenizer, self.vocab_size, self.tokenizer.eos_ids)

        block_size = self.config.block_size
        max_model_len = self._context_limit(hf_config)
        self.kv_cache = None
        if self.loaded.is_native:
            kv_args = (hf_config.num_hidden_layers, block_size, model.num_kv_heads, model.head_dim)
            num_blocks = self.config.num_kv_blocks or max(
                min(
                    self.config.kv_cache_memory_bytes // KVCache.bytes_per_block(*kv_args, self.dtype),
                    self.config.max_num_seqs * blocks_needed(max_model_len, block_size),
                ),
                1,
            )
            max_model_len = min(max_model_len, num_blocks * block_size)
            self.kv_cache = KVCache(kv_args[0], num_blocks, *kv_args[1:], self.dtype, self.device)
            model.build_rope_tables(max_model_len, self.device, self.dtype)
        else:
            # The generic path recomputes everything, but the allocator still bounds concurrent context.
            num_blocks = self.config.num_kv_blocks or self.config.max_num_seqs * blocks_needed(max_model_len, block_size)
        self.max_model_len = max_model_len
        self.allocator = BlockAllocator(num_blocks)
        self.runner = build_runner(self.config, self.loaded, self.kv_cache, self.allocator, max_model_len, self._wake)
        self.max_num_batched_tokens = self.config.max_num_batched_tokens or batched_tokens_for(
            self.device.type, self.config.max_num_seqs)
        self.scheduler = Scheduler(
            self.allocator,
            block_size,
            self.config.max_num_seqs,
            self.max_num_batched_tokens,
            enable_prefix_caching=self.config.enable_prefix_caching and self.loaded.is_native,
        )

        self._seq_ids = itertools.count()
        self._seed_rng = random.Random(self.config.seed)
        self._inbox: deque[tuple[Request, RequestStream]] = deque()
        self._aborts: deque[str] = deque()
        self._requests: dict[str, tuple[Request, RequestStream]] = {}  # engine thread only
        self._recent_tokens: deque[tuple[float, int]] = deque()
        self._num_steps = 0
        self._num_generated_tokens = 0
        self._injected_failure: Exception | None = None  # fail_next_step()'s, for tests
        logger.info(
            "engine ready: %s (%s, %s, %s), max_model_len %d, %d KV blocks of %d tokens, %d tokens per step",
            self.model_name,
            "native" if self.loaded.is_native else "generic transformers path",
            self.device,
            str(self.dtype).removeprefix("torch."),
            self.max_model_len,
            num_blocks,
            block_size,
            self.max_num_batched_tokens,
        )

    def _wake(self) -> None:
        """Any thread: have the engine thread look for work again (the runner's background compile has ended, and
        its reserved blocks can be freed)."""
        with self._lock:
            self._lock.notify_all()

    def wait_for_compiled_decode(self, timeout_s: float | None = None) -> bool:
        """Block until compiling the decode step has ended (at once when it never started); True when decode
        steps now run compiled. For benchmarks and tests that want the steady state."""
        return self.runner.wait_for_compiled_decode(timeout_s)

    @property
    def decode_graphs(self) -> bool:
        """Whether decode steps replay captured CUDA graphs."""
        return self.runner.decode_graphs

    @property
    def compiled_decode(self) -> bool:
        """Whether decode steps run under torch.compile (the generic path's runner never compiles)."""
        return self.runner.decode_step == "compiled"

    @property
    def decode_step(self) -> str:
        """`native` (C++, engine/native_decode.py), `compiled`, `compiling` (the eager step serves until the
        compiled one is ready) or `eager`."""
        return self.runner.decode_step

    def info(self) -> EngineInfo:
        """What this engine serves and how, now (the decode step moves on from `compiling`): the one description
        api/ and ui/ render."""
        loaded = self.loaded
        return EngineInfo(
            model_name=self.model_name, num_parameters=loaded.num_parameters,
            has_chat_template=self.tokenizer.has_chat_template, device=str(self.device),
            dtype=str(self.dtype).removeprefix("torch."), quantization=loaded.quantization,
            weights=loaded.describe_weights(), weight_bytes=loaded.weight_bytes,
            bf16_weight_bytes=loaded.bf16_weight_bytes,
            kv_cache_bytes=self.kv_cache.num_bytes if self.kv_cache is not None else 0,
            cpu_kernels=loaded.kernels.describe() if self.device.type == "cpu" else "none (not a CPU)",
            decode_step=self.decode_step, decode_graphs=self.decode_graphs, max_model_len=self.max_model_len,
            max_num_seqs=self.config.max_num_seqs, max_waiting=self.config.max_waiting)

    # Lifecycle.
    def start(self) -> Engine:
        with self._lock:
            self._running, self._stopped = True, False
            self._lock.notify_all()
        if self._thread is None:  # started again after stop(): the setup thread has ended
            self._thread = threading.Thread(target=self._loop, name="tern-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        with self._lock:
            self._running, self._stopped = False, True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def drain(self) -> None:
        """Take no new requests from now on (submit() raises DrainingError); those already in run to their end.
        A shutdown drains, waits until has_requests is False or its grace period is over, then calls abort_all()."""
        with self._lock:
            self._is_draining = True

    @property
    def is_running(self) -> bool:
        """Whether the step loop is alive: started, not stopped, its thread not dead (a health check asks)."""
        thread = self._thread
        return self._running and thread is not None and thread.is_alive()

    @property
    def is_draining(self) -> bool:
        return self._is_draining

    @property
    def has_requests(self) -> bool:
        """Whether any request is queued, waiting or running. Any thread may ask."""
        with self._lock:  # the engine thread admits arrivals under it: none is ever in neither place
            return bool(self._inbox or self._requests)

    def abort_all(self) -> None:
        """End every request at the engine thread's next turn: each unfinished sample gets a last output with
        finish_reason FINISH_ABORT (its held-back text released) and its KV blocks are freed."""
        with self._lock:
            self._is_aborting_all = True
            self._lock.notify()

    def __enter__(self) -> Engine:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # Public surface.
    def submit(self, prompt: str | list[int], params, request_id: str | None = None) -> RequestStream:
        """Queue a request; returns its stream of RequestOutput deltas. Raises InvalidRequestError subclasses for
        requests that cannot be served, before anything is queued."""
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._validate(prompt_ids, params)
        request = Request(request_id or uuid.uuid4().hex, prompt_ids, params)
        stream = RequestStream(request.request_id)
        with self._lock:
            if self._is_draining:
                raise DrainingError("the engine is shutting down and takes no new requests")
            if len(self._inbox) + len(self.scheduler.waiting) >= self.config.max_waiting:
                raise QueueFullError("too many requests are waiting; retry shortly")
            self._inbox.append((request, stream))
            self._lock.notify()
        return stream

    def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks at the next step; its stream ends."""
        with self._lock:
            self._aborts.append(request_id)
            self._lock.notify()

    def generate(self, prompts: list[str | list[int]], params) -> list[Completion]:
        """Blocking convenience for scripts and tests: submit all prompts at once, wait for all."""
        streams = [self.submit(p, params) for p in prompts]
        return [_collect(s) for s in streams]

    async def complete(self, prompt: str | list[int], params, request_id: str | None = None) -> Completion:
        completion = Completion(request_id or "")
        stream = self.submit(prompt, params, request_id)
        try:
            async for out in stream:
                completion.add(out)
        finally:
            if not stream.finished:
                self.abort(stream.request_id)
        completion.request_id = stream.request_id
        return completion

    async def score(self, context: str | list[int], continuations: list[str | list[int]]) -> list[ContinuationScore]:
        """Log-likelihood of each continuation after the context, all scored in one batch."""
        from engine.params import SamplingParams

        pairs = [self._split_for_scoring(context, c) for c in continuations]
        params = SamplingParams(max_tokens=0, prompt_logprobs=1)
        completions = await asyncio.gather(*(self.complete(ctx + cont, params) for ctx, cont in pairs))
        if any(not c.choices or c.choices[0].finish_reason == FINISH_ABORT for c in completions):
            raise DrainingError("the engine shut down before scoring ended")
        scores = []
        for (ctx, cont), completion in zip(pairs, completions):
            entries = completion.prompt_logprobs[len(ctx) :]
            logprobs = [e.logprob for e in entries]
            top_ids = [e.top[0][0] if e.top else e.token_id for e in entries]
            greedy = all(not e.top or e.logprob >= e.top[0][1] for e in entries)
            scores.append(ContinuationScore(sum(logprobs), greedy, cont, logprobs, top_ids))
        return scores

    def fail_next_step(self, exc: Exception) -> None:
        """For tests: the next step that runs the model raises `exc` in its place, as a kernel or model bug would.
        Nothing in the server calls it. The requests of that step end with a StepFailedError; the rest go on."""
        with self._lock:
            self._injected_failure = exc

    def stats(self) -> EngineStats:
        now = time.monotonic()
        recent = [(t, n) for t, n in list(self._recent_tokens) if now - t <= 5.0]
        tokens_per_s = sum(n for _, n in recent) / 5.0 if recent else 0.0
        # The warm-up's blocks are no request's: a client counting leaked blocks must not see them (minutes on a
        # small CPU, while the compiled step builds in the background).
        reserved = self.runner.num_reserved_blocks
        return EngineStats(
            len(self.scheduler.running),
            len(self.scheduler.waiting) + len(self._inbox),
            self.allocator.num_used - reserved,
            self.allocator.num_free,
            self.scheduler.num_preemptions,
            tokens_per_s,
            self.allocator.num_cached_hits,
            self._num_steps,
            self._num_generated_tokens,
            reserved,
            dict(self.runner.decode_steps),
        )

    def cached_prefix_hashes(self) -> list[bytes]:
        """Hashes of the KV blocks the prefix cache holds (engine/kv_cache.py block_hash: each chained to the blocks
        before it), so a router in front of several engines can tell which one holds a prompt's prefix."""
        return self.allocator.cached_hashes()

    # Validation (caller's thread).
    def _validate(self, prompt_ids: list[int], params) -> None:
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty", "prompt")
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})", "prompt")
        for name, token_ids in (("logit_bias", params.logit_bias), ("stop_token_ids", params.stop_token_ids)):
            bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})", name)
        total = len(prompt_ids) + (params.max_tokens or 0)
        if total > self.max_model_len or len(prompt_ids) >= self.max_model_len and params.max_tokens != 0:
            raise ContextLengthExceededError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{total} tokens ({len(prompt_ids)} in the prompt, {params.max_tokens or 0} for the completion). "
                "Please reduce the prompt or the completion length.",
                "prompt" if len(prompt_ids) >= self.max_model_len else "max_tokens",
            )

    def _split_for_scoring(self, context, continuation) -> tuple[list[int], list[int]]:
        """Tokenize as lm-evaluation-harness does: the pair together, context boundary from the context alone.
        Either side may be token ids instead (then used as given); neither may come out empty."""
        if not isinstance(context, str) or not isinstance(continuation, str):
            ctx = list(context) if not isinstance(context, str) else self.tokenizer.encode(context)
            cont = list(continuation) if not isinstance(continuation, str) else self.tokenizer.encode(continuation, False)
        else:
            trailing = len(context) - len(context.rstrip())
            if trailing:  # a context's trailing space belongs to the continuation's first token
                context, continuation = context[:-trailing], context[-trailing:] + continuation
            ctx = self.tokenizer.encode(context)
            cont = self.tokenizer.encode(context + continuation)[len(ctx) :]
        if not ctx:  # the first token of a sequence has no likelihood: something must come before the continuation
            raise InvalidRequestError("the context must not be empty: the first token has no likelihood", "prompt")
        if not cont:
            message = "a continuation is empty"
            if isinstance(continuation, str) and continuation:
                message = ("a continuation has no tokens of its own: tokenized after its context it merges into the "
                           "context's last token (split the pair at a word boundary, or send token ids)")
            raise InvalidRequestError(message, "continuation")
        return ctx, cont

    def _context_limit(self, hf_config) -> int:
        limit = getattr(hf_config, "max_position_embeddings", None) or 2048
        window = getattr(hf_config, "sliding_window", None)
        applies_window = self.loaded.is_native and self.loaded.model.applies_sliding_window
        if window and getattr(hf_config, "use_sliding_window", True) and not applies_window:
            limit = min(limit, window)  # attention here is full: stay inside the window the model was trained on
        return min(self.config.max_model_len or limit, limit)

    # Engine thread.
    def _loop(self) -> None:
        while True:
            try:
                with self._lock:
                    while self._running and not (self._inbox or self._aborts or self._is_aborting_all
                                                 or self.runner.has_reserved_blocks_to_free or self.scheduler.has_work):
                        self._lock.wait()
                    if not self._running:
                        break
                    arrivals, self._inbox = list(self._inbox), deque()
                    aborts, self._aborts = list(self._aborts), deque()
                    abort_all, self._is_aborting_all = self._is_aborting_all, False
                    for request, stream in arrivals:  # under the lock, so has_requests never misses one in transit
                        self._admit(request, stream)
                for request_id in aborts:
                    self._abort_now(request_id)
                if abort_all:
                    self._end_all()
                self.runner.free_reserved_blocks()
                if self.scheduler.has_work:
                    self.step()
            except Exception as exc:  # a bug outside any one step: fail what is in flight rather than stop serving
                logger.exception("engine loop failed; failing %d requests", len(self._requests))
                for request_id in list(self._requests):
                    try:
                        self._fail(request_id, exc)
                    except Exception:  # its client has the error already; forget it rather than fail again
                        self._requests.pop(request_id, None)
        for request_id in list(self._requests):
            self._abort_now(request_id)

    def step(self) -> None:
        """Schedule, run, postprocess: the scheduler decides the batch and what each row yields, the runner picks the
        path and computes the logits, and each sequence takes its token (or its prompt logprobs)."""
        batch = self.scheduler.schedule()
        if not batch.seqs:
            time.sleep(0.001)  # everything waits for blocks that only a finishing sequence can free
            return
        try:
            self._raise_injected_failure()
            logits = self.runner.run(batch)
            self._postprocess(batch, logits)
        except Exception as exc:  # a failure belongs to the requests in this batch; the loop keeps serving
            logger.exception("step failed; failing %d sequences", len(batch))
            for seq in batch.seqs:
                if not seq.is_finished:
                    self._fail(seq.request.request_id, exc)

    def _raise_injected_failure(self) -> None:
        if self._injected_failure is not None:
            with self._lock:
                failure, self._injected_failure = self._injected_failure, None
            raise failure

    def _postprocess(self, batch: ScheduledBatch, logits: StepLogits) -> None:
        for i, chunk_logits in logits.prompt_logits.items():
            seq = batch.seqs[i]
            seq.request.prompt_logprobs.add_chunk(seq.num_computed_tokens, chunk_logits)
        self.scheduler.mark_computed(batch)
        sampling = [seq for seq, s in zip(batch.seqs, batch.samples) if s]
        results = sample(logits.sample_logits, sampling, self.tokenizer.eos_ids) if sampling else []
        for seq, (token_id, logprob) in zip(sampling, results):
            self._append(seq, token_id, logprob)
        for seq, s in zip(batch.seqs, batch.samples):
            # A prompt-only request (max_tokens 0: scoring, echo) ends once its prefill is done.
            if not s and seq.max_tokens == 0 and seq.num_computed_tokens >= seq.num_tokens:
                self._emit(seq, [], "", None, "length")
        self._recent_tokens.append((time.monotonic(), len(results)))
        self._num_steps += 1
        self._num_generated_tokens += len(results)
        while len(self._recent_tokens) > 1000:
            self._recent_tokens.popleft()

    def _admit(self, request: Request, stream: RequestStream) -> None:
        self._requests[request.request_id] = (request, stream)  # first: a failure below is delivered to it
        params = request.params
        max_tokens = self.max_model_len - len(request.prompt_ids) if params.max_tokens is None else params.max_tokens
        for index in range(params.n):
            seed = params.seed + index if params.seed is not None else self._seed_rng.getrandbits(63)
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seed)
            text = OutputText(self.tokenizer, params.stop, request.prompt_ids, params.skip_special_tokens)
            seq = Sequence(next(self._seq_ids), request, index, generator, text)
            seq.max_tokens = max_tokens
            request.sequences.append(seq)
            self.scheduler.add(seq)

    def _append(self, seq: Sequence, token_id: int, logprob: TokenLogprob | None) -> None:
        params = seq.params
        if seq.grammar is not None and not seq.grammar.accept(token_id):  # only if a mask failed: fail this request
            error = GrammarError(f"the grammar refused token {token_id}: {seq.grammar.error}")
            self._fail(seq.request.request_id, error)
            return
        seq.token_ids.append(token_id)
        finish_reason = stop_reason = None
        delta = ""
        if token_id in params.stop_token_ids:
            finish_reason, stop_reason = "stop", token_id
        elif token_id in self.tokenizer.eos_ids and not params.ignore_eos:
            finish_reason = "stop"
        else:
            delta, stopped = seq.output_text.append(token_id)
            if stopped:
                finish_reason, stop_reason = "stop", seq.output_text.stop_reason
        if finish_reason is None and seq.grammar is not None and seq.grammar.is_finished:
            finish_reason = "stop"  # the structured output is complete: nothing but an end could follow
        if finish_reason is None and (seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len):
            finish_reason = "length"
        if finish_reason is not None and not isinstance(stop_reason, str):
            delta += seq.output_text.finish()  # nothing can become a stop string any more: release held text
        self._emit(seq, [token_id], delta, [logprob] if logprob is not None else None, finish_reason, stop_reason)

    def _emit(self, seq, token_ids, text, logprobs, finish_reason, stop_reason=None) -> None:
        request = seq.request
        entry = self._requests.get(request.request_id)
        if entry is None:
            return
        stream = entry[1]
        prompt_logprobs = None if request.prompt_logprobs is None else request.prompt_logprobs.take_for_emit()
        out = RequestOutput(
            request.request_id,
            seq.index,
            token_ids,
            text,
            logprobs,
            finish_reason,
            stop_reason,
            seq.num_prompt_tokens,
            seq.num_output_tokens,
            prompt_logprobs,
        )
        delivered = stream.put(out)
        if finish_reason is not None:
            seq.finish_reason, seq.stop_reason = finish_reason, stop_reason
            self.scheduler.finish(seq)
            request.num_finished += 1
            if request.num_finished == len(request.sequences):
                del self._requests[request.request_id]
                stream.close()
        if not delivered:  # the consumer's event loop is gone: nobody will read the rest
            self._abort_now(request.request_id)

    def _abort_now(self, request_id: str) -> None:
        entry = self._requests.pop(request_id, None)
        if entry is None:
            return
        request, stream = entry
        for seq in request.sequences:
            if not seq.is_finished:
                self.scheduler.finish(seq)
        stream.close()

    def _end_all(self) -> None:
        """Every unfinished sample ends now with FINISH_ABORT, so each consumer sees how its request ended."""
        for request, _ in list(self._requests.values()):
            for seq in request.sequences:
                if not seq.is_finished:
                    self._emit(seq, [], seq.output_text.finish(), None, FINISH_ABORT)

    def _fail(self, request_id: str, exc: Exception) -> None:
        """End a request with the error that stopped it (its consumer raises it) and free its blocks."""
        entry = self._requests.get(request_id)
        if entry is not None:
            error = StepFailedError(
                f"the engine failed while computing this request ({type(exc).__name__}; the server log has the "
                "details). The server goes on serving: the request can be retried."
            )
            error.__cause__ = exc
            entry[1].put(error)
        self._abort_now(request_id)


def _collect(stream: RequestStream) -> Completion:
    completion = Completion(stream.request_id)
    for out in stream:
        completion.add(out)
    return completion
