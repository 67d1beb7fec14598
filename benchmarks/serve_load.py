"""The server under load, over loopback: a sweep of offered loads, the saturated server against the
offline engine on the same workload, and a soak test of 1,000 requests with random disconnects.

* **Sweep.** Poisson arrivals of stage 06's seeded mixed workload (prompts 16–256 tokens, answers
  8–32) at each rate of ``--rates``; for each: throughput, TTFT, TPOT, inter-token and end-to-end
  latency at p50/p99, goodput under the objective (TTFT ≤ 2 s, TPOT ≤ 200 ms), rejections, lost.
* **Saturated vs offline.** The same ``--requests`` requests all at once, through the server and
  through the same engine in this process (``run_workload``), alternated ``--rounds`` times with a
  new workload each round (the server's prefix cache would otherwise skip the prompts): output
  tokens per second of each, and their ratio (target ≥ 0.9: HTTP, JSON and the engine thread may
  cost at most a tenth).
* **Soak.** ``--soak`` requests (1,000; prompts 4–64 tokens, answers 1–8: it is about leaks, not
  speed) at 200 per second, 30% of the clients hanging up after 1–3 chunks; then every request the server accepted must have finished or been left by its client (0
  lost), the KV blocks in use and the requests tracked must be 0, and the server's resident memory
  within 5% of its level after a warm-up of the same load.

Every server listens on 127.0.0.1 only, and every phase is bounded in count (and each request in
time). The machine is shared: the ratio is taken within one run, alternating; run it three times.

    .venv/bin/python benchmarks/serve_load.py [--rates 0.5,1,2,4] [--requests 32] [--soak 1000] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import tempfile
import time
from pathlib import Path

from aie_lessons.infra.compile_cache import use_compile_cache  # noqa: E402

use_compile_cache()  # what torch.compile builds goes to data/cache/inductor, a folder per ATEN_CPU_CAPABILITY
import psutil  # noqa: E402

from aie_lessons.engine.engine_config import STEPS, EngineConfig, build_engine, compile_buckets  # noqa: E402
from aie_lessons.engine.workload import mixed_workload, run_workload  # noqa: E402
from aie_lessons.infra.paths import default_model_dir  # noqa: E402
from aie_lessons.model import LlamaModel  # noqa: E402
from aie_lessons.harness.load_test import Objective, knee, run_load  # noqa: E402
from aie_lessons.harness.server_process import ServerProcess, wait_until  # noqa: E402
from aie_lessons.tokenizer import Tokenizer  # noqa: E402

COLUMNS = ("offered req/s", "req/s", "tok/s", "TTFT p50 s", "TTFT p99 s", "TPOT p50 ms", "TPOT p99 ms", "ITL p99 ms",
           "e2e p50 s", "e2e p99 s", "goodput req/s", "rejected", "lost")


def table(rows: list[dict]) -> str:
    lines = [" | ".join(f"{c:>13}" for c in COLUMNS)]
    lines += [" | ".join(f"{row[c]:13.2f}" for c in COLUMNS) for row in rows]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="0.5,1,2,4", help="offered loads, requests/s, comma-separated")
    parser.add_argument("--seconds", type=float, default=12.0, help="seconds of arrivals per rate (at least 8 requests)")
    parser.add_argument("--requests", type=int, default=32, help="requests of the saturated-vs-offline comparison")
    parser.add_argument("--rounds", type=int, default=2, help="alternations of server and offline engine")
    parser.add_argument("--soak", type=int, default=1000, help="requests of the soak test")
    parser.add_argument("--max-seqs", type=int, default=EngineConfig.max_seqs)
    parser.add_argument("--step", choices=STEPS, default=EngineConfig.step,
                        help="the engine's step, the server's and the offline engine's alike (default: auto)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 rates, 16 requests, 200 in the soak")
    args = parser.parse_args()
    if args.quick:
        args.rates, args.seconds, args.requests, args.rounds, args.soak = "1,4", 4.0, 16, 1, 200
    rates = [float(r) for r in args.rates.split(",")]
    objective = Objective()
    model_dir = default_model_dir()
    work = Path(tempfile.mkdtemp(prefix="aie-serve-load-"))
    vocab = LlamaModel.from_pretrained(model_dir).config.vocab_size

    # ready_s: a first run compiles every bucket up to max_seqs before the server says ready, minutes on a slow CPU
    server = ServerProcess(["--max-seqs", str(args.max_seqs), "--max-waiting", "4096", "--step", args.step],
                           work / "server.log", ready_s=900)
    failures: list[str] = []
    try:
        ready = next(line for line in server.logs() if line["message"] == "ready")
        print(f"server: {server.url}, max_seqs {args.max_seqs}, {ready['step']} step; log in {work / 'server.log'}")
        sweep = []
        for i, rate in enumerate(rates):
            n = max(8, round(rate * args.seconds))
            workload = mixed_workload(n, 100 + i, (16, 256), (8, 32), vocab)
            sweep.append(asyncio.run(run_load(server.url, workload, rate, seed=i)))
            print(f"  {rate:g} req/s: {n} requests in {sweep[-1].seconds:.1f} s", flush=True)
        print("\nSweep (latencies as the clients saw them):")
        print(table([r.summary(objective) for r in sweep]))
        best = knee(sweep, objective)
        print(f"knee: {best.rate:g} req/s met the objective (TTFT ≤ {objective.ttft_s} s, TPOT ≤ "
              f"{1000 * objective.tpot_s:.0f} ms) for 99% of requests" if best else "knee: no rate met the objective")
        if any(r.lost() for r in sweep):
            failures.append("the sweep lost accepted requests")

        print(f"\nSaturated server vs the offline engine, {args.requests} requests at once, {args.rounds} rounds:")
        model, tokenizer = LlamaModel.from_pretrained(model_dir), Tokenizer.from_pretrained(model_dir)
        engine = build_engine(model, tokenizer, EngineConfig(max_seqs=args.max_seqs, step=args.step))
        compile_buckets(engine)  # before it is timed, as the server compiles before it says ready
        served, offline = [], []
        for round_ in range(args.rounds):
            # a new workload each round: the server's prefix cache keeps the last one's prompts
            workload = mixed_workload(args.requests, 7 + round_, (16, 256), (8, 32), vocab)
            result = asyncio.run(run_load(server.url, workload, math.inf, seed=round_))
            served.append(result.summary(objective)["tok/s"])
            offline.append(run_workload(engine, workload).tokens_per_s)
            print(f"  round {round_ + 1}: server {served[-1]:.1f} tok/s, offline {offline[-1]:.1f} tok/s", flush=True)
        ratio = statistics.median(s / o for s, o in zip(served, offline))
        print(f"server / offline: {ratio:.2f} (median of {args.rounds}; target ≥ 0.9: "
              f"{'met' if ratio >= 0.9 else 'NOT met'})")
        del model, engine

        print(f"\nSoak: {args.soak} requests at 200/s, 30% of clients hanging up early")
        process = psutil.Process(server.process.pid)
        soak = mixed_workload(args.soak, 11, (4, 64), (1, 8), vocab)
        asyncio.run(run_load(server.url, soak[: max(args.soak // 3, 50)], 200.0, seed=20, leave_share=0.3))  # warm-up
        baseline = process.memory_info().rss
        start = time.perf_counter()
        result = asyncio.run(run_load(server.url, soak, 200.0, seed=21, leave_share=0.3))
        summary = result.summary(objective)
        wait_until(lambda: server.metric("aie_kv_blocks_used") == 0, timeout=30, what="KV blocks back to 0")
        grown = process.memory_info().rss / baseline - 1
        left = sum(r.left_early for r in result.records)
        tracked = server.metric("aie_requests_tracked")
        print(f"  {len(result.records)} requests in {time.perf_counter() - start:.1f} s: {left} clients left early, "
              f"{int(summary['lost'])} lost, {int(summary['failed'])} failed, {int(summary['rejected'])} rejected")
        print(f"  afterwards: KV blocks in use {server.metric('aie_kv_blocks_used'):.0f}, requests tracked "
              f"{tracked:.0f}, resident memory {process.memory_info().rss / 2**20:.0f} MiB "
              f"({100 * grown:+.1f}% since the warm-up; target within 5%)")
        if summary["lost"] or summary["failed"]:
            failures.append("the soak lost or failed requests")
        if tracked or grown > 0.05:
            failures.append("memory or records grew over the soak")
    finally:
        print("server stopped with status", server.stop())
    print("\n" + ("all targets met" if not failures and ratio >= 0.9 else "missed: " + "; ".join(
        failures + ([] if ratio >= 0.9 else ["server / offline below 0.9"]))))
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
