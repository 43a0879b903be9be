"""Engine: owns model, tokenizer and KV cache; a background thread runs schedule -> run -> postprocess.

Requests enter through submit() from any thread; only the engine thread touches the scheduler, the KV cache and
the model. Each request's outputs travel back through its own RequestStream.
"""
from __future__ import annotations

import atexit
import logging
import threading
import time
import uuid
import weakref

from engine import huge_pages, pooling, scoring
from engine.admission import SequenceFactory, validate_request
from engine.config import EngineConfig, batched_tokens_for
from engine.decode.decode_path import build_runner
from engine.errors import InvalidRequestError
from engine.inbox import Inbox
from engine.info import EngineInfo, EngineStats
from engine.kv_cache import BlockAllocator, KVCache
from engine.kv_plan import plan_kv_cache
from engine.outputs import Completion, ContinuationScore, Embedding
from engine.params import SamplingParams
from engine.postprocess import Postprocessor
from engine.request import Request
from engine.scheduler import Scheduler
from engine.stream import RequestStream
from engine.text.grammar import GrammarCompiler
from engine.text.tokens import TokenizerView
from engine.weights.loader import LoadedModel, load_leaving_a_core

logger = logging.getLogger(__name__)

_PROMPT_ONLY = SamplingParams(max_tokens=0)  # an embedding request: its prompt is prefilled, nothing is sampled

# Engines whose thread may still run. At interpreter exit Python stops daemon threads where they stand; one inside a
# C++ step (or OpenMP's wait) then died by std::terminate ("terminate called without an active exception", exit
# status 134) in a script that never called stop(). Stopping them first lets each thread leave its loop.
_live_engines: weakref.WeakSet[Engine] = weakref.WeakSet()


@atexit.register
def _stop_live_engines() -> None:
    for engine in list(_live_engines):
        engine.stop()


class Engine:
    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None) -> None:
        self.config = config or EngineConfig()
        self._inbox = Inbox(self.config.max_waiting)
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
            if self._inbox.wait_for_start():
                self._loop()

        self._thread: threading.Thread | None = threading.Thread(target=engine_thread, name="tern-engine", daemon=True)
        self._thread.start()
        _live_engines.add(self)
        setup_done.wait()
        if setup_failure:
            self._thread = None
            raise setup_failure[0]

    def _setup(self, loaded: LoadedModel | None) -> None:
        with huge_pages.small_pages_while_loading() as deferred:
            self.loaded = loaded or load_leaving_a_core(self.config)
        model, hf_config = self.loaded.model, self.loaded.hf_config
        self.device, self.dtype = self.loaded.device, self.loaded.dtype
        self.model_name = self.loaded.name
        generation_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        self.tokenizer = TokenizerView(self.loaded.tokenizer, generation_eos or hf_config.eos_token_id)
        self.vocab_size = hf_config.vocab_size
        self.hidden_size = hf_config.get_text_config().hidden_size  # the length of every embedding
        self.pooling = pooling.pooling_rule_for(self.loaded.folder)  # how embeddings are pooled (engine/pooling.py)
        # Structured output: response formats -> grammars, compiled on the callers' threads (never this one).
        self.grammars = GrammarCompiler(self.loaded.tokenizer, self.vocab_size, self.tokenizer.eos_ids)
        plan = plan_kv_cache(self.config, self.loaded)
        self.max_model_len = plan.max_model_len
        self.kv_cache = None
        if plan.kv_args is not None:
            # The tables first: the pool's pages fault in on a thread of their own from here on, and on 2 cores the
            # tables' parallel ops then waited on a thread that had no core (~0.1 s of a start, 10 ms alone).
            model.build_rope_tables(plan.max_model_len, self.device, self.dtype)
            self.kv_cache = KVCache(plan.kv_args[0], plan.num_blocks, *plan.kv_args[1:], plan.dtype, self.device)
        # The weights into huge pages once the pool has faulted in (engine/huge_pages.py): after this, off the start.
        self._weights_settled = (huge_pages.collapse_in_background(huge_pages.weight_tensors(model),
                                                                   after=self.kv_cache and self.kv_cache.wait_resident)
                                 if deferred and loaded is None else None)
        self.allocator = BlockAllocator(plan.num_blocks)
        self.runner = build_runner(self.config, self.loaded, self.kv_cache, self.allocator, self.max_model_len,
                                   self._inbox.wake)
        self.max_num_batched_tokens = self.config.max_num_batched_tokens or batched_tokens_for(
            self.device.type, self.config.max_num_seqs)
        self.scheduler = Scheduler(self.allocator, self.config.block_size, self.config.max_num_seqs,
                                   self.max_num_batched_tokens,
                                   enable_prefix_caching=self.config.enable_prefix_caching and self.loaded.is_native)
        self._sequences = SequenceFactory(self.tokenizer, self.device, self.max_model_len, self.config.seed)
        self._postprocessor = Postprocessor(self.scheduler, self.tokenizer.eos_ids, self.max_model_len)
        logger.info("engine ready: %s (%s, %s, %s), max_model_len %d, %d KV blocks of %d tokens%s, %d tokens per step",
                    self.model_name, "native" if self.loaded.is_native else "generic transformers path", self.device,
                    str(self.dtype).removeprefix("torch."), self.max_model_len, plan.num_blocks, self.config.block_size,
                    f" ({str(plan.dtype).removeprefix('torch.')})" if plan.dtype not in (None, self.dtype) else "",
                    self.max_num_batched_tokens)
        if self.tokenizer.reasoning is not None:
            logger.info("thinking model: %s", self.tokenizer.reasoning.describe())

    def wait_for_compiled_decode(self, timeout_s: float | None = None) -> bool:
        """Block until compiling the decode step has ended (at once when it never started); True when decode
        steps now run compiled. For benchmarks and tests that want the steady state."""
        return self.runner.wait_for_compiled_decode(timeout_s)

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
            kv_cache_dtype=str(self.kv_cache.dtype).removeprefix("torch.") if self.kv_cache is not None else "none",
            kv_cache_resident=self.kv_cache is None or self.kv_cache.wait_resident(0),
            weights_settled=self._weights_settled is None or self._weights_settled.is_set(),
            cpu_kernels=loaded.kernels.describe() if self.device.type == "cpu" else "none (not a CPU)",
            decode_step=self.runner.decode_step, decode_graphs=self.runner.decode_graphs,
            max_model_len=self.max_model_len, max_num_seqs=self.config.max_num_seqs, max_waiting=self.config.max_waiting)

    # Lifecycle.
    def start(self) -> Engine:
        self._inbox.set_running(True)
        if self._thread is None:  # started again after stop(): the setup thread has ended
            self._thread = threading.Thread(target=self._loop, name="tern-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._inbox.set_running(False)
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
            self.runner.stop_compiling()
        # These threads hold the KV pool and the weights: ended here, both go with the engine (None, or unset where
        # _setup failed first). The pool's first: the weights' thread waits for the pool to be resident.
        kv_cache = getattr(self, "kv_cache", None)
        if kv_cache is not None:
            kv_cache.stop_faulting_in()
        collapse = getattr(self, "_weights_settled", None)
        if collapse is not None:
            collapse.stop()

    def drain(self) -> None:
        """Take no new requests from now on (submit() raises DrainingError); those already in run to their end.
        A shutdown drains, waits until has_requests is False or its grace period is over, then calls abort_all()."""
        self._inbox.drain()

    @property
    def is_running(self) -> bool:
        """Whether the step loop is alive: started, not stopped, its thread not dead (a health check asks)."""
        thread = self._thread
        return self._inbox.is_running and thread is not None and thread.is_alive()

    @property
    def is_draining(self) -> bool:
        return self._inbox.is_draining

    @property
    def has_requests(self) -> bool:
        """Whether any request is queued, waiting or running. Any thread may ask."""
        with self._inbox.lock:  # the engine thread admits arrivals under it: none is ever in neither place
            return bool(self._inbox.num_arrivals or self._postprocessor.requests)

    def abort_all(self) -> None:
        """End every request at the engine thread's next turn: each unfinished sample gets a last output with
        finish_reason FINISH_ABORT (its held-back text released) and its KV blocks are freed."""
        self._inbox.abort_all()

    def __enter__(self) -> Engine:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # Public surface.
    def submit(self, prompt: str | list[int], params, request_id: str | None = None) -> RequestStream:
        """Queue a request; returns its stream of RequestOutput deltas. Raises InvalidRequestError subclasses for
        requests that cannot be served, before anything is queued."""
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        validate_request(prompt_ids, params, self.vocab_size, self.max_model_len)
        return self._queue(Request(request_id or uuid.uuid4().hex, prompt_ids, params))

    def submit_embedding(self, prompt: str | list[int], request_id: str | None = None) -> RequestStream:
        """Queue an embedding request: its prompt is prefilled like any other (the same admission, queue limit,
        chunking and abort) and nothing is sampled; its one output carries the vector. Raises as submit() does."""
        if self.pooling.problem is not None:
            raise InvalidRequestError(self.pooling.problem, "model")
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        validate_request(prompt_ids, _PROMPT_ONLY, self.vocab_size, self.max_model_len)
        embedding = pooling.PooledEmbedding(self.pooling, len(prompt_ids))
        return self._queue(Request(request_id or uuid.uuid4().hex, prompt_ids, _PROMPT_ONLY, embedding=embedding))

    def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks at the next step; its stream ends."""
        self._inbox.abort(request_id)

    def generate(self, prompts: list[str | list[int]], params) -> list[Completion]:
        """Blocking convenience for scripts and tests: submit all prompts at once, wait for all."""
        streams = [self.submit(p, params) for p in prompts]
        return [s.collect() for s in streams]

    async def complete(self, prompt: str | list[int], params, request_id: str | None = None) -> Completion:
        return await self.submit(prompt, params, request_id).completion()

    async def score(self, context: str | list[int], continuations: list[str | list[int]]) -> list[ContinuationScore]:
        """Log-likelihood of each continuation after the context, all scored in one batch (engine/scoring.py)."""
        return await scoring.score(self.complete, self.tokenizer, context, continuations)

    async def embed(self, prompts: list[str | list[int]]) -> list[Embedding]:
        """One L2-normalised vector per prompt (text or token ids), all batched at once; pooled as self.pooling says
        (engine/pooling.py). All or none: one refused input refuses them all. Cancelling aborts them."""
        return await pooling.embed(self.submit_embedding, prompts)

    def fail_next_step(self, exc: Exception) -> None:
        """For tests: the next step that runs the model raises `exc` in its place, as a kernel or model bug would.
        Nothing in the server calls it. The requests of that step end with a StepFailedError; the rest go on."""
        self._inbox.fail_next_step(exc)

    def stats(self) -> EngineStats:
        # The warm-up's blocks are no request's: a client counting leaked blocks must not see them (minutes on a
        # small CPU, while the compiled step builds in the background).
        reserved = self.runner.num_reserved_blocks
        return EngineStats(
            len(self.scheduler.running), len(self.scheduler.waiting) + self._inbox.num_arrivals,
            self.allocator.num_used - reserved, self.allocator.num_free, self.scheduler.num_preemptions,
            self._postprocessor.tokens_per_s(), self.allocator.num_cached_hits, self._postprocessor.num_steps,
            self._postprocessor.num_generated_tokens, reserved, dict(self.runner.decode_steps))

    def cached_prefix_hashes(self) -> list[bytes]:
        """Hashes of the KV blocks the prefix cache holds (engine/kv_cache.py block_hash: each chained to the blocks
        before it), so a router in front of several engines can tell which one holds a prompt's prefix."""
        return self.allocator.cached_hashes()

    # Engine thread.
    def _loop(self) -> None:
        while True:
            try:
                mail = self._inbox.take(self._has_work, self._admit)
                if mail is None:
                    break
                for request_id in mail.aborts:
                    self._postprocessor.abort(request_id)
                if mail.abort_all:
                    self._postprocessor.finish_all_as_aborted()
                self.runner.free_reserved_blocks()
                if self.scheduler.has_work:
                    self.step()
            except Exception as exc:  # a bug outside any one step: fail what is in flight rather than stop serving
                logger.exception("engine loop failed; failing %d requests", len(self._postprocessor.requests))
                self._postprocessor.fail_all(exc)
        self._postprocessor.close_all()

    def step(self) -> None:
        """Schedule, run, postprocess: the scheduler decides the batch and what each row yields, the runner picks the
        path and computes the logits, and each sequence takes its token (or its prompt logprobs)."""
        batch = self.scheduler.schedule()
        if not batch.seqs:
            time.sleep(0.001)  # everything waits for blocks that only a finishing sequence can free
            return
        try:
            self._inbox.raise_injected_failure()
            logits = self.runner.run(batch)
            self._postprocessor.postprocess(batch, logits)
        except Exception as exc:  # a failure belongs to the requests in this batch; the loop keeps serving
            logger.exception("step failed; failing %d sequences", len(batch))
            for seq in batch.seqs:
                if not seq.is_finished:
                    self._postprocessor.fail(seq.request.request_id, exc)

    def _queue(self, request: Request) -> RequestStream:
        stream = RequestStream(request.request_id, self.abort)
        self._inbox.put(request, stream, len(self.scheduler.waiting))
        return stream

    def _has_work(self) -> bool:
        return self.runner.has_reserved_blocks_to_free or self.scheduler.has_work

    def _admit(self, request: Request, stream: RequestStream) -> None:
        self._postprocessor.track(request, stream)
        for seq in self._sequences.sequences(request):
            request.sequences.append(seq)
            self.scheduler.add(seq)

