"""Batch-1 greedy decode speed: our engine vs transformers, llama.cpp and the memory roofline.

"Ours" is stage 09's ``FastDecoder`` (fused weights, compiled step) in fp32 and bf16, and its
``QuantizedFastDecoder`` in int8 and int4 (groups of 32); stage 04's plain ``generate_cached``
is shown too, for the size of the step. Decoding one token reads every
weight once and the cache, so the roofline is read bandwidth / bytes per token, both as the
notebooks define them: ``aie_lessons.roofline``'s ``read_bandwidth`` and
``decode_bytes_per_token``.

This machine's memory bandwidth drifts from second to second (25–50 GB/s on the course
machine), so every ratio is taken between measurements made moments apart, then the median
is shown. Each round has two parts:

* whole requests, one per system, for tokens/s and the ratio to ``transformers``;
* step by step: our fp32 and bf16 decoders advance in turn, one token each, and every step
  sits between two bandwidth probes (milliseconds away). A step's roofline ratio uses the
  probes on either side of it; the bf16/fp32 ratio pairs the two decoders' steps at the
  same position. These two ratios are judged on the steps: whole requests see the bandwidth
  move under them, and their ratios wander with it.

llama.cpp (through ``llama-cpp-python``: ``pip install -e ".[bench]"``, which builds it from
source in a few minutes) is what a user would pick instead. It reads the course's own GGUF file
(the Q4_1 file our checkpoint is converted from), requantized once by llama.cpp's own quantize
API to F32, BF16, Q8_0 and Q4_0 in ``data/cache/llama.cpp/``: both engines decode the same
weights. Q8_0 keeps the model's tied embedding table, its output head, in Q8_0 as well, so our
int8 decoder quantizes its head too (``aie generate --quant int8 --quant-head``); Q4_0 gets a
6-bit head (Q6_K), and our int4-g32 the nearest we have, an int8 one (``--quant int4-g32
--quant-head-scheme int8``): its head reads 28 MB a token where llama.cpp's reads 23 (a bf16 head
57), and the whole step about 94 MB in the kernels' layout (blocks 66) against the 92 MB of
llama.cpp's Q4_0 file. Each of our decoders and its llama.cpp counterpart decode a
request each at once, taking turns of four steps (``in_turns`` says why), with the same number
of threads; a round's ratio is that of the two median steps, and each ratio is the median over
rounds. Without the package that part is skipped, saying how to install it. A native build on
a CPU with AMX crashed on Q8_0 and Q4_0 (0.3.36); the script then loads those without ggml's
extra buffers and says how to rebuild without AMX, as the figures in the course's notes were
measured.

    .venv/bin/python benchmarks/decode.py [--tokens 128] [--rounds 5]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Iterator

import torch

from aie_lessons.cached_generate import generate_cached
from aie_lessons.fast_decode import FastDecoder, QuantizedFastDecoder, huge_page_empty
from aie_lessons.sampling import SamplingParams
from aie_lessons.model import LlamaModel
from aie_lessons.infra.compile_cache import use_compile_cache
from aie_lessons.infra.paths import CACHE_DIR, default_model_dir
from aie_lessons.quantize import quantize_model
from aie_lessons.roofline import decode_bytes_per_token, read_bandwidth
from aie_lessons.tokenizer import Tokenizer

PROMPT = "Write a long story about a lighthouse keeper and the sea."
PROBE_BYTES = 256 * 2**20  # eight times the course machine's last-level cache
TARGETS = {  # from the course's decode-speed issues, judged as the docstring says
    "ours fp32 / transformers fp32": 2.5,
    "ours fp32 / fp32 roofline": 0.75,
    "ours bf16 / ours fp32": 1.6,
    "ours fp32 / llama.cpp F32": 1.0,
    "ours bf16 / llama.cpp BF16": 1.0,
    "ours int8 / llama.cpp Q8_0": 0.9,
    "ours int4-g32 + int8 head / llama.cpp Q4_0": 0.6,
}
LLAMA_CPP_TYPES = ("F32", "BF16", "Q8_0", "Q4_0")  # llama.cpp's names; LLAMA_FTYPE_ALL_F32, _MOSTLY_BF16, ...


class ReadProbe:
    """The notebooks' ``read_bandwidth``, over buffers allocated once, in both kinds of pages.

    It reads ordinary 4 KB pages and the 2 MB pages that hold the fast decoder's weights
    (``huge_page_empty``), which stream faster on many machines; the better of the two is the
    roofline, so our engine gets no credit for memory the probe could not use as well. The
    buffers are kept and already touched, so a probe between two decode steps costs only its
    reads, and every pass counts.
    """

    def __init__(self) -> None:
        numel = PROBE_BYTES // 4
        self.buffers = [torch.ones(numel), huge_page_empty(numel, torch.float32).fill_(1.0)]

    def best(self, repeats: int = 1) -> float:
        """Bytes read per second: the best of ``repeats`` passes over each buffer."""
        return max(read_bandwidth(repeats=repeats, buffer=buffer)[0] for buffer in self.buffers)


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


def benchmark_args(description: str, rounds: int) -> argparse.Namespace:
    """``--tokens`` and ``--rounds``, as every decode benchmark here takes them."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=rounds)
    return parser.parse_args()


def transformers_fp32(model_dir: Path):
    """transformers' model on the same weights in fp32: what every decode ratio is taken against.
    Imported here, late: it is the slowest import of all, and ``--help`` should not wait for it."""
    import transformers

    warnings.filterwarnings("ignore")
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def step_seconds(steps: Iterator[int]) -> float:
    """Time one ``next()`` of a ``FastDecoder.tokens`` generator: one decode step."""
    start = time.perf_counter()
    next(steps)
    return time.perf_counter() - start


def interleaved_steps(fast_fp32: FastDecoder, fast_bf16: FastDecoder, prompt_ids: list[int], tokens: int,
                      probe: ReadProbe) -> tuple[list[float], list[float]]:
    """Per decode step: (ours fp32 / fp32 roofline, ours bf16 / ours fp32).

    The two decoders take turns, one token each, and a probe runs before every step, so each
    fp32 step lies between two probes and each bf16 step follows the fp32 step at the same
    position by some tens of milliseconds. A step's roofline counts the cache it reads too:
    the step that decodes position t attends to t + 1 positions.
    """
    params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    fp32_steps, bf16_steps = fast_fp32.tokens(prompt_ids, params), fast_bf16.tokens(prompt_ids, params)
    next(fp32_steps), next(bf16_steps)  # the prefills, not decode steps
    roofline_ratios, bf16_ratios = [], []
    before = probe.best()
    for position in range(len(prompt_ids), len(prompt_ids) + tokens - 1):
        fp32_seconds = step_seconds(fp32_steps)
        after = probe.best()
        bf16_seconds = step_seconds(bf16_steps)
        fp32_bytes = decode_bytes_per_token(fast_fp32.model, position + 1, torch.float32)
        roofline = (before + after) / 2 / fp32_bytes  # tokens/s
        roofline_ratios.append(1 / fp32_seconds / roofline)
        bf16_ratios.append(fp32_seconds / bf16_seconds)
        before = probe.best()
    return roofline_ratios, bf16_ratios


@contextlib.contextmanager
def c_output_to(path: Path) -> Iterator[None]:
    """Send what C code prints on stdout and stderr (llama.cpp's quantizer lists every tensor)
    to ``path``."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(path, "w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            for fd, original in zip((1, 2), saved):
                os.dup2(original, fd)
                os.close(original)


def llama_cpp_files(source: Path, folder: Path) -> dict[str, Path]:
    """The course's GGUF requantized by llama.cpp to each of LLAMA_CPP_TYPES, made once."""
    import llama_cpp

    folder.mkdir(parents=True, exist_ok=True)
    files = {}
    for name in LLAMA_CPP_TYPES:
        target = folder / f"{source.stem}.{name}.gguf"
        if not target.exists():
            print(f"llama.cpp: requantizing {source.name} to {name} (once) ...", flush=True)
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_{'ALL' if name == 'F32' else 'MOSTLY'}_{name}")
            params.allow_requantize = True  # the source is Q4_1: dequantized, then stored as asked
            params.nthread = torch.get_num_threads()
            scratch, log = target.with_suffix(".partial"), target.with_suffix(".log")
            with c_output_to(log):
                failed = llama_cpp.llama_model_quantize(str(source).encode(), str(scratch).encode(), params)
            if failed:
                raise SystemExit(f"llama.cpp could not quantize {source} to {name}: see {log}")
            scratch.rename(target)
        files[name] = target
    return files


@contextlib.contextmanager
def without_extra_buffers() -> Iterator[None]:
    """Load llama.cpp models without ggml's extra CPU buffer types (AMX tiles, repacked
    weights). llama-cpp-python 0.3.36 built natively on an AMX Xeon crashed (a segmentation
    fault in decode) on Q8_0 and Q4_0 with them; F32 and BF16 ran. The Python wrapper does not
    expose the switch, so its default parameters are wrapped for the duration."""
    import llama_cpp.llama_cpp as lib

    defaults = lib.llama_model_default_params

    def no_extra_buffers():
        params = defaults()
        params.use_extra_bufts = False
        return params

    lib.llama_model_default_params = no_extra_buffers
    try:
        yield
    finally:
        lib.llama_model_default_params = defaults


def llama_cpp_tokens(llm, prompt_ids: list[int]) -> Iterator[int]:
    """One greedy request through llama.cpp, a token per ``next()``: like ours, its generator
    evaluates the prompt on the first ``next()`` and one token on each later one."""
    llm.reset()
    return llm.generate(prompt_ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0)


def in_turns(streams: dict[str, Iterator[int]], tokens: int, turn: int = 4) -> dict[str, tuple[float, list[int]]]:
    """Each stream's median decode step in seconds, and its tokens: ``tokens`` of each, the
    streams advanced ``turn`` steps at a time in turn, which goes first alternating. The prefill
    (each first ``next()``) and the first decode step are not timed. Turns of a few steps, not
    whole requests: the bandwidth moves by tens of percent within a second, and two requests a
    second apart would see different machines; and not single steps: the two runtimes' OpenMP
    threads (PyTorch's and llama.cpp's are separate pools) spin for a moment after each step,
    which a step of the other would pay for."""
    seconds: dict[str, list[float]] = {name: [] for name in streams}
    chosen: dict[str, list[int]] = {name: [] for name in streams}
    order = list(streams)
    for first in range(0, tokens, turn):
        for name in order if (first // turn) % 2 == 0 else order[::-1]:
            for _ in range(min(turn, tokens - first)):
                start = time.perf_counter()
                chosen[name].append(next(streams[name]))
                seconds[name].append(time.perf_counter() - start)
    return {name: (statistics.median(seconds[name][2:]), chosen[name]) for name in streams}


def compare_with_llama_cpp(ours: dict[str, FastDecoder], prompt_ids: list[int],
                           tokens: int, rounds: int) -> list[tuple[str, float, bool]]:
    """(ratio name, median over rounds, judged against its target?) of each of our decoders
    against llama.cpp on the same weights, taking turns; [] with a note when llama-cpp-python
    is not installed. A ratio against a llama.cpp slowed by the AMX workaround is not judged."""
    try:
        from llama_cpp import Llama
    except ImportError:
        print('\nllama.cpp: skipped, llama-cpp-python is not installed. Fix: .venv/bin/pip install -e ".[bench]"')
        return []
    from aie_lessons.infra.model_files import GGUF_MEMBER

    import llama_cpp

    files = llama_cpp_files(CACHE_DIR / Path(GGUF_MEMBER).name, CACHE_DIR / "llama.cpp")
    threads = torch.get_num_threads()
    amx = "AMX_INT8 = 1" in llama_cpp.llama_print_system_info().decode()
    if amx:
        print("llama.cpp: this build uses AMX, whose buffers crash Q8_0/Q4_0 decoding here: they load without "
              "ggml's extra buffers (no AMX, no repacking: slower). For the full speed, rebuild without AMX:\n"
              '  CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON '
              '-DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON" .venv/bin/pip install '
              "--force-reinstall --no-cache-dir --no-deps llama-cpp-python==0.3.36\n"
              "Until then the Q8_0 and Q4_0 ratios are shown, not judged.", flush=True)
    pairs = dict(zip(ours, LLAMA_CPP_TYPES))  # fp32: F32, bf16: BF16, int8: Q8_0, int4-g32 (+ int8 head): Q4_0
    speeds: dict[str, list[float]] = {name: [] for name in [*ours, *LLAMA_CPP_TYPES]}
    params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    for round_ in range(rounds):
        for name, decoder in ours.items():
            theirs = pairs[name]
            with without_extra_buffers() if amx and theirs in ("Q8_0", "Q4_0") else contextlib.nullcontext():
                llm = Llama(str(files[theirs]), n_ctx=len(prompt_ids) + tokens + 8, n_threads=threads,
                            n_threads_batch=threads, verbose=False)
            in_turns({"warm-up": llama_cpp_tokens(llm, prompt_ids)}, 8)  # pages the weights in
            steps = in_turns({name: decoder.tokens(prompt_ids, params), theirs: llama_cpp_tokens(llm, prompt_ids)},
                             tokens)
            for system, (seconds, _) in steps.items():
                speeds[system].append(1 / seconds)
            if round_ == 0:
                same = next((i for i, (a, b) in enumerate(zip(steps[name][1], steps[theirs][1])) if a != b), tokens)
                print(f"llama.cpp {theirs} ({files[theirs].stat().st_size / 1e6:.0f} MB file) and ours {name}: "
                      f"the first {same} of {tokens} greedy tokens agree", flush=True)
            del llm
        print(f"llama.cpp round {round_ + 1}: " + ", ".join(f"{n} {s[-1]:.1f}" for n, s in speeds.items()) + " tok/s",
              flush=True)
    print(f"\n{'system (in turns of 4 steps)':<28} {'tok/s (median)':>11}   ({threads} threads each)")
    for name, values in speeds.items():
        print(f"{('ours ' if name in ours else 'llama.cpp ') + name:<28} {statistics.median(values):>11.1f}")
    slowed = {"Q8_0", "Q4_0"} if amx else set()  # loaded without extra buffers: not llama.cpp's best
    return [(f"ours {name} / llama.cpp {theirs}" + (" (no extra buffers)" if theirs in slowed else ""),
             statistics.median(a / b for a, b in zip(speeds[name], speeds[theirs])), theirs not in slowed)
            for name, theirs in pairs.items()]


def main() -> None:
    use_compile_cache()  # what torch.compile builds goes to data/cache/inductor, a folder per ATEN_CPU_CAPABILITY
    args = benchmark_args(__doc__.split("\n\n")[0], rounds=5)
    model_dir = default_model_dir()
    tokenizer = Tokenizer.from_pretrained(model_dir)
    prompt_ids = tokenizer.encode_chat(PROMPT)
    fp32 = LlamaModel.from_pretrained(model_dir, dtype=torch.float32)
    bf16 = LlamaModel.from_pretrained(model_dir, dtype=torch.bfloat16)
    hf = transformers_fp32(model_dir)
    fast_fp32, fast_bf16 = FastDecoder(fp32), FastDecoder(bf16)
    # The head as llama.cpp's files keep it: Q8_0's in Q8_0 (`aie generate --quant int8 --quant-head`),
    # Q4_0's in 6 bits (Q6_K), for which int4-g32 gets our nearest, int8 (`--quant-head-scheme int8`).
    quantized = {name: QuantizedFastDecoder(quantize_model(LlamaModel.from_pretrained(model_dir, dtype=torch.bfloat16),
                                                           scheme, head="int8"))
                 for name, scheme in (("int8", "int8"), ("int4-g32 + int8 head", "int4-g32"))}
    systems = {
        "ours fp32": lambda p: fast_fp32.generate(tokenizer, prompt_ids, p),
        "ours bf16": lambda p: fast_bf16.generate(tokenizer, prompt_ids, p),
        "generate_cached fp32": lambda p: generate_cached(fp32, tokenizer, [prompt_ids], p)[0],
        **{f"ours {scheme}": (lambda p, d=decoder: d.generate(tokenizer, prompt_ids, p))
           for scheme, decoder in quantized.items()},
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

    mean_context = len(prompt_ids) + args.tokens // 2  # whole requests: the roofline at their middle
    fp32_bytes = decode_bytes_per_token(fp32, mean_context, torch.float32)
    bf16_bytes = decode_bytes_per_token(bf16, mean_context, torch.bfloat16)
    probe = ReadProbe()
    speeds: dict[str, list[float]] = {name: [] for name in timed}
    bandwidths: list[float] = []  # around each "ours fp32" request: the bandwidth drifts
    step_roofline: list[float] = []
    step_bf16: list[float] = []
    for round_ in range(args.rounds):
        before = probe.best(repeats=3)
        for name, run in timed.items():
            speeds[name].append(run())
            if name == "ours fp32":
                bandwidths.append((before + probe.best(repeats=3)) / 2)
        roofline_ratios, bf16_ratios = interleaved_steps(fast_fp32, fast_bf16, prompt_ids, args.tokens, probe)
        step_roofline += roofline_ratios
        step_bf16 += bf16_ratios
        print(f"round {round_ + 1}: bandwidth {bandwidths[-1] / 1e9:.1f} GB/s; "
              + ", ".join(f"{n} {s[-1]:.1f} tok/s" for n, s in speeds.items())
              + f"; step by step: fp32/roofline {statistics.median(roofline_ratios):.2f}, "
                f"bf16/fp32 {statistics.median(bf16_ratios):.2f}", flush=True)

    def per_round(numerator: list[float], denominator: list[float]) -> float:
        """The median over rounds of a ratio taken within each round (requests seconds apart)."""
        return statistics.median(n / d for n, d in zip(numerator, denominator))

    fp32_roofline = [bandwidth / fp32_bytes for bandwidth in bandwidths]
    print(f"\nmemory read bandwidth (read_bandwidth, better of 4 KB and 2 MB pages): median "
          f"{statistics.median(bandwidths) / 1e9:.1f} GB/s, rounds {min(bandwidths) / 1e9:.1f}–{max(bandwidths) / 1e9:.1f}")
    print(f"roofline at the median: fp32 {statistics.median(fp32_roofline):.1f} tok/s "
          f"({fp32_bytes / 1e6:.0f} MB/token at context {mean_context}), bf16 {statistics.median(bandwidths) / bf16_bytes:.1f} tok/s "
          f"({bf16_bytes / 1e6:.0f} MB/token)")
    print(f"\n{'system (whole requests)':<24} {'tok/s (median)':>15}")
    for name, values in speeds.items():
        print(f"{name:<24} {statistics.median(values):>15.1f}")
    whole, steps = "whole requests", f"{len(step_roofline)} steps"
    rows = [  # (ratio, measured how, median, judged against the target?)
        ("ours fp32 / transformers fp32", whole, per_round(speeds["ours fp32"], speeds["transformers fp32"]), True),
        ("ours fp32 / fp32 roofline", steps, statistics.median(step_roofline), True),
        ("ours bf16 / ours fp32", steps, statistics.median(step_bf16), True),
        ("ours fp32 / fp32 roofline", whole, per_round(speeds["ours fp32"], fp32_roofline), False),
        ("ours bf16 / ours fp32", whole, per_round(speeds["ours bf16"], speeds["ours fp32"]), False),
        ("ours fp32 / generate_cached fp32", whole, per_round(speeds["ours fp32"], speeds["generate_cached fp32"]), False),
    ]
    llama_rows = compare_with_llama_cpp({"fp32": fast_fp32, "bf16": fast_bf16, **quantized}, prompt_ids,
                                        args.tokens, args.rounds)
    rows += [(name, "turns of 4", value, judged) for name, value, judged in llama_rows]
    print(f"\n{'ratio (median)':<44} {'measured over':<15} {'value':>6} {'target':>7}")
    for name, how, value, judged in rows:
        target = TARGETS.get(name) if judged else None
        verdict = "" if target is None else ("met" if value >= target else "NOT met")
        print(f"{name:<44} {how:<15} {value:>6.2f} {target or '':>7} {verdict}")

if __name__ == "__main__":
    main()
