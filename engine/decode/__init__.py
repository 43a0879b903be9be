"""How a step runs: the decode path decided once (eager, compiled, native C++ step, CUDA graphs) and the runners that
turn a scheduled batch into logits."""
