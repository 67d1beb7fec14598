"""One prompt through the engine, as ``aie generate`` runs it, against stage 09's batch-1 decoder.

``aie generate`` with one prompt runs the engine (stages 06-07: scheduler, paged KV cache,
sampler, streaming detokenizer) with its step compiled ahead of time for one row; before, it ran
``FastDecoder``, a loop of its own. Both now run the same layer (``fast_decode.decode_layer``)
through the same compiler (``AheadOfTime``): the engine adds its bookkeeping, the paged cache's
gather and a head that returns logits to the sampler. The target (the issue "one engine, one fast
path"): the engine's decode rate at least 0.95x the decoder's, for fp32 and bf16 weights and for
stage 08's int8 and int4-g32 (read by the same integer kernels in both: the course's on x86,
``benchmarks/int_kernels.py``).

Each round runs one greedy request of ``--tokens`` tokens (EOS ignored) through both systems at
once, a step of one, then a step of the other: the decoder's ``next()`` and the engine's
``step()`` (all of it: scheduling, preparing, sampling, postprocessing), each timed by the wall
clock. Taking turns by step rather than by request matters here: this machine is shared and its
speed moves by tens of percent between seconds, which whole requests in turn (a second or so
each) would read as a difference between the two; and which goes first alternates. A round's
rate is the median of its decode steps (the prefill and the first decode step of each left
out), its ratio that of the two medians, taken over the same moments; the median of the rounds'
ratios is the result. With fp32
weights the greedy tokens must be the same; with bf16 or quantized weights the two prefills (one
contiguous cache, one paged pool read through a masked attention call) round differently, so a
near-tie may go the other way: the first differing token is reported, not refused.

OpenMP waits as in ``aie generate`` (its default, unless ``OMP_WAIT_POLICY`` is set).

    .venv/bin/python benchmarks/single_prompt.py [--weights fp32,bf16,int8,int4-g32] [--tokens 96] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Iterator

from aie_lessons.infra.compile_cache import use_compile_cache  # noqa: E402

use_compile_cache()  # before anything imports inductor
import torch  # noqa: E402
from decode import in_turns  # noqa: E402  (benchmarks/decode.py: two token streams timed in turns)

from aie_lessons.engine.engine import Engine  # noqa: E402
from aie_lessons.engine.engine_config import EngineConfig, build_engine, compile_buckets  # noqa: E402
from aie_lessons.fast_decode import FastDecoder, QuantizedFastDecoder  # noqa: E402
from aie_lessons.infra.ahead_of_time import AheadOfTime  # noqa: E402
from aie_lessons.infra.paths import default_model_dir  # noqa: E402
from aie_lessons.model import LlamaModel  # noqa: E402
from aie_lessons.quantize import quantize_model  # noqa: E402
from aie_lessons.sampling import SamplingParams  # noqa: E402
from aie_lessons.tokenizer import Tokenizer  # noqa: E402

TARGET = 0.95
PROMPT = "Write a long story about a lighthouse keeper and the sea."


def load(weights: str) -> LlamaModel:
    """The course model with ``weights``: fp32, bf16, or a stage 08 scheme over bf16 (whose
    unquantized head then reads half fp32's bytes, as ``aie generate --quant`` loads it)."""
    dtype = torch.float32 if weights == "fp32" else torch.bfloat16
    model = LlamaModel.from_pretrained(default_model_dir(), dtype=dtype)
    return model if weights in ("fp32", "bf16") else quantize_model(model, weights)


def engine_tokens(engine: Engine, prompt: list[int], params: SamplingParams) -> Iterator[int]:
    """One request through the engine, a step (and its token) per ``next()``, as the decoder yields
    them: the first ``next()`` runs the prefill."""
    request = engine.add_request(prompt, params)
    for i in range(params.max_new_tokens):
        engine.step()
        if len(request.output_ids) != i + 1:  # the prompt did not fit one step: steps and tokens out of line
            raise SystemExit(f"the engine's step {i + 1} made {len(request.output_ids)} tokens, not {i + 1}. Fix: "
                             "a shorter prompt, or a larger token budget")
        yield request.output_ids[-1]


def side_by_side(decoder: FastDecoder, engine: Engine, prompt: list[int],
                 params: SamplingParams) -> tuple[float, float, list[int], list[int]]:
    """One request through both, a step of each in turn (``decode.in_turns``, turns of one step:
    both run on PyTorch's threads): the median decode step's tokens/s of the decoder and of the
    engine, and the tokens of each."""
    steps = in_turns({"decoder": decoder.tokens(prompt, params), "engine": engine_tokens(engine, prompt, params)},
                     params.max_new_tokens, turn=1)
    while engine.has_work():  # nothing is left to compute; the request's end may be left to report
        engine.step()
    (decoder_seconds, expected), (engine_seconds, tokens) = steps["decoder"], steps["engine"]
    return 1 / decoder_seconds, 1 / engine_seconds, expected, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", default="fp32,bf16,int8,int4-g32")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.tokens < 4 or args.rounds < 1:
        parser.error("--tokens must be at least 4 (the first two steps are not timed), --rounds at least 1")
    tokenizer = Tokenizer.from_pretrained(default_model_dir())
    prompt = tokenizer.encode_chat(PROMPT)
    params = SamplingParams(max_new_tokens=args.tokens, ignore_eos=True)
    print(f"one greedy request of {args.tokens} tokens after a {len(prompt)}-token prompt; "
          f"{torch.get_num_threads()} threads; median of {args.rounds} rounds")
    rows = []
    for weights in args.weights.split(","):
        model = load(weights)
        compiler = AheadOfTime()
        quantized = weights not in ("fp32", "bf16")
        decoder = (QuantizedFastDecoder if quantized else FastDecoder)(model, compile=compiler)
        decoder.warm_up(params)
        engine = build_engine(model, tokenizer, EngineConfig(max_seqs=1, kv_bytes=64 * 2**20, step="compiled"),
                              compiler=compiler)
        compile_buckets(engine)
        rounds = [side_by_side(decoder, engine, prompt, params) for _ in range(args.rounds)]
        expected, tokens = rounds[-1][2:]
        differ = next((i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b), None)
        if differ is not None and weights == "fp32":
            raise SystemExit("fp32: the engine's greedy tokens differ from the decoder's")
        same = "same tokens" if differ is None else f"tokens differ from token {differ + 1} of {len(tokens)}"
        ratios = [engine_rate / decoder_rate for decoder_rate, engine_rate, *_ in rounds]
        ratio = statistics.median(ratios)
        rows.append((weights, ratio))
        print(f"{weights:>9}: decoder {statistics.median(r[0] for r in rounds):6.1f} tok/s, engine "
              f"{statistics.median(r[1] for r in rounds):6.1f} tok/s, engine/decoder {ratio:.2f} (rounds: "
              f"{', '.join(f'{r:.2f}' for r in ratios)}; {same})", flush=True)
    missed = [w for w, ratio in rows if ratio < TARGET]
    print(f"target: engine/decoder >= {TARGET} for each weight kind: "
          + ("met" if not missed else f"NOT met for {', '.join(missed)}"))


if __name__ == "__main__":
    main()
