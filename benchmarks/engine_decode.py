"""The engine's decode step, compiled per batch-size bucket (stage 09), against the eager engine
(stage 07's ``paged_engine``), with 1, 4 and 16 requests decoding at once, fp32 and bf16 weights.

Each system serves the same prompts (``--new-tokens`` greedy tokens each, ignoring EOS, all
arriving together) and is timed over the steps in which every request decodes, from the engine's
own ``StepStats`` (scheduling, preparing, sampling and postprocessing included: the whole step).
The two engines alternate for ``--rounds`` rounds and the median of each is kept: this machine is
shared and its speed drifts, so every ratio is taken within one run. Run the script several times.

The compiled engine is built as ``aie serve`` builds it (``build_engine``): with bf16 weights it
multiplies in bf16 where a bf16 product is measured no slower than an fp32 one here, and in fp32
otherwise, saying so. The compiled fp32 engine must keep the eager engine's greedy tokens; with
bf16 weights the compiled products may round the activations to bf16 while the eager engine
converts the weights to fp32, so its tokens may differ and are only counted.

The target (from the course's profiling issue): the compiled engine at 16 running requests
≥ 1.5× the eager engine. In fp32 most of a 16-row step is its thin matrix products (16 rows by
576-column matrices, far below the BLAS library's peak on large squares), and compiling only
removes what lies between them: the products are timed alone and the bound they set is printed.

OpenMP waits as ``aie generate`` and ``aie serve`` let it (its default, unless
``OMP_WAIT_POLICY`` is set), like every benchmark here.

    .venv/bin/python benchmarks/engine_decode.py [--rows 1,4,16] [--new-tokens 64] [--rounds 3] [--device cuda]
"""

from __future__ import annotations

import argparse
import statistics
import time

from aie_lessons.infra.compile_cache import use_compile_cache  # noqa: E402

use_compile_cache()  # what torch.compile builds goes to data/cache/inductor, a folder per ATEN_CPU_CAPABILITY
import torch  # noqa: E402

from aie_lessons.ceilings import products_seconds  # noqa: E402
from aie_lessons.engine.engine_config import EngineConfig, build_engine  # noqa: E402
from aie_lessons.engine.engine import Engine, drive  # noqa: E402
from aie_lessons.engine.paged_engine import paged_engine  # noqa: E402
from aie_lessons.fast_decode import decode_groups  # noqa: E402
from aie_lessons.infra.paths import default_model_dir  # noqa: E402
from aie_lessons.model import LlamaModel  # noqa: E402
from aie_lessons.sampling import SamplingParams  # noqa: E402
from aie_lessons.tokenizer import Tokenizer  # noqa: E402

TARGET = 1.5  # compiled / eager at 16 running requests
KV_BYTES = 256 * 2**20


def decode_rate(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> tuple[float, list[list[int]]]:
    """Decode tokens/s over the steps in which every request decodes (the first two dropped), and the tokens."""
    first = len(engine.stats)
    requests = [engine.add_request(prompt, params) for prompt in prompts]
    drive(engine)
    decoding = [s for s in engine.stats[first:] if s.prefill_tokens == 0][2:]
    if not decoding:
        raise SystemExit("no decode steps were timed. Fix: a larger --new-tokens")
    return sum(s.decode_rows for s in decoding) / sum(s.total_s for s in decoding), [r.output_ids for r in requests]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,4,16", help="running requests to measure, comma-separated")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (then `--rows 1,16,64` is worth a look)")
    args = parser.parse_args()
    rows = sorted(int(r) for r in args.rows.split(","))
    if args.new_tokens < 4 or args.rounds < 1 or rows[0] < 1:
        parser.error("--new-tokens must be at least 4, --rounds and every --rows value at least 1")
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        print("skipped: --device cuda, and there is no CUDA GPU on this machine (--device cpu measures the CPU)")
        return
    model_dir = default_model_dir()
    tokenizer = Tokenizer.from_pretrained(model_dir)
    prompts = [tokenizer.encode(f"Lighthouse fact number {i}:") for i in range(rows[-1])]
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    speed: dict[tuple[str, int, str], float] = {}
    notes: dict[tuple[str, int], str] = {}
    products: list[float] = []  # seconds of a largest-batch fp32 step's products alone, one per round
    for weights, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        model = LlamaModel.from_pretrained(model_dir, dtype=dtype, device=args.device)
        eager = paged_engine(model, tokenizer, max_seqs=rows[-1], kv_bytes=KV_BYTES)
        config = EngineConfig(max_seqs=rows[-1], kv_bytes=KV_BYTES, step="compiled", buckets=tuple(rows))
        compiled = build_engine(model, tokenizer, config, on_note=lambda note: print(f"{weights}: {note}"))
        matrices = [torch.cat(group) for group in decode_groups(model)]  # the step's products, timed alone
        start = time.perf_counter()
        compiled.runner.warm_up()
        print(f"{weights}: compiled buckets {compiled.runner.buckets} in {time.perf_counter() - start:.0f} s "
              f"(or loaded from inductor's cache), products in {compiled.runner.block.dtype}", flush=True)
        for running in rows:
            rates: dict[str, list[float]] = {"eager": [], "compiled": []}
            tokens = {}
            for round_ in range(args.rounds):
                pair = (("eager", eager), ("compiled", compiled))
                for kind, engine in pair if round_ % 2 == 0 else pair[::-1]:  # neither always first
                    rate, tokens[kind] = decode_rate(engine, prompts[:running], params)
                    rates[kind].append(rate)
                if weights == "fp32" and running == rows[-1]:  # in the same rounds, as the machine drifts
                    products.append(products_seconds(matrices, running))
            for kind, values in rates.items():
                speed[weights, running, kind] = statistics.median(values)
            same = sum(a == b for a, b in zip(tokens["eager"], tokens["compiled"]))
            if weights == "fp32" and same != running:
                raise SystemExit(f"the compiled fp32 engine changed the tokens of {running - same} of {running} "
                                 "requests: a speed measured on wrong output is no speed")
            notes[weights, running] = f"{same}/{running} requests with the same tokens"
            print(f"{weights}, {running:>2} running: eager {speed[weights, running, 'eager']:7.1f} tok/s, compiled "
                  f"{speed[weights, running, 'compiled']:7.1f}; {notes[weights, running]}", flush=True)
        del model, eager, compiled, matrices
    print()
    print(f"{'ratio':<44}" + "".join(f"{r:>8} running" for r in rows))
    lines = {"compiled fp32 / eager fp32": ("fp32", "fp32"), "compiled bf16 / eager bf16": ("bf16", "bf16"),
             "compiled bf16 / eager fp32 (stage 07's engine)": ("bf16", "fp32")}
    for name, (mine, theirs) in lines.items():
        print(f"{name:<44}" + "".join(f"{speed[mine, r, 'compiled'] / speed[theirs, r, 'eager']:>16.2f}" for r in rows))
    largest = rows[-1]
    alone = statistics.median(products)
    eager_step, compiled_step = (largest / speed["fp32", largest, kind] for kind in ("eager", "compiled"))
    print(f"\nfp32 at {largest} rows: the step's products alone take {alone * 1e3:.1f} ms, the eager step "
          f"{eager_step * 1e3:.1f} ms, the compiled step {compiled_step * 1e3:.1f} ms: compiling what lies between the "
          f"products can give at most {eager_step / alone:.2f}x")
    if largest != 16:
        print("target: judged at 16 running requests; add 16 to --rows to judge it")
        return
    ratios = {w: speed[w, largest, "compiled"] / speed[w, largest, "eager"] for w in ("fp32", "bf16")}
    met = [w for w, ratio in ratios.items() if ratio >= TARGET]
    print(f"target: compiled ≥ {TARGET}x eager at 16 running, the same weights: "
          + ", ".join(f"{w} {ratio:.2f}x" for w, ratio in ratios.items())
          + (f" — met with {' and '.join(met)} weights" if met else " — MISSED"))


if __name__ == "__main__":
    main()
