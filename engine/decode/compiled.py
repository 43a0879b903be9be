"""The decode step under torch.compile: the eager model's ~60 small ops per layer fused into a few kernels.

At batch 1 on a small model the eager step spends about as long launching ops from Python as reading weights;
compiled, the default model's int8 single stream went from 27 to 49 tok/s on a 2-core CPU. Only decode steps
(every sequence adds one token, the steady state of serving) run compiled. Prefill and mixed steps run the
eager model, the compiled step's twin, which the tests compare it against token for token.

Compiling takes minutes on a small CPU. There the runner serves with the eager step at once and CompiledDecode
builds the compiled one on a thread of its own, whose warm-up decodes fake sequences in a few reserved KV blocks;
the compiled step takes over at the next step once it is ready. Stopping the engine interrupts the build
(CompiledDecode.cancel), so an unload, a shutdown or a script's exit does not wait out a graph: a server stopped
by SIGTERM while it compiled exited in 2.5 s where it took 54. On CUDA it is compiled before serving, because
the CUDA graphs capture it: the compiled step is what engine/decode/cuda_graphs.py captures, one graph per (batch,
context) bucket.

Sizes that change every step (number of sequences, context length) are marked dynamic, so one graph serves
every step of a regime. Torch still specializes a size of 1, and the int8 kernel choice depends on the batch
size, so warm-up compiles each regime once before the first request rather than in the middle of one.
"""
from __future__ import annotations

import ctypes
import logging
import os
import shutil
import sys
import threading
from dataclasses import dataclass
from typing import Callable

import torch

from engine.kv_cache import BlockAllocator
from engine.models.attention import AttentionMetadata

logger = logging.getLogger(__name__)

# Quantizations whose layers trace without graph breaks (bitsandbytes layers call into a C library). int4 is one
# of them, though engine/decode/cuda_graphs.py never captures it: it runs on CPUs only.
COMPILABLE_QUANTIZATIONS = ("none", "int8", "int4")


def unsupported_reason(device: torch.device, quantization: str) -> str | None:
    """None when the native model's decode step can be compiled here, else why not (it then runs eager)."""
    if device.type not in ("cpu", "cuda"):
        return f"compiled decode is verified on CPU and CUDA only; {device.type} runs eager"
    if quantization not in COMPILABLE_QUANTIZATIONS:
        return f"--quantization {quantization} layers do not trace; they run eager"
    if device.type == "cpu" and not (os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")):
        return "no C++ compiler (g++) for torch's CPU code generator"
    return None


class CompiledDecode:
    """The compiled decode step and its build, held by the runner that serves it.

    On CUDA it is built at once, before serving (the graphs capture it). On CPU, where that takes minutes, it is
    built on a thread of its own while the eager step serves, and takes over at the next step once ready. Its
    warm-up decodes fake sequences into KV blocks reserved for it, so it never touches a request's. Only the
    engine thread touches the allocator: it frees them (free_blocks) once the build has ended; `on_done`, called
    from the build's thread, wakes it for that.
    """

    def __init__(self, model, warm_up: Callable[[Callable, list[int]], None], allocator: BlockAllocator,
                 in_background: bool, on_done: Callable[[], None]) -> None:
        self.forward: Callable | None = None  # the compiled forward once warmed up; a step reads it once
        self._allocator = allocator
        self._on_done = on_done
        self._done = threading.Event()
        self._cancelled = threading.Event()
        self._interrupt_lock = threading.Lock()
        self._compiling_thread: int | None = None  # the build's thread while cancel() may still interrupt it
        compiled_forward = compile_forward(model)
        self._blocks = allocator.allocate(min(WARMUP_BLOCKS, allocator.num_free))
        if not in_background:
            self._build(compiled_forward, warm_up)
            self.free_blocks()
            return
        trace_once_before_serving()  # before the compile thread can: it would break concurrent eager steps
        logger.info("serving with the eager decode step while the compiled one builds (a few minutes on the "
                    "first start, ~20 s later: inductor caches its kernels)")
        threading.Thread(target=self._build, args=(compiled_forward, warm_up), name="tern-compile",
                         daemon=True).start()

    @property
    def state(self) -> str:
        """`compiled`, `compiling` (the eager step serves meanwhile), or `eager` (the build failed)."""
        if self.forward is not None:
            return "compiled"
        return "eager" if self._done.is_set() else "compiling"

    @property
    def num_reserved_blocks(self) -> int:
        return len(self._blocks)

    @property
    def has_blocks_to_free(self) -> bool:
        """Whether the build has ended and its warm-up blocks wait for the engine thread to free them."""
        return bool(self._blocks) and self._done.is_set()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until the build has ended; True when decode steps now run compiled."""
        self._done.wait(timeout_s)
        return self.forward is not None

    def cancel(self) -> None:
        """End the build and wait for its thread. Torch has no way to stop a compile, and one graph takes from ~20 s
        to minutes on 2 cores, which a stop, an unload or a script's exit used to wait out. So the build's thread
        is interrupted: CompileInterrupted raised in it at its next Python instruction (within a C++ compiler run,
        once that returns). Its thread must still not outlive the engine: at the interpreter's exit, a daemon thread
        inside torch aborted the process (std::terminate, exit status 134) when it asked for the GIL back."""
        self._cancelled.set()
        with self._interrupt_lock:
            if self._compiling_thread is not None:
                _raise_in_thread(self._compiling_thread, CompileInterrupted)
                self._compiling_thread = None  # once: a second one could land in the first one's handler
        self._done.wait()

    def free_blocks(self) -> None:
        """Engine thread: give the warm-up's blocks back to the allocator once the build has ended."""
        if self.has_blocks_to_free:
            self._allocator.free(self._blocks)
            self._blocks = []

    def _build(self, compiled_forward, warm_up) -> None:
        """Warm the compiled step up in the reserved blocks, then hand it over; a compiler problem costs speed,
        never the server."""
        # The eager step gives up the GIL in every torch op and waits for it back; with the compiler's tracing
        # holding it, each wait lasts up to the switch interval (5 ms): 20 tokens took 37 s while compiling, and
        # 2.7 s with 0.1 ms.
        switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(min(switch_interval, 1e-4))
        try:
            allow_recompiles()
            # (Built before serving, on CUDA, no cancel() can come while it compiles: it never raises there.)
            try:
                with self._interrupt_lock:
                    self._compiling_thread = threading.get_ident()
                if warm_up(compiled_forward, self._blocks, self._cancelled.is_set):
                    self.forward = compiled_forward
            finally:
                with self._interrupt_lock:  # from here on cancel() raises nothing, and one on its way is withdrawn
                    self._compiling_thread = None
                    _raise_in_thread(threading.get_ident(), None)
        except CompileInterrupted:
            logger.info("compiling the decode step stopped with the engine (interrupted)")
        except Exception as exc:
            if self._cancelled.is_set():  # e.g. at exit, where inductor's compile pool refuses new work
                logger.info("compiling the decode step stopped with the engine (%s)", type(exc).__name__)
            else:
                logger.warning("compiling the decode step failed, running eager: %s: %s", type(exc).__name__, exc)
        finally:
            sys.setswitchinterval(switch_interval)
        self._done.set()
        self._on_done()


class CompileInterrupted(BaseException):
    """Raised in a background build's thread by cancel(). A BaseException, so that torch's own `except Exception`
    handlers (which wrap a compiler's errors and may retry) let it through to the build."""


def _raise_in_thread(thread_id: int, exception: type[BaseException] | None) -> None:
    """Raise `exception` in thread `thread_id` at its next Python instruction (None: withdraw one not yet raised)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id),
                                               ctypes.py_object(exception) if exception is not None else None)


def compile_forward(model):
    """model.forward compiled for decode steps; the eager forward stays on the model as its twin. Inductor
    caches the compiled kernels on disk (TORCHINDUCTOR_CACHE_DIR), so a restart mostly just traces again."""
    allow_recompiles()
    # emulate_precision_casts: round to bf16 wherever eager does, so greedy tokens match the eager step.
    return torch.compile(model.forward, fullgraph=True, options={"emulate_precision_casts": True})


def trace_once_before_serving() -> None:
    """Do on the calling thread (the engine's, before it serves) what inductor does once per process on the first
    compile: symbolically trace a placeholder function (torch._inductor.loop_body.InterpreterShim._dummy_gm) with
    torch.fx's base Tracer. While that Tracer runs it patches nn.Module.__call__ and __getattr__ for every thread,
    so an eager step on the engine thread at that moment fails ("NameError: module is not installed as a
    submodule": seen under load while the compiled step built in the background). Done here, the compile thread
    finds it cached. The tracers the compile itself uses (make_fx's) pass module calls and attributes through."""
    try:
        from torch._inductor.loop_body import InterpreterShim

        InterpreterShim._dummy_gm()
    except Exception as exc:  # another torch may not have it; the hazard would then be elsewhere or gone
        logger.warning("could not trace inductor's placeholder ahead of the background compile: %s: %s",
                       type(exc).__name__, exc)


def allow_recompiles() -> None:
    """Raise dynamo's recompile limit for the calling thread (its config is per thread): dynamo counts graphs
    per code object, and every engine in a process compiles the same forward() (three graphs each), so the
    default limit of 8 would send the third engine of a test run back to eager. Call it on every thread that
    runs the compiled forward."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)


def mark_dynamic(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
    """Let the number of sequences and the context length vary without recompiling."""
    marks = [(input_ids, 0), (positions, 0), (meta.slot_mapping, 0)]
    for group in meta.groups:
        marks += [(group.context_slots, 0), (group.context_slots, 1)]
        if group.context_lens is not None:
            marks.append((group.context_lens, 0))
        if group.attn_mask is not None:
            marks += [(group.attn_mask, 0), (group.attn_mask, 3)]
    for tensor, dim in marks:
        if tensor.shape[dim] > 1:  # torch specializes sizes 0 and 1 whatever we ask
            torch._dynamo.maybe_mark_dynamic(tensor, dim)


@dataclass
class WarmupSequence:
    """Just what ModelRunner reads of a Sequence: a fake decode in the cache's first blocks, before any
    request has a block (whatever it writes there is overwritten before anything reads it)."""

    token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]


def warmup_batch_sizes(max_num_seqs: int) -> list[int]:
    """One batch size per regime: 1 (specialized), 2 (the general graph), and the largest allowed, which
    crosses the int8 kernel's row limit when max_num_seqs is above it."""
    return sorted({1, min(2, max_num_seqs), max_num_seqs})


WARMUP_BLOCKS = 3  # KV blocks the warm-up's fake sequences write into (reserved while it runs)


def warmup_context_len(batch_sizes: list[int], block_size: int, num_blocks: int) -> int:
    """A context length that fits `num_blocks` blocks and equals no batch size: torch gives equal sizes one
    symbol while tracing, which would tie the graph to batch size == context length."""
    length = min(2 * block_size + 3, num_blocks * block_size)
    while length in batch_sizes and length > 2:
        length -= 1
    return length
