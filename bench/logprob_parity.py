"""How far a prompt token's logprob is from the logprob the same token got when generated, per quantization mode.

    .venv/bin/python bench/logprob_parity.py [--modes auto int4 ...] [--dtypes float32 bfloat16] [--prompts 3]
    TERN_CPU_KERNELS=avx2 .venv/bin/python bench/logprob_parity.py     # another kernel path

For each mode and dtype, on the default model (or --model): greedy-generate --generate tokens after each of
--prompts random prompts of --prompt-tokens tokens, with logprobs; send prompt + generated text back with echo
(prompt_logprobs) and report the largest difference over the generated tokens, in nats, with the decode step and
whether prompts prefilled as decode rows. Each mode runs in a process of its own (a model's weights at a time),
once its decode step is compiled where it compiles, as the server serves.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODES = ["auto", "int4", "int8", "none", "bnb-int8", "bnb-nf4", "bnb-fp4"]

CHILD = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from engine import Engine, EngineConfig, SamplingParams
args = json.loads(sys.argv[2])
engine = Engine(EngineConfig.serving(model=args["model"], quantization=args["mode"], dtype=args["dtype"])).start()
try:
    # As the server does before it serves (engine/model_slot.py): the compiled step rounds otherwise than the eager
    # one in bf16, so a request straddling the hand-over would mix the two.
    engine.wait_for_compiled_decode()
    worst = 0.0
    for seed in range(args["prompts"]):
        prompt = torch.randint(3, 20000, (args["prompt_tokens"],), generator=torch.Generator().manual_seed(seed)).tolist()
        params = SamplingParams(temperature=0, max_tokens=args["generate"], ignore_eos=True, logprobs=0)
        generated = engine.generate([prompt], params)[0].choices[0]
        echo = engine.generate([prompt + generated.token_ids], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
        echoed = [entry.logprob for entry in echo.prompt_logprobs[len(prompt):]]
        worst = max([worst] + [abs(a - b.logprob) for a, b in zip(echoed, generated.logprobs)])
    info = engine.info()
    print(json.dumps({"gap": worst, "served": engine.loaded.quantization, "step": info.decode_step,
                      "rows": engine.runner.path.prefills_as_decode_rows,
                      "kernels": engine.loaded.kernels.path if engine.loaded.kernels else "-"}))
finally:
    engine.stop()
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint folder or .gguf (default: the default model)")
    parser.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=60)
    parser.add_argument("--generate", type=int, default=30)
    args = parser.parse_args()
    print(f"TERN_CPU_KERNELS={os.environ.get('TERN_CPU_KERNELS', '(auto)')}; {args.prompts} prompts of "
          f"{args.prompt_tokens} tokens, {args.generate} generated; the worst token's |echoed - generated| logprob\n")
    print("| mode | dtype | served as | kernel path | decode step | prompts as decode rows | gap (nats) |")
    print("|---|---|---|---|---|---|---|")
    for mode in args.modes:
        for dtype in (["auto"] if mode == "auto" else args.dtypes):
            config = {"model": args.model, "mode": mode, "dtype": dtype, "prompts": args.prompts,
                      "prompt_tokens": args.prompt_tokens, "generate": args.generate}
            done = subprocess.run([sys.executable, "-c", CHILD, str(ROOT), json.dumps(config)], capture_output=True,
                                  text=True)
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            if done.returncode != 0 or not lines:
                reason = (done.stderr.strip().splitlines() or ["no output"])[-1]
                print(f"| {mode} | {dtype} | cannot run here: {reason} | | | | |")
                continue
            result = json.loads(lines[-1])
            print(f"| {mode} | {dtype} | {result['served']} | {result['kernels']} | {result['step']} | "
                  f"{'yes' if result['rows'] else 'no'} | {result['gap']:.4f} |", flush=True)


if __name__ == "__main__":
    main()
