"""Batch-1 greedy decode speed: our engine (fp32, bf16) vs transformers vs the memory roofline.

"Ours" is stage 04's ``FastDecoder`` (fused weights, compiled step); stage 04's plain
``generate_cached`` is shown too, for the size of the step. Decoding one token reads every
weight once, so the roofline is bandwidth / bytes of weights per token. This machine's memory
bandwidth drifts from second to second, so everything is measured in one process, interleaved
round by round; the bandwidth probe runs just before and just after "ours fp32"; and each
ratio is taken within a round, from runs seconds apart, then the median over rounds is shown.

    .venv/bin/python benchmarks/decode.py [--tokens 128] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

from aie_lessons.cached_generate import generate_cached
from aie_lessons.fast_decode import FastDecoder, huge_page_empty
from aie_lessons.generate import SamplingParams
from aie_lessons.model import LlamaModel
from aie_lessons.paths import default_model_dir
from aie_lessons.tokenizer import Tokenizer

PROMPT = "Write a long story about a lighthouse keeper and the sea."
PROBE_BYTES = 512 * 2**20
TARGETS = {  # from the course's decode-speed issue
    "ours fp32 / transformers fp32": 2.5,
    "ours fp32 / fp32 roofline": 0.75,
    "ours bf16 / ours fp32": 1.6,
}


def copy_bandwidth(repeats: int = 5) -> float:
    """Bytes per second moved by a large tensor copy (bytes read + bytes written), best of all.

    Copies in ordinary 4 KB pages and in the 2 MB pages that hold the fast decoder's weights
    (``huge_page_empty``), which stream faster on many machines: the better of the two is
    the roofline, so our engine gets no credit for memory the probe could not use as well.
    """
    return max(page_copy_bandwidth(huge_pages, repeats) for huge_pages in (False, True))


def page_copy_bandwidth(huge_pages: bool, repeats: int) -> float:
    """``copy_bandwidth`` in one kind of memory."""
    numel = PROBE_BYTES // 4
    source, target = (huge_page_empty(numel, torch.float32) if huge_pages else torch.empty(numel)
                      for _ in range(2))
    source.fill_(1.0)
    target.zero_()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - start)
    return 2 * PROBE_BYTES / best


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes read per decoded token: every parameter once (the tied head is the embedding)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def decode_speed(generate, tokens: int) -> float:
    """Decode tokens/s of one request; ``generate(params)`` returns its GenerationResult."""
    result = generate(SamplingParams(max_new_tokens=tokens, ignore_eos=True))
    assert len(result.token_ids) == tokens
    decode = result.step_seconds[1:]  # [0] is the prefill
    return len(decode) / sum(decode)


def transformers_speed(model, prompt_ids, tokens: int, pad_id: int) -> float:
    """Decode tokens/s of ``generate``: its total time minus one prefill, timed alone."""
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        start = time.perf_counter()
        model(ids)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                             pad_token_id=pad_id)
        total = time.perf_counter() - start
    assert out.shape[1] - ids.shape[1] == tokens
    return (tokens - 1) / max(total - prefill, 1e-9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    import transformers

    warnings.filterwarnings("ignore")
    model_dir = default_model_dir()
    tokenizer = Tokenizer.from_pretrained(model_dir)
    prompt_ids = tokenizer.encode_chat(PROMPT)
    fp32 = LlamaModel.from_pretrained(model_dir, dtype=torch.float32)
    bf16 = LlamaModel.from_pretrained(model_dir, dtype=torch.bfloat16)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    fast_fp32, fast_bf16 = FastDecoder(fp32), FastDecoder(bf16)
    systems = {
        "ours fp32": lambda p: fast_fp32.generate(tokenizer, prompt_ids, p),
        "ours bf16": lambda p: fast_bf16.generate(tokenizer, prompt_ids, p),
        "generate_cached fp32": lambda p: generate_cached(fp32, tokenizer, [prompt_ids], p)[0],
    }
    print("compiling the fast decoders (not timed) ...", flush=True)
    start = time.perf_counter()
    warm = {name: run(SamplingParams(max_new_tokens=args.tokens, ignore_eos=True)).token_ids
            for name, run in systems.items()}
    print(f"compiled in {time.perf_counter() - start:.0f} s", flush=True)
    if warm["ours fp32"] != warm["generate_cached fp32"]:
        raise SystemExit("the fast fp32 decoder's tokens differ from generate_cached's: "
                         "a speed measured on wrong output means nothing; run the tests")
    timed = {name: (lambda run=run: decode_speed(run, args.tokens)) for name, run in systems.items()}
    timed["transformers fp32"] = lambda: transformers_speed(hf, prompt_ids, args.tokens, tokenizer.eos_token_id)

    speeds: dict[str, list[float]] = {name: [] for name in timed}
    bandwidths: list[float] = []  # around each "ours fp32" run: the bandwidth drifts
    for round_ in range(args.rounds):
        before = copy_bandwidth()
        for name, run in timed.items():
            speeds[name].append(run())
            if name == "ours fp32":
                bandwidths.append((before + copy_bandwidth()) / 2)
        print(f"round {round_ + 1}: bandwidth {bandwidths[-1] / 1e9:.1f} GB/s; "
              + ", ".join(f"{n} {s[-1]:.1f} tok/s" for n, s in speeds.items()), flush=True)

    def per_round(numerator: list[float], denominator: list[float]) -> float:
        """The median over rounds of a ratio taken within each round (runs seconds apart)."""
        return statistics.median(n / d for n, d in zip(numerator, denominator))

    fp32_bytes, bf16_bytes = weight_bytes(fp32), weight_bytes(bf16)
    fp32_roofline = [bandwidth / fp32_bytes for bandwidth in bandwidths]
    print(f"\nmemory bandwidth (copy probe, better of 4 KB and 2 MB pages): median "
          f"{statistics.median(bandwidths) / 1e9:.1f} GB/s, rounds {min(bandwidths) / 1e9:.1f}–{max(bandwidths) / 1e9:.1f}")
    print(f"roofline at the median: fp32 {statistics.median(fp32_roofline):.1f} tok/s "
          f"({fp32_bytes / 1e6:.0f} MB/token), bf16 {statistics.median(bandwidths) / bf16_bytes:.1f} tok/s "
          f"({bf16_bytes / 1e6:.0f} MB/token)")
    print(f"\n{'system':<22} {'tok/s (median)':>15}")
    for name, values in speeds.items():
        print(f"{name:<22} {statistics.median(values):>15.1f}")
    ratios = {
        "ours fp32 / transformers fp32": per_round(speeds["ours fp32"], speeds["transformers fp32"]),
        "ours fp32 / fp32 roofline": per_round(speeds["ours fp32"], fp32_roofline),
        "ours bf16 / ours fp32": per_round(speeds["ours bf16"], speeds["ours fp32"]),
        "ours fp32 / generate_cached fp32": per_round(speeds["ours fp32"], speeds["generate_cached fp32"]),
    }
    print(f"\n{'ratio (median over rounds)':<40} {'measured':>9} {'target':>7}")
    for name, value in ratios.items():
        target = TARGETS.get(name)
        verdict = "" if target is None else ("met" if value >= target else "NOT met")
        print(f"{name:<40} {value:>9.2f} {target or '':>7} {verdict}")


if __name__ == "__main__":
    main()
