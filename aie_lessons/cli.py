"""The ``aie`` command: fetch the model, generate text, report the environment."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _fetch_model(args: argparse.Namespace) -> int:
    from aie_lessons.infra.model_files import fetch_course_model, install_checkpoint

    if args.source:
        model_dir = install_checkpoint(Path(args.source))
    else:
        model_dir = fetch_course_model(force=args.force)
    print(f"model ready in {model_dir}")
    return 0


class UsageError(Exception):
    """Options that cannot go together, or ask for what this machine lacks; the message says which."""


def _sampling_params(args: argparse.Namespace):
    """The request's parameters; a sampled request without --seed gets one, so it can be repeated."""
    import random

    from aie_lessons.sampling import SamplingParams

    sampled = args.temperature != 0
    if not sampled:
        ignored = [flag for flag, value, off in (("--top-k", args.top_k, 0), ("--top-p", args.top_p, 1.0),
                                                 ("--seed", args.seed, None)) if value != off]
        if ignored:
            print(f"aie generate: note: {', '.join(ignored)} only matter when sampling; greedy "
                  "decoding (--temperature 0, the default) ignores them", file=sys.stderr)
    seed = args.seed if args.seed is not None or not sampled else random.randrange(2**31)
    return SamplingParams(
        max_new_tokens=args.max_new_tokens, stop=tuple(args.stop or ()), temperature=args.temperature,
        top_k=args.top_k, top_p=args.top_p, repetition_penalty=args.repetition_penalty, seed=seed,
    )


def check_device(name: str) -> None:
    """Refuse a device this machine does not have, before anything is loaded onto it."""
    import torch

    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise UsageError(f"--device {name}: {exc}. Fix: use cpu or cuda") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {name}: PyTorch sees no CUDA GPU here. Fix: leave out --device (cpu)")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise UsageError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA GPU(s), "
                         "numbered from 0")
    if device.type not in ("cpu", "cuda"):
        raise UsageError(f"--device {name}: the course runs on cpu or cuda")


def _generate(args: argparse.Namespace) -> int:
    import torch

    from aie_lessons.infra.paths import default_model_dir
    from aie_lessons.model import LlamaModel
    from aie_lessons.tokenizer import Tokenizer

    if args.no_cache or args.compile:
        loop = "skeleton" if args.no_cache else "compiled"
        raise UsageError(f"--no-cache and --compile are now --loop skeleton and "
                         f"--loop compiled. Fix: use --loop {loop}")
    check_device(args.device)
    if args.loop == "compiled" and args.activations != "float32":
        raise UsageError("--loop compiled computes in float32: drop --activations bfloat16")
    params = _sampling_params(args)  # bad values are refused before the model is loaded
    model_dir = Path(args.model) if args.model else default_model_dir()
    tokenizer = Tokenizer.from_pretrained(model_dir)
    model = LlamaModel.from_pretrained(model_dir, dtype=getattr(torch, args.dtype), device=args.device,
                                       activations=getattr(torch, args.activations))
    prompt_ids = tokenizer.encode_chat(args.prompt) if args.chat else tokenizer.encode(args.prompt)

    def stream(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    on_text = None if args.json else stream
    if args.loop == "skeleton":  # stage 01: recomputes the whole sequence every step
        from aie_lessons.generate import generate

        result = generate(model, tokenizer, prompt_ids, params, on_text=on_text)
    elif args.loop == "compiled":  # stage 04: fused weights, compiled decode step
        from aie_lessons.fast_decode import FastDecoder

        result = FastDecoder(model).generate(tokenizer, prompt_ids, params, on_text=on_text)
    else:  # stage 04: prefill once, then one cached step per token
        from aie_lessons.cached_generate import generate_cached

        result = generate_cached(model, tokenizer, [prompt_ids], params,
                                 on_text=on_text and (lambda _index, text: on_text(text)))[0]
    if args.json:
        print(json.dumps({
            "prompt_ids": result.prompt_ids,
            "token_ids": result.token_ids,
            "text": result.text,
            "finish_reason": result.finish_reason,
            "seed": params.seed,
            "timings": result.timings,
        }, ensure_ascii=False))
    else:
        print()
    return 0


def _env(args: argparse.Namespace) -> int:
    from aie_lessons.infra.environment import environment_report

    print(environment_report())
    return 0


def _grade(args: argparse.Namespace) -> int:
    from aie_lessons.course.grade import format_report, grade, write_junit

    stages = args.stages.split(",") if args.stages else None
    results = grade(Path(args.submission), stages, cell_timeout=args.cell_timeout)
    print(format_report(results))
    if args.junit:
        write_junit(results, Path(args.junit))
        print(f"\nJUnit XML written to {args.junit}")
    return 0 if all(r.passed for r in results) else 1


def _status(args: argparse.Namespace) -> int:
    from aie_lessons.course.progress import status_table

    print(status_table())
    return 0


def _commit(args: argparse.Namespace) -> int:
    from aie_lessons.course.progress import commit

    results = commit(args.stage, Path(args.notebook) if args.notebook else None)
    failed = [r for r in results if not r.passed]
    if failed:
        print(f"not committed: stage {args.stage}'s checks fail on your code.")
        for r in failed:
            print(f"  exercise {r.exercise}: {r.message}")
        return 1
    print(f"committed: aie_lessons now runs your stage {args.stage} ({len(results)} checks pass).")
    return 0


def _reset(args: argparse.Namespace) -> int:
    from aie_lessons.course.progress import reset

    reset(args.stage)
    print(f"stage {args.stage} reset: aie_lessons runs the reference code for it.")
    return 0


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive number of seconds")
    return value


class Parser(argparse.ArgumentParser):
    """argparse, with a bad option reported as one line (and where to look) instead of a usage dump."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="aie", description="AI engineering from scratch.")
    commands = parser.add_subparsers(dest="command", required=True)

    fetch = commands.add_parser("fetch-model", help="download and convert the course model")
    fetch.add_argument("--from", dest="source", metavar="DIR",
                       help="use a local HuggingFace Llama-family checkpoint instead")
    fetch.add_argument("--force", action="store_true", help="convert again even if present")
    fetch.set_defaults(run=_fetch_model)

    gen = commands.add_parser("generate", help="generate text, streamed to stdout")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--stop", action="append", metavar="TEXT", help="stop string (repeatable)")
    gen.add_argument("--json", action="store_true", help="print one JSON object at the end")
    gen.add_argument("--loop", choices=["skeleton", "cached", "compiled"], default="cached",
                     help="skeleton: stage 01, no KV cache (slow, for comparison); cached: stage 04's "
                          "KV cache (default); compiled: stage 04's fused, compiled decoder "
                          "(compiles first: seconds)")
    gen.add_argument("--no-cache", action="store_true", help=argparse.SUPPRESS)  # old names: say the new
    gen.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-k", type=int, default=0, help="keep the k best tokens (0 = all)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus: keep tokens holding p (1 = all)")
    gen.add_argument("--repetition-penalty", type=float, default=1.0, help="> 1 discourages repeats")
    gen.add_argument("--seed", type=int, help="seed of the sampling (same seed, same text); without "
                                              "it a random one is used and shown by --json")
    gen.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                     help="how the weights are stored (bfloat16 halves the bytes per token)")
    gen.add_argument("--activations", choices=["float32", "bfloat16"], default="float32",
                     help="what the model computes in (stage 04, section 7 measures the choice); "
                          "logits are float32 either way")
    gen.add_argument("--device", default="cpu", help="cpu or cuda")
    gen.add_argument("--model", metavar="DIR", help="checkpoint folder (default: the fetched model)")
    gen.set_defaults(run=_generate)

    env = commands.add_parser("env", help="report versions, hardware and Triton availability")
    env.set_defaults(run=_env)

    grade = commands.add_parser("grade", help="grade a folder of a learner's notebooks")
    grade.add_argument("submission", metavar="SUBMISSION_DIR")
    grade.add_argument("--stages", help="comma-separated stage numbers, e.g. 01,02")
    grade.add_argument("--junit", metavar="FILE", help="also write JUnit XML")
    grade.add_argument("--cell-timeout", type=positive_int, default=300, metavar="SECONDS",
                       help="a cell running longer fails (default 300)")
    grade.set_defaults(run=_grade)

    status = commands.add_parser("status", help="your stages: committed or reference, checks")
    status.set_defaults(run=_status)

    commit = commands.add_parser("commit", help="put your stage's code into aie_lessons")
    commit.add_argument("stage", metavar="NN")
    commit.add_argument("--notebook", metavar="PATH", help="default: notebooks/NN_*.ipynb")
    commit.set_defaults(run=_commit)

    reset = commands.add_parser("reset", help="put the reference code of a stage back")
    reset.add_argument("stage", metavar="NN")
    reset.set_defaults(run=_reset)
    return parser


# Errors that the course raises carry their own fix: they are printed plainly, not as a traceback.
COURSE_ERRORS = (
    ("aie_lessons.course.grade", "GradeError"),
    ("aie_lessons.course.progress", "ProgressError"),
    ("aie_lessons.course.source", "SourceError"),
    ("aie_lessons.config", "ConfigError"),
    ("aie_lessons.generate", "PromptError"),
    ("aie_lessons.infra.model_files", "ModelFilesError"),
    ("aie_lessons.kv_cache", "CacheFullError"),
    ("aie_lessons.sampling", "SamplingParamsError"),
    ("aie_lessons.weights", "WeightsError"),
)


def is_course_error(exc: Exception) -> bool:
    """Whether ``exc`` is one of the course's errors, looked up only after something failed.

    Importing them up front would import the learner's modules before every command, so one
    broken committed stage would stop even ``aie reset`` from starting. A module that fails to
    import cannot have raised the error: it is simply not one of the candidates.
    """
    if isinstance(exc, (OSError, UsageError)):  # files: missing, a folder, no permission
        return True
    for module, name in COURSE_ERRORS:
        loaded = sys.modules.get(module)
        if loaded is not None and isinstance(exc, getattr(loaded, name)):
            return True
    return False


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except Exception as exc:
        if not is_course_error(exc):
            raise
        print(f"aie {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
