"""The ``aie`` command: fetch the model, generate text, report the environment."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:  # names for annotations only: see is_course_error for why nothing is imported up front
    from aie_lessons.engine.engine import Engine
    from aie_lessons.fast_decode import FastDecoder
    from aie_lessons.model import LlamaModel
    from aie_lessons.output import GenerationResult
    from aie_lessons.sampling import SamplingParams
    from aie_lessons.tokenizer import Tokenizer


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


def read_prompts_file(path: Path) -> list[str]:
    """The prompts in ``path``: one per line, or, in a ``.jsonl`` file, one ``{"prompt": ...}`` per line.

    Plain lines are the simple case; JSON lines are for prompts that span lines. Blank lines are
    skipped in both, and a file with no prompt at all is refused, since running nothing is surely
    not what was meant.
    """
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise UsageError(f"--prompts-file {path}: {exc.strerror or exc}. Fix: give a text file with one "
                         "prompt per line (or a .jsonl file with one {\"prompt\": ...} per line)") from exc
    except UnicodeDecodeError as exc:
        raise UsageError(f"--prompts-file {path} is not UTF-8 text. Fix: save it as UTF-8") from exc
    numbered = [(number, line) for number, line in enumerate(lines, 1) if line.strip()]
    if not numbered:
        raise UsageError(f"--prompts-file {path} has no prompts (blank lines are skipped). Fix: write one "
                         "prompt per line")
    if path.suffix != ".jsonl":
        return [line for _, line in numbered]
    prompts = []
    for number, line in numbered:
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            problem = f"not JSON ({exc.msg})"
        else:
            has_prompt = isinstance(record, dict) and isinstance(record.get("prompt"), str)
            problem = None if has_prompt else 'not an object with a "prompt" string'
        if problem:
            raise UsageError(f"--prompts-file {path}, line {number}: {problem}. Fix: one JSON object per "
                             'line, like {"prompt": "Hello"}')
        prompts.append(record["prompt"])
    return prompts


def _prompts(args: argparse.Namespace) -> list[str]:
    """Every prompt asked for, in order: the positional ones, then --prompt, then --prompts-file."""
    prompts = [*args.prompts, *(args.prompt or ())]
    if args.prompts_file:
        prompts += read_prompts_file(Path(args.prompts_file))
    if not prompts:
        raise UsageError('no prompt given. Fix: aie generate "Hello", several prompts, or '
                         "--prompts-file PATH")
    return prompts


def _compiled_loop_refusal(args: argparse.Namespace) -> tuple[str, str] | None:
    """Why stage 09's compiled decoder cannot run this request, as (reason, message with the fix),
    or None when it can. Reasons: activations, device, quant, compiler."""
    import torch

    from aie_lessons.infra.compile_cache import cpp_compiler

    if args.activations != "float32":
        return "activations", "--loop compiled computes in float32: drop --activations bfloat16"
    if torch.device(args.device).type != "cpu":
        return "device", (f"--loop compiled is compiled for the CPU, not --device {args.device}. Fix: drop "
                          "--device, or use --loop cached")
    refusal = _int4_kernel_refusal(args, "--loop compiled", "--loop cached")
    if refusal:
        return "quant", refusal
    if cpp_compiler() is None:
        return "compiler", ("--loop compiled needs a C++ compiler to build the decoder, and none was found. Fix: "
                            "install one (g++ or clang++), or use --loop cached")
    return None


def _compiled_step_refusal(args: argparse.Namespace) -> str | None:
    """Why the engine's ``--step compiled`` cannot run this request, with the fix, or None: stage
    09's rules (``compiled_step_refusal``, ``no_compiler_for``), asked before the model loads."""
    from aie_lessons.engine.engine_config import no_compiler_for

    if args.activations != "float32":
        return "--step compiled computes in float32. Fix: drop --activations bfloat16, or drop --step"
    if args.quant and torch_device_type(args.device) != "cpu":
        return (f"--step compiled reads --quant {args.quant} through PyTorch's CPU kernels, not on --device "
                f"{args.device}. Fix: drop --device, or drop --step")
    refusal = _int4_kernel_refusal(args, "--step compiled", "drop --step")
    if refusal:
        return refusal
    why = no_compiler_for(args.device)
    return f"--step compiled: {why}, or drop --step" if why else None


def _int4_kernel_refusal(args: argparse.Namespace, what: str, instead: str) -> str | None:
    """Why ``what`` cannot read the weights of --quant or of --quant-head-scheme (PyTorch's int4 CPU
    kernel takes only some group sizes), naming that flag in the fix, or None; the kernels' rule
    itself is stage 09's ``kernel_refusal``, which names the layer once the model has loaded."""
    from aie_lessons.quantize import INT4_KERNEL_GROUP_SIZES, SCHEMES

    for flag, name in (("--quant", args.quant), ("--quant-head-scheme", args.quant_head_scheme)):
        scheme = SCHEMES[name] if name else None
        if scheme and scheme.bits == 4 and scheme.group_size not in INT4_KERNEL_GROUP_SIZES:
            return (f"{what} reads quantized weights through PyTorch's int4 kernel, which takes no {name}. "
                    f"Fix: {flag} int4-g64 or int4-g32, or {instead}")
    return None


def _quant_head(args: argparse.Namespace) -> bool | str:
    """``quantized_model``'s ``head`` from --quant-head (the blocks' scheme) or --quant-head-scheme
    (its own), refused without --quant: there is no quantized model to put the head in."""
    flag = "--quant-head" if args.quant_head else "--quant-head-scheme" if args.quant_head_scheme else None
    if flag and not args.quant:
        raise UsageError(f"{flag} quantizes the output head beside the blocks of --quant. Fix: add --quant SCHEME")
    return args.quant_head_scheme or args.quant_head


def torch_device_type(name: str) -> str:
    """``cpu`` or ``cuda`` for a --device already checked by ``check_device``."""
    import torch

    return torch.device(name).type


def _engine_step(args: argparse.Namespace, count: int) -> str:
    """The engine's step: --step if given; else, for one prompt, "auto" — stage 09's compiled
    step wherever it can run, compiled ahead of time so that, once a machine's first run has
    built it, it loads in a moment — unless there is no token to decode after the first (the
    prefill's alone: nothing worth compiling); for several, "eager" (a few prompts would not
    pay back compiling a step for each batch size). Off the CPU the step would be compiled by
    ``torch.compile`` in every process, so it is eager unless --step asks."""
    if args.step:
        return args.step
    cpu = torch_device_type(args.device) == "cpu"  # elsewhere a step compiled in every process: not by default
    return "auto" if cpu and count == 1 and args.max_new_tokens >= 2 else "eager"


def _loop(args: argparse.Namespace, count: int) -> str:
    """The generate loop to run: the engine (stages 06-09), whatever the number of prompts;
    --loop picks a lesson's own loop instead, for one prompt: stage 01's, stage 04's or
    stage 09's batch-1 decoder — the loops the engine is checked against."""
    if count > 1 and args.loop not in (None, "engine"):
        raise UsageError(f"--loop {args.loop} runs one prompt; {count} prompts run through the engine. Fix: "
                         "drop --loop, or use --loop engine")
    loop = args.loop or "engine"
    if loop == "compiled":
        refusal = _compiled_loop_refusal(args)
        if refusal:
            raise UsageError(refusal[1])
    _quant_head(args)
    if loop == "engine":
        from aie_lessons.engine.scheduler import SchedulerConfig

        try:  # the scheduler's own rules, applied before the model is loaded
            SchedulerConfig(args.max_seqs, args.token_budget)
        except ValueError as exc:
            raise UsageError(f"--max-seqs {args.max_seqs} --token-budget {args.token_budget}: {exc}") from exc
        if args.kv == "slots" and args.step not in (None, "eager"):
            raise UsageError(f"--step {args.step} compiles a step over the paged KV cache, and --kv slots asks for "
                             "stage 06's slots. Fix: drop --kv slots, or --step")
        refusal = _compiled_step_refusal(args) if args.step == "compiled" else None
        if refusal:
            raise UsageError(refusal)
    elif (args.max_seqs, args.token_budget, args.step) != (DEFAULT_MAX_SEQS, DEFAULT_TOKEN_BUDGET, None):
        print(f"aie generate: note: --max-seqs, --token-budget and --step only matter for the engine, not --loop "
              f"{loop}", file=sys.stderr)
    return loop


def _as_json(result: GenerationResult, seed: int | None, timings: dict[str, float], loop: str,
             step: str | None = None) -> str:
    """One answer as --json prints it; ``loop`` is the loop that ran, and for the engine ``step``
    the step it ran (after any fallback)."""
    return json.dumps({"prompt_ids": result.prompt_ids, "token_ids": result.token_ids, "text": result.text,
                       "finish_reason": result.finish_reason, "seed": seed, "loop": loop, "step": step,
                       "timings": timings}, ensure_ascii=False)


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


class InOrder:
    """Several prompts' answers on one terminal: labelled, in prompt order, never interleaved.

    Interleaving the streams (a prefix on every fragment) would cut each answer into pieces no one
    can read. Instead the earliest unfinished prompt streams live, and later prompts' text is held
    back and printed the moment their turn comes: text still appears as early as it can, and each
    answer reads in one piece, in the order the prompts were given.
    """

    def __init__(self, prompts: list[str], write: Callable[[str], None] = _write):
        self.labels = [f"=== {i}/{len(prompts)}: {_preview(p)} ===\n" for i, p in enumerate(prompts, 1)]
        self.held = [""] * len(prompts)
        self.done = [False] * len(prompts)
        self.current = 0
        self.write = write
        write(self.labels[0])

    def text(self, index: int, text: str) -> None:
        """Prompt ``index`` produced ``text``: shown now if it is its turn, else held."""
        if index == self.current:
            self.write(text)
        else:
            self.held[index] += text

    def finished(self, index: int) -> None:
        """Prompt ``index`` is done: end its answer if it was showing, and bring on the next ones."""
        self.done[index] = True
        while self.current < len(self.done) and self.done[self.current]:
            self.write("\n")
            self.current += 1
            if self.current < len(self.done):
                self.write("\n" + self.labels[self.current] + self.held[self.current])
                self.held[self.current] = ""


def _preview(prompt: str, width: int = 60) -> str:
    """The prompt on one line, cut to ``width`` characters: enough to tell the answers apart."""
    line = " ".join(prompt.split())
    return line if len(line) <= width else line[: width - 1] + "…"


def _run_engine(args: argparse.Namespace, model: LlamaModel, tokenizer: Tokenizer, prompts: list[str],
                prompt_ids: list[list[int]], params: SamplingParams) -> None:
    """Every prompt through the engine: stage 07's paged KV cache by default, or stage 06's slots."""
    import time
    from dataclasses import replace

    from aie_lessons.engine.engine import Engine, drive
    from aie_lessons.engine.engine_config import EngineConfig, build_engine, compile_buckets, step_of
    from aie_lessons.engine.output_processor import OutputProcessor
    from aie_lessons.engine.outputs import RequestOutput
    from aie_lessons.engine.paged_cache import slot_pool_bytes

    from aie_lessons.infra import ahead_of_time

    count = len(prompts)
    context = model.config.max_position_embeddings
    # Slots just long enough for the longest request: the KV cache is max_seqs × max_len positions,
    # and sizing it for the whole context (8192 for SmolLM2) would take gigabytes for nothing.
    max_len = min(max(map(len, prompt_ids)) + params.max_new_tokens, context)
    max_seqs = min(args.max_seqs, count)
    step = "eager"
    if args.kv == "slots":
        engine = Engine.from_model(model, tokenizer, max_seqs=max_seqs, token_budget=args.token_budget,
                                   max_len=max_len)
        memory = f"{max_seqs} KV slots of {max_len} tokens"
        _check_requests(engine, prompts, prompt_ids, params)
    else:  # the bytes of those slots, in blocks: requests hold only what they have used so far
        kv_bytes = slot_pool_bytes(model.config, max_seqs, max_len, EngineConfig.block_size,
                                   model.embed_tokens.weight.dtype)
        config = EngineConfig(max_seqs=max_seqs, token_budget=args.token_budget, kv_bytes=kv_bytes,
                              step=_engine_step(args, count))
        # --step compiled where it cannot run was refused before the model loaded (_loop)
        compiling: list[str] = []  # said, on a line still open

        def say_compiling(how: str) -> None:
            compiling.append(how)
            print(f"aie generate: compiling the engine's step for batches of {engine.runner.buckets} {how} ...",
                  end="", file=sys.stderr, flush=True)

        def note(text: str) -> None:
            print(("\n" if compiling else "") + f"aie generate: note: {text}", file=sys.stderr)

        # On the CPU ahead of time, so that later runs load it; elsewhere torch.compile, each run.
        compiler = ahead_of_time.AheadOfTime(on_compile=lambda: say_compiling(
            f"for this model on this machine (once: about a minute per batch size), into "
            f"{ahead_of_time.aot_folder()}")) if torch_device_type(args.device) == "cpu" else None
        engine = build_engine(model, tokenizer, config, on_note=note, compiler=compiler)
        _check_requests(engine, prompts, prompt_ids, params)  # a prompt that does not fit waits for no compiler
        try:
            seconds = compile_buckets(engine, None if compiler else lambda _: say_compiling("with torch.compile"))
        except ahead_of_time.CompileFailed as exc:
            why = str(exc).strip().splitlines()[0]
            if config.step == "compiled":
                print(file=sys.stderr)  # end the "compiling ..." line before the refusal
                raise UsageError(f"--step compiled: {why}") from exc
            note(f"the compiled step cannot be built here, so the eager step runs: {why}")
            engine = build_engine(model, tokenizer, replace(config, step="eager"))
            seconds = None
        if seconds is not None and compiling:
            print(f" ready in {seconds:.1f} s", file=sys.stderr, flush=True)
        elif seconds is not None:
            print(f"aie generate: loaded the engine's compiled step from {compiler.folder} in {seconds:.1f} s",
                  file=sys.stderr, flush=True)
        step = step_of(engine)
        allocator = engine.runner.allocator
        memory = f"{allocator.num_blocks} KV blocks of {allocator.block_size} tokens"
    printer = InOrder(prompts) if count > 1 and not args.json else None
    if args.json:
        on_text = [None] * count
    elif printer:
        on_text = [lambda text, i=i: printer.text(i, text) for i in range(count)]
    else:
        on_text = [_write]
    start = time.perf_counter()
    processor = OutputProcessor(engine)
    requests = [engine.add_request(ids, params) for ids in prompt_ids]
    results = [processor.add(request, stream) for request, stream in zip(requests, on_text)]
    index = {request.id: i for i, request in enumerate(requests)}

    def show(outputs: list[RequestOutput]) -> None:
        for request_id in processor.process(outputs):
            if printer:
                printer.finished(index[request_id])

    drive(engine, show)
    seconds = time.perf_counter() - start
    if args.json:
        for request, result in zip(requests, results):
            tpot = request.tpot
            print(_as_json(result, params.seed, {
                "first_token_s": request.ttft or 0.0,  # from arrival: waiting for a slot included
                "total_s": request.latency or 0.0,
                "tokens": len(result.token_ids),
                "decode_tokens_per_s": 1 / tpot if tpot else 0.0,
            }, "engine", step))
    elif not printer:
        print()
    tokens = sum(len(r.output_ids) for r in requests)
    print(f"aie generate: {count} request{'s' * (count > 1)}, {tokens} output tokens in {seconds:.2f} s "
          f"= {tokens / seconds:.1f} tok/s (engine: up to {engine.config.max_seqs} at once, "
          f"{engine.config.token_budget} tokens per step, {memory}, {step} step)", file=sys.stderr)


def _check_requests(engine: Engine, prompts: list[str], prompt_ids: list[list[int]], params: SamplingParams) -> None:
    """Every prompt checked against the engine's limits before any runs, each refusal naming its prompt."""
    from aie_lessons.generate import PromptError

    for i, ids in enumerate(prompt_ids):
        try:
            engine.check_request(ids, params)
        except PromptError as exc:
            raise PromptError(f"prompt {i + 1} of {len(prompts)} ({_preview(prompts[i], 30)!r}): {exc}"
                              if len(prompts) > 1 else str(exc)) from exc


def _compiled_decoder(args: argparse.Namespace, model: LlamaModel, params: SamplingParams) -> FastDecoder | None:
    """Stage 09's decoder for ``model`` (quantized or not), its step compiled ahead of time into
    ``data/cache/inductor/aot`` the first time, so that later runs load it in a moment. None,
    with a note, when it cannot be built and the compiled loop was only the default; refused when it was
    asked for."""
    from aie_lessons.fast_decode import FastDecoder, QuantizedFastDecoder
    from aie_lessons.infra import ahead_of_time
    from aie_lessons.quantized_checkpoint import layer_schemes

    def say_compiling() -> None:
        print("aie generate: compiling the decoder for this model on this machine (once: about a minute), "
              f"into {ahead_of_time.aot_folder()} ...", end="", file=sys.stderr, flush=True)

    compiler = ahead_of_time.AheadOfTime(on_compile=say_compiling)
    try:
        decoder = (QuantizedFastDecoder if layer_schemes(model) else FastDecoder)(model, compile=compiler)
        decoder.warm_up(params)
    except (ValueError, ahead_of_time.CompileFailed) as exc:
        why = str(exc).strip().splitlines()[0]
        if args.loop == "compiled":
            raise UsageError(f"--loop compiled: {why}") from exc
        print(f"\naie generate: note: the compiled decoder cannot run here, so the cached loop runs: {why}",
              file=sys.stderr)
        return None
    if compiler.compiled:
        print(f" ready in {compiler.seconds:.1f} s", file=sys.stderr, flush=True)
    else:
        print(f"aie generate: loaded the compiled decoder from {compiler.folder} in {compiler.seconds:.1f} s",
              file=sys.stderr, flush=True)
    return decoder


def _generate(args: argparse.Namespace) -> int:
    import torch

    from aie_lessons.infra.paths import default_model_dir
    from aie_lessons.model import LlamaModel
    from aie_lessons.tokenizer import Tokenizer

    if args.no_cache or args.compile:
        loop = "skeleton" if args.no_cache else "compiled"
        raise UsageError(f"--no-cache and --compile are now --loop skeleton and "
                         f"--loop compiled. Fix: use --loop {loop}")
    from aie_lessons.infra.compile_cache import use_compile_cache

    use_compile_cache()  # inductor's working files go to data/cache too; set before anything imports it
    check_device(args.device)
    prompts = _prompts(args)
    loop = _loop(args, len(prompts))
    params = _sampling_params(args)  # bad values are refused before the model is loaded
    model_dir = Path(args.model) if args.model else default_model_dir()
    tokenizer = Tokenizer.from_pretrained(model_dir)
    weights = {"dtype": getattr(torch, args.dtype), "device": args.device,
               "activations": getattr(torch, args.activations)}
    if args.quant:  # stage 08: quantized once, then read from the checkpoint's quantized/ folder
        from aie_lessons.quantized_checkpoint import quantized_model

        model = quantized_model(model_dir, args.quant, head=_quant_head(args), **weights)
    else:
        model = LlamaModel.from_pretrained(model_dir, **weights)
    encode = tokenizer.encode_chat if args.chat else tokenizer.encode
    if loop == "engine":
        _run_engine(args, model, tokenizer, prompts, [encode(p) for p in prompts], params)
        return 0
    prompt_ids = encode(prompts[0])
    on_text = None if args.json else _write
    decoder = None
    if loop == "compiled":  # stage 09: fused weights, compiled decode step
        from aie_lessons.generate import check_prompt

        check_prompt(prompt_ids, params, model.config)  # a prompt that does not fit waits for no compiler
        decoder = _compiled_decoder(args, model, params)
        loop = loop if decoder is not None else "cached"
    if loop == "skeleton":  # stage 01: recomputes the whole sequence every step
        from aie_lessons.generate import generate

        result = generate(model, tokenizer, prompt_ids, params, on_text=on_text)
    elif decoder is not None:
        result = decoder.generate(tokenizer, prompt_ids, params, on_text=on_text)
    else:  # stage 04: prefill once, then one cached step per token (also the compiled loop's fallback)
        from aie_lessons.cached_generate import generate_cached

        result = generate_cached(model, tokenizer, [prompt_ids], params,
                                 on_text=on_text and (lambda _index, text: on_text(text)))[0]
    if args.json:
        print(_as_json(result, params.seed, result.timings, loop))
    else:
        print()
    return 0


def _serve(args: argparse.Namespace) -> int:
    """Stage 10: the engine behind an OpenAI-compatible HTTP API, until SIGTERM or Ctrl-C drains it.

    OpenMP keeps its default wait unless ``OMP_WAIT_POLICY`` is set (its threads spin briefly
    between two parallel loops, then sleep): with ``OMP_WAIT_POLICY=PASSIVE`` a saturated server on a 2-core Zen 3 gave 30.6
    instead of 38.5 tok/s, each thread waking from sleep for every one of a step's hundreds of
    small operations."""
    try:
        import fastapi  # noqa: F401 - the serve extra's packages, checked before the model loads
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise UsageError(f"aie serve needs the serve extra ({exc.name} is missing). Fix: "
                         ".venv/bin/pip install -e '.[serve]'") from exc
    from aie_lessons.infra.compile_cache import use_compile_cache

    use_compile_cache()  # the compiled step's code in data/cache, as aie generate's; before inductor is imported
    from aie_lessons.server.config import load_config
    from aie_lessons.server.serve import serve

    config = load_config(args.config).with_overrides(
        host=args.host, port=args.port, model_dir=args.model, dtype=args.dtype, max_seqs=args.max_seqs,
        max_waiting=args.max_waiting, kv_memory_mb=args.kv_memory_mb, drain_timeout_s=args.drain_timeout,
        step=args.step)
    if config.step == "compiled":  # refused now, not after the model has loaded
        from aie_lessons.engine.engine_config import no_compiler_for

        why = no_compiler_for("cpu")  # the server runs the model on the CPU
        if why:
            raise UsageError(f"step compiled: {why}, or --step eager")
    return serve(config)


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

    print(status_table(args.stages))
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


def _lab(args: argparse.Namespace) -> NoReturn:
    from aie_lessons.course.lab import run_lab

    run_lab(port=args.port, open_browser=not args.no_browser)  # becomes JupyterLab: never returns


def port_number(text: str) -> int:
    value = int(text)
    if not 1024 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port from 1024 to 65535")
    return value


def port_or_zero(text: str) -> int:
    """A port for ``aie serve``: 0 asks the system for a free one (the tests' way; the server
    prints the one it got)."""
    return 0 if text.strip() == "0" else port_number(text)


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive number")
    return value


class Parser(argparse.ArgumentParser):
    """argparse, with a bad option reported as one line (and where to look) instead of a usage dump."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


# Stage 09's EngineConfig defaults and steps and stage 08's SCHEMES, named here so that `aie --help`
# does not import torch (a test keeps them equal).
DEFAULT_MAX_SEQS, DEFAULT_TOKEN_BUDGET = 16, 256
ENGINE_STEPS = ("auto", "eager", "compiled")
QUANT_SCHEMES = ("int8", "int4-g192", "int4-g64", "int4-g32")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="aie", description="AI engineering from scratch.")
    commands = parser.add_subparsers(dest="command", required=True)

    fetch = commands.add_parser("fetch-model", help="download and convert the course model")
    fetch.add_argument("--from", dest="source", metavar="DIR",
                       help="use a local HuggingFace Llama-family checkpoint instead")
    fetch.add_argument("--force", action="store_true", help="convert again even if present")
    fetch.set_defaults(run=_fetch_model)

    gen = commands.add_parser("generate", help="generate text for one prompt or several, streamed to stdout")
    gen.add_argument("prompts", nargs="*", metavar="PROMPT",
                     help="one prompt, or several (several run through the stage 06 engine)")
    gen.add_argument("--prompt", action="append", metavar="TEXT",
                     help="one more prompt (repeatable; after the positional ones)")
    gen.add_argument("--prompts-file", metavar="PATH",
                     help='one prompt per line, or a .jsonl file with one {"prompt": ...} per line; '
                          "blank lines are skipped")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--stop", action="append", metavar="TEXT", help="stop string (repeatable)")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object per prompt (one per line, in prompt order) at the end")
    gen.add_argument("--loop", choices=["skeleton", "cached", "compiled", "engine"],
                     help="engine: continuous batching over the paged KV cache (stages 06-09), the default, for "
                          "one prompt or many; or, for one prompt, a lesson's own loop: skeleton (stage 01, no KV "
                          "cache: slow, for comparison), cached (stage 04's KV cache) or compiled (stage 09's "
                          "batch-1 decoder, compiled ahead of time)")
    gen.add_argument("--max-seqs", type=int, default=DEFAULT_MAX_SEQS, metavar="N",
                     help=f"engine: requests running at once (default {DEFAULT_MAX_SEQS})")
    gen.add_argument("--token-budget", type=int, default=DEFAULT_TOKEN_BUDGET, metavar="N",
                     help=f"engine: tokens per step, prefill chunks included (default {DEFAULT_TOKEN_BUDGET}; "
                          "at least --max-seqs)")
    gen.add_argument("--step", choices=ENGINE_STEPS,
                     help="engine: its decode step — auto (the default for one prompt: stage 09's step, compiled "
                          "where it can run — float32 activations, a C++ compiler, a kernel for --quant; a "
                          "machine's first run compiles it into data/cache/inductor/aot, later ones load it — "
                          "eager otherwise, with the reason), eager (the default for several prompts: a few do "
                          "not pay back compiling a step per batch size) or compiled (refused where it cannot run)")
    gen.add_argument("--kv", choices=["paged", "slots"], default="paged",
                     help="engine: KV memory in blocks of 16 tokens (stage 07, the default) or one slot "
                          "per request (stage 06); both get the bytes of --max-seqs slots")
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
    gen.add_argument("--quant", choices=QUANT_SCHEMES, metavar="SCHEME",
                     help=f"quantize the blocks' weights (stage 08): {', '.join(QUANT_SCHEMES)}; made once, "
                          "then read from the checkpoint's quantized/ folder")
    head = gen.add_mutually_exclusive_group()
    head.add_argument("--quant-head", action="store_true", help="with --quant: the output head too, in --quant's scheme")
    head.add_argument("--quant-head-scheme", choices=QUANT_SCHEMES, metavar="SCHEME",
                      help="with --quant: the output head in SCHEME (int8 beside int4 blocks: a quarter of an fp32 "
                           "head's bytes, as llama.cpp's 4-bit files keep a 6-bit head)")
    gen.add_argument("--device", default="cpu", help="cpu or cuda")
    gen.add_argument("--model", metavar="DIR", help="checkpoint folder (default: the fetched model)")
    gen.set_defaults(run=_generate)

    srv = commands.add_parser("serve", help="serve the engine over HTTP: OpenAI-compatible, on 127.0.0.1")
    srv.add_argument("--config", type=Path, metavar="FILE",
                     help="a YAML file of settings (server/config.py's ServeConfig lists them); flags override it")
    srv.add_argument("--host", help="address to listen on (default 127.0.0.1; another needs an api_key)")
    srv.add_argument("--port", type=port_or_zero, help="default 8000; 0 picks a free one")
    srv.add_argument("--model", metavar="DIR", help="checkpoint folder (default: the fetched model)")
    srv.add_argument("--dtype", choices=("float32", "bfloat16"), help="the weights' dtype (default float32)")
    srv.add_argument("--max-seqs", type=positive_int, metavar="N", help="requests running at once (default 16)")
    srv.add_argument("--max-waiting", type=int, metavar="N",
                     help="accepted requests waiting to run; one more gets 503 (default 64)")
    srv.add_argument("--kv-memory-mb", type=float, metavar="MB", help="the paged KV pool (default: stage 07's)")
    srv.add_argument("--step", choices=ENGINE_STEPS,
                     help="the engine's decode step: auto (the default: compiled where it can run — a C++ "
                          "compiler on the CPU, Triton on a GPU — for the powers of two below --max-seqs and "
                          "--max-seqs itself, before the server says ready; it keeps a second, packed copy of the "
                          "weights; eager otherwise, with the reason in the log), eager (starts in seconds), "
                          "or compiled")
    srv.add_argument("--drain-timeout", type=float, metavar="SECONDS",
                     help="on SIGTERM, how long in-flight requests may take to finish (default 20)")
    srv.set_defaults(run=_serve)

    env = commands.add_parser("env", help="report versions, hardware and Triton availability")
    env.set_defaults(run=_env)

    grade = commands.add_parser("grade", help="grade a folder of a learner's notebooks")
    grade.add_argument("submission", metavar="SUBMISSION_DIR")
    grade.add_argument("--stages", help="comma-separated stage numbers, e.g. 01,02")
    grade.add_argument("--junit", metavar="FILE", help="also write JUnit XML")
    grade.add_argument("--cell-timeout", type=positive_int, default=300, metavar="SECONDS",
                       help="a cell running longer fails (default 300)")
    grade.set_defaults(run=_grade)

    lab = commands.add_parser("lab", help="serve the learner notebooks in JupyterLab (loopback only)")
    lab.add_argument("--port", type=port_number, help="default: the first free one from 8888")
    lab.add_argument("--no-browser", action="store_true", help="print the URL, do not open a browser")
    lab.set_defaults(run=_lab)

    status = commands.add_parser("status", help="your stages: committed or reference, checks")
    status.add_argument("stages", metavar="NN", nargs="*", help="only these stages (default: every stage)")
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
    ("aie_lessons.engine.engine_config", "StepUnavailable"),
    ("aie_lessons.generate", "PromptError"),
    ("aie_lessons.infra.model_files", "ModelFilesError"),
    ("aie_lessons.kv_cache", "CacheFullError"),
    ("aie_lessons.sampling", "SamplingParamsError"),
    ("aie_lessons.server.config", "ServeConfigError"),
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
