"""`aie generate` measured from the outside: process start to the first streamed token, and the
decode rate, for the default (the engine, its step for one row compiled ahead of time), stage
09's batch-1 decoder (``--loop compiled``) and stage 04's cached loop, against transformers'
decode rate measured in between.

A user waits for the whole process: Python starting, torch importing, the model loading, the
compiled step loading (or, the very first time on a machine, compiling), the prefill. So the
start-up is timed from ``subprocess.Popen`` to the first byte the command streams; the decode
rate comes from the same command with ``--json`` (its ``decode_tokens_per_s``). The first run
compiles into an empty temporary cache folder; every later run loads from it. Each round runs
every command once, then transformers, so every ratio is between measurements seconds apart
(this machine is shared and noisy); the medians over rounds are printed.

    .venv/bin/python benchmarks/cli_startup.py [--tokens 128] [--rounds 3]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# benchmarks/decode.py: the same prompt, arguments and reference model, timed the same way
from decode import PROMPT, benchmark_args, transformers_fp32, transformers_speed

from aie_lessons.infra.paths import default_model_dir
from aie_lessons.tokenizer import Tokenizer

AIE = Path(sys.executable).with_name("aie")
TARGET = 2.5  # the default's decode rate / transformers' that the course asks for (stage 09)
DEFAULT = "engine (default)"


def first_byte_seconds(command: list[str], env: dict[str, str]) -> float:
    """Seconds from starting ``command`` to the first byte on its stdout; it must then succeed.
    Its stderr goes to a file: a pipe nobody reads could fill and stall it."""
    with tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=err, env=env)
        first = process.stdout.read(1)
        elapsed = time.perf_counter() - start
        process.communicate(timeout=900)
        if process.returncode != 0 or not first:
            err.seek(0)
            raise SystemExit(f"{' '.join(command)} failed (exit status {process.returncode}):\n"
                             f"{err.read().decode()[-2000:]}")
    return elapsed


def json_run(command: list[str], env: dict[str, str], loop: str) -> dict:
    """The command's --json answer, which must say that ``loop`` ran (no fallback measured)."""
    out = subprocess.run([*command, "--json"], capture_output=True, text=True, env=env, timeout=900)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(command)} --json failed:\n{out.stderr[-2000:]}")
    result = json.loads(out.stdout)
    if result["loop"] != loop:
        raise SystemExit(f"{' '.join(command)} ran the {result['loop']} loop, not the {loop} one:\n{out.stderr}")
    return result


def main() -> None:
    args = benchmark_args(__doc__.split("\n\n")[0], rounds=3)
    model_dir = default_model_dir()
    tokenizer = Tokenizer.from_pretrained(model_dir)
    hf = transformers_fp32(model_dir)
    base = [str(AIE), "generate", "--chat", PROMPT, "--max-new-tokens", str(args.tokens)]
    commands = {DEFAULT: base, "compiled decoder": [*base, "--loop", "compiled"],
                "cached loop": [*base, "--loop", "cached"]}
    loops = {DEFAULT: "engine", "compiled decoder": "compiled", "cached loop": "cached"}
    with tempfile.TemporaryDirectory(prefix="aie-startup-") as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}  # empty: the first run compiles
        print("first run of the default on this machine (compiling) ...", flush=True)
        first = first_byte_seconds(base, env)
        print(f"  start to first token: {first:.1f} s", flush=True)
        starts = {name: [] for name in commands}
        rates = {name: [] for name in (*commands, "transformers fp32")}
        for round_ in range(args.rounds):
            answer = []
            for name, command in commands.items():
                starts[name].append(first_byte_seconds(command, env))
                result = json_run(command, env, loops[name])
                rates[name].append(result["timings"]["decode_tokens_per_s"])
                answer = answer or result["prompt_ids"] + result["token_ids"]
            generated = len(answer) - len(tokenizer.encode_chat(PROMPT))
            rates["transformers fp32"].append(
                transformers_speed(hf, tokenizer.encode_chat(PROMPT), generated, tokenizer.eos_token_id))
            print(f"round {round_ + 1}: " + "; ".join(
                f"{name} start {starts[name][-1]:.2f} s, {rates[name][-1]:.1f} tok/s" for name in commands)
                  + f"; transformers {rates['transformers fp32'][-1]:.1f} tok/s ({generated} tokens)", flush=True)
    ratio = statistics.median(c / t for c, t in zip(rates[DEFAULT], rates["transformers fp32"]))
    print(f"\n{'command (fp32, batch 1)':<22} {'start to first token':>21} {'decode tok/s':>13}")
    print(f"{'default, first run':<22} {first:>19.1f} s {'':>13}")
    for name in commands:
        print(f"{name:<22} {statistics.median(starts[name]):>19.2f} s {statistics.median(rates[name]):>13.1f}")
    print(f"{'transformers fp32':<22} {'':>21} {statistics.median(rates['transformers fp32']):>13.1f}")
    print(f"\ndefault / transformers decode rate (median of rounds): {ratio:.2f} "
          f"(target {TARGET}: {'met' if ratio >= TARGET else 'NOT met'})")
    for name in ("compiled decoder", "cached loop"):
        other = statistics.median(c / k for c, k in zip(rates[DEFAULT], rates[name]))
        print(f"default / {name} decode rate: {other:.2f}")


if __name__ == "__main__":
    main()
