"""One prompt through the engine, as ``aie generate`` runs it, against stage 09's batch-1 decoder.

``aie generate`` with one prompt runs the engine (stages 06-07: scheduler, paged KV cache,
sampler, streaming detokenizer) with its step compiled ahead of time for one row; before, it ran
``FastDecoder``, a loop of its own. Both now run the same layer (``fast_decode.decode_layer``)
through the same compiler (``AheadOfTime``): the engine adds its bookkeeping, the paged cache's
gather and a head that returns logits to the sampler. The target (the issue "one engine, one fast
path"): the engine's decode rate at least 0.95x the decoder's, for fp32 and bf16 weights and for
stage 08's int8 and int4-g32 (read by the same integer kernels in both: the course's on x86,
``benchmarks/int_kernels.py``).

Each round runs one greedy request of ``--tokens`` tokens (EOS ignored) through each system in
turn; the decoder's decode rate is its tokens after the first over the time from the first token
to the last, the engine's that of ``benchmarks/engine_decode.py`` (its decode steps after the
first two, timed by its own ``StepStats``). The median over ``--rounds`` rounds is kept and the ratio taken within
the run: this machine is shared and its speed drifts. With fp32 weights the greedy tokens must be
the same; with bf16 or quantized weights the two prefills (one contiguous cache, one paged pool
read through a masked attention call) round differently, so a near-tie may go the other way:
the first differing token is reported, not refused.

OpenMP waits as in ``aie generate`` (its default, unless ``OMP_WAIT_POLICY`` is set).

    .venv/bin/python benchmarks/single_prompt.py [--weights fp32,bf16,int8,int4-g32] [--tokens 96] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

from aie_lessons.infra.compile_cache import use_compile_cache  # noqa: E402

use_compile_cache()  # before anything imports inductor
import torch  # noqa: E402
from engine_decode import decode_rate  # noqa: E402  (the engine's decode rate, timed by its own StepStats)

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


def decoder_rate(decoder: FastDecoder, prompt: list[int], params: SamplingParams) -> tuple[float, list[int]]:
    """Decode tokens/s after the first token, and the tokens."""
    tokens, times = [], []
    for token in decoder.tokens(prompt, params):
        tokens.append(token)
        times.append(time.perf_counter())
    return (len(times) - 1) / (times[-1] - times[0]), tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", default="fp32,bf16,int8,int4-g32")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
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
        rates: dict[str, list[float]] = {"decoder": [], "engine": []}
        for _ in range(args.rounds):
            rate, expected = decoder_rate(decoder, prompt, params)
            rates["decoder"].append(rate)
            rate, (tokens,) = decode_rate(engine, [prompt], params)
            rates["engine"].append(rate)
        differ = next((i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b), None)
        if differ is not None and weights == "fp32":
            raise SystemExit("fp32: the engine's greedy tokens differ from the decoder's")
        same = "same tokens" if differ is None else f"tokens differ from token {differ + 1} of {len(tokens)}"
        decoder_median, engine_median = (statistics.median(rates[k]) for k in ("decoder", "engine"))
        rows.append((weights, decoder_median, engine_median, engine_median / decoder_median))
        print(f"{weights:>9}: decoder {decoder_median:6.1f} tok/s, engine {engine_median:6.1f} tok/s, "
              f"engine/decoder {engine_median / decoder_median:.2f} ({same})", flush=True)
    missed = [w for w, *_, ratio in rows if ratio < TARGET]
    print(f"target: engine/decoder >= {TARGET} for each weight kind: "
          + ("met" if not missed else f"NOT met for {', '.join(missed)}"))


if __name__ == "__main__":
    main()
