"""Stage 09's decode step compiled ahead of time (AOTInductor), so a new process loads it in
milliseconds.

``torch.compile`` keeps its generated code on disk (``compile_cache``), but every new process
still traces the Python of the step again before it can look that code up: seconds of
``aie generate``'s start-up, which a short answer never earns back. ``torch.export`` traces the
step once into a graph, AOTInductor compiles the graph into a shared library packaged as a
``.pt2`` file, and a later process only ``dlopen``s it. So the compiled decoder pays off from
the first token, and ``aie generate`` uses it for every answer.

The packages live in ``data/cache/inductor/aot/`` (beside inductor's own cache, wherever
``TORCHINDUCTOR_CACHE_DIR`` puts it), one per compiled function, named by a hash of all they
depend on: the PyTorch version, the CPU's instruction set extensions (inductor compiles for
this very CPU), the source of the modules the step is made of (a learner's recommitted stage 09
compiles anew, as does an edit of this module), the decoder's class and the exact structure,
dtypes, shapes and device of the weights. Delete the folder (``make clean`` does) to compile
again. Two processes compiling the same package both finish; the last rename wins.

What varies within a model is given to ``torch.export`` as dynamic sizes: the length of a
request's KV cache and RoPE tables, and the position ``t``. An ``int`` argument cannot stay
symbolic through AOTInductor, so ``t`` travels as the length of an empty (t, 0) tensor — a
view of one preallocated tensor, free to make.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import os
import platform
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

from aie_lessons.fast_decode import FastDecoder, decode_head, decode_layers
from aie_lessons.infra.compile_cache import INDUCTOR_CACHE, INDUCTOR_CACHE_ENV, cache_folder

# The modules whose code ends up inside the compiled step: a change to any must compile anew.
STEP_SOURCES = ("aie_lessons.fast_decode", "aie_lessons.model", "aie_lessons.quantize", __name__)
# The sizes the layers' package was exported for, kept in its metadata: export infers their
# ranges from the step's code (with bf16 weights, a position of 1 falls outside), and a package
# does not check its inputs, so a step outside them runs eagerly instead.
SIZES = ("position", "cos")


def aot_folder() -> Path:
    """Where the packages are kept: ``aot`` in inductor's cache folder (``compile_cache``)."""
    return Path(os.environ.get(INDUCTOR_CACHE_ENV) or cache_folder(INDUCTOR_CACHE)) / "aot"


def _fields(value: Any) -> list[str]:
    """The fields of a dataclass that ``leaves``, ``rebuild`` and ``structure`` all walk."""
    return [f.name for f in dataclasses.fields(value) if f.init]


def leaves(value: Any) -> list[torch.Tensor]:
    """The tensors in ``value`` — nested tuples, lists and dataclasses (a ``KernelMatrix``) — in
    a fixed order: what the exported function takes as its flat inputs. Any other container
    would hide its tensors, which export would then bake in as constants: refused."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in leaves(item)]
    if dataclasses.is_dataclass(value):
        return [t for name in _fields(value) for t in leaves(getattr(value, name))]
    if isinstance(value, dict):
        raise TypeError("compile_ahead takes weights in tuples, lists and dataclasses, not dicts")
    return []


def rebuild(value: Any, tensors: Any) -> Any:
    """``value`` with its tensors replaced, in ``leaves`` order, by the next ones of the iterator
    ``tensors``; everything else (a ``QuantScheme``) is kept: how the exported function turns its
    flat inputs back into the arguments ``decode_layers`` and ``decode_head`` expect."""
    if isinstance(value, torch.Tensor):
        return next(tensors)
    if isinstance(value, (tuple, list)):
        return type(value)(rebuild(item, tensors) for item in value)
    if dataclasses.is_dataclass(value) and leaves(value):
        return dataclasses.replace(value, **{name: rebuild(getattr(value, name), tensors) for name in _fields(value)})
    return value


def structure(value: Any) -> str:
    """What a compiled function is specialised to: each tensor's dtype, shape and device, and
    every other value (a scheme, a flag) as written. Two inputs with one ``structure`` share a
    package."""
    if isinstance(value, torch.Tensor):
        return f"{value.dtype}{tuple(value.shape)}@{value.device}"
    if isinstance(value, (tuple, list)):
        return "(" + ",".join(structure(item) for item in value) + ")"
    if dataclasses.is_dataclass(value):
        return type(value).__name__ + structure([getattr(value, name) for name in _fields(value)])
    return repr(value)


def _class_source(cls: type) -> bytes:
    """The source of the module that defines ``cls``, or, for a class typed into a notebook
    (no file holds it), the bytecode of its methods."""
    try:
        return inspect.getsource(sys.modules[cls.__module__]).encode()
    except (OSError, TypeError):
        methods = (getattr(f, "__func__", f) for f in vars(cls).values())
        return b"".join(f.__code__.co_code for f in methods if hasattr(f, "__code__"))


def package_key(decoder: FastDecoder, *parts: str) -> str:
    """A hash of everything a compiled package depends on (see the module docstring)."""
    cls = type(decoder)
    sources = [Path(sys.modules[name].__file__).read_bytes() for name in STEP_SOURCES]
    sources.append(_class_source(cls))  # a subclass's own pack and matvec
    # Inductor compiles for this CPU (-march=native on x86): the extensions it may use are the
    # CPU's flags, which torch reads from cpuinfo for free (inductor's own ISA check compiles
    # test programs, seconds). A cache copied to a CPU with other extensions compiles anew.
    flags = ",".join(sorted(name for name, present in torch.cpu.get_capabilities().items() if present))
    text = "|".join((torch.__version__, platform.machine(), flags, hashlib.sha256(b"".join(sources)).hexdigest(),
                     f"{cls.__module__}.{cls.__qualname__}", repr(decoder.model.config), *parts))
    return hashlib.sha256(text.encode()).hexdigest()[:24]


class _Layers(torch.nn.Module):
    """``decode_layers`` over one call's layers, taking flat tensors: x, the position marker, the
    RoPE tables, then each layer's keys, values and weights."""

    def __init__(self, decoder: FastDecoder, layers: list[Any]):
        super().__init__()
        self.eps, self.matvec, self.layers = decoder.eps, decoder.matvec, layers

    def forward(self, x, position, cos, sin, *tensors):
        layers = rebuild(self.layers, iter(tensors))
        return decode_layers(x, position.shape[0], cos, sin, self.eps, self.matvec, layers)


class _Head(torch.nn.Module):
    """``decode_head`` taking flat tensors: x, the final norm, then the head's matrices."""

    def __init__(self, decoder: FastDecoder, greedy: bool):
        super().__init__()
        self.eps, self.matvec, self.head, self.greedy = decoder.eps, decoder.matvec, decoder.head, greedy

    def forward(self, x, norm, *tensors):
        return decode_head(x, norm, self.eps, rebuild(self.head, iter(tensors)), self.matvec, self.greedy)


class CompileFailed(RuntimeError):
    """The step could not be exported, compiled or loaded here (a C++ compiler that fails, an
    operation AOTInductor cannot take); the first line says why, the rest where the details are."""


@dataclasses.dataclass
class AheadOfTime:
    """What ``compile_ahead`` did: how many packages it ``compiled`` (0: all were loaded), the
    folder, and the seconds it took."""

    folder: Path
    compiled: int
    seconds: float


def size_ranges(program: torch.export.ExportedProgram) -> dict[str, str]:
    """For each input named in ``SIZES``, the range of its first size that ``program`` takes, as
    "low,high" (the package's metadata holds strings); a size export kept fixed is its own range."""
    ranges = {}
    for node in program.graph.nodes:
        if node.op == "placeholder" and node.name in SIZES:
            size = node.meta["val"].shape[0]
            if isinstance(size, int):
                low = high = size
            else:
                bounds = program.range_constraints[size.node.expr]
                low, high = int(bounds.lower), int(min(bounds.upper, sys.maxsize))
            ranges[f"aie_{node.name}"] = f"{low},{high}"
    return ranges


def _compile(folder: Path, path: Path, export: Callable[[], torch.export.ExportedProgram]) -> None:
    """Export and compile into ``path``, through a temporary file renamed at the end, so that a
    process stopped mid-way (Ctrl-C included) or a second one compiling too leaves no half file.
    A failure's whole story goes to ``failure.log`` beside it; the error says the first line."""
    folder.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(dir=folder, prefix=f".{path.stem}.", suffix=".partial.pt2")
    os.close(handle)
    try:
        with warnings.catch_warnings():  # PyTorch's packaging trips a deprecation of its own (LeafSpec)
            warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
            program = export()
            torch._inductor.aoti_compile_and_package(
                program, package_path=partial, inductor_configs={"aot_inductor.metadata": size_ranges(program)})
        os.replace(partial, path)
    except Exception as exc:  # export's and inductor's errors share no base class: each is reported
        log = folder / "failure.log"
        log.write_text("".join(traceback.format_exception(exc)))
        first = next((line for line in str(exc).splitlines() if line.strip()), "no message")
        raise CompileFailed(f"{type(exc).__name__}: {first.strip()} (the whole error: {log})") from exc
    finally:
        Path(partial).unlink(missing_ok=True)


def _load(path: Path) -> Any:
    """The loaded package; its ``boxed_run(list of tensors)`` returns the function's outputs.

    The loader that ``torch._inductor.aoti_load_package`` wraps, taken directly: the wrapper first
    asks inductor which vector instructions this CPU has, which compiles and loads test programs
    in child processes (2 s per process), only to log a mismatch that the package's key (the
    CPU's flags) already rules out; and at every call it re-parses the argument layout that ours
    never changes.
    """
    return torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)


def _package(folder: Path, key: str, export: Callable[[], torch.export.ExportedProgram]) -> tuple[Any, bool]:
    """The package ``key`` from ``folder``, loaded, and whether it had to be compiled first. A
    package that does not load (a truncated or foreign file) is compiled again in its place."""
    path = folder / f"{key}.pt2"
    if path.exists():
        try:
            return _load(path), False
        except RuntimeError:
            path.unlink(missing_ok=True)
    _compile(folder, path, export)
    try:
        return _load(path), True
    except RuntimeError as exc:
        raise CompileFailed(f"the package {path} was compiled but does not load: {exc}") from exc


@torch.no_grad()
def compile_ahead(decoder: FastDecoder, greedy: bool, folder: Path | None = None,
                  on_compile: Callable[[], None] | None = None) -> AheadOfTime:
    """Give ``decoder`` (built with ``compile=False``) an ahead-of-time compiled step: its
    ``decode_layers`` and ``decode_head`` become calls into packages from ``folder`` (default
    ``aot_folder()``), compiled there first where missing; ``on_compile`` is called before the
    first compile, to tell the user about the wait. ``greedy`` chooses the head's version: the
    next token, or the logits for sampling. The decoder then decodes as before, from any process.
    """
    if decoder.decode_layers is not decode_layers or decoder.decode_head is not decode_head:
        raise ValueError("compile_ahead takes a decoder whose step is not compiled yet: built with "
                         "compile=False, and not given to compile_ahead before")
    folder = folder or aot_folder()
    start, compiled = time.perf_counter(), 0
    config = decoder.model.config
    # Example inputs: a three-token request with room for 16 (sizes 0 and 1 would be taken
    # for constants by the tracer); the cache length and the position are marked dynamic.
    calls, cos, sin, _ = decoder._prefill([0, 0, 0], 16)
    x = decoder.embed[0].float()
    marker = torch.empty(config.max_position_embeddings, 0, device=x.device)
    auto = torch.export.Dim.AUTO  # dynamic, in the range the step's code allows (size_ranges)
    loaded: dict[str, Any] = {}  # calls whose layers have one structure share one package

    def package(key: str, export: Callable[[], torch.export.ExportedProgram]) -> Any:
        nonlocal compiled
        if key not in loaded:
            if not compiled and on_compile and not (folder / f"{key}.pt2").exists():
                on_compile()
            loaded[key], fresh = _package(folder, key, export)
            compiled += fresh
        return loaded[key]

    def export_layers(layers: list[Any]) -> torch.export.ExportedProgram:
        cache = tuple(size for _, _, weights in layers  # each layer's keys and values, then its weights
                      for size in ({1: auto}, {1: auto}, *[None] * len(leaves(weights))))
        return torch.export.export(_Layers(decoder, layers), (x, marker[:3], cos, sin, *leaves(layers)),
                                   dynamic_shapes=(None, {0: auto}, {0: auto}, {0: auto}, cache))

    # A request's calls are new lists each time, but their weights are the decoder's own: the
    # first weight of a call's first layer names the call. Its weights' tensors are gathered once.
    by_call = {}
    for layers in calls:
        runner = package(package_key(decoder, "layers", structure(layers)), lambda layers=layers: export_layers(layers))
        metadata = runner.get_metadata()
        (t_low, t_high), (s_low, s_high) = (map(int, metadata[f"aie_{name}"].split(",")) for name in SIZES)
        by_call[id(layers[0][2][0])] = (runner, [leaves(weights) for _, _, weights in layers],
                                        range(t_low, t_high + 1), range(s_low, s_high + 1))
    head_tensors = leaves(decoder.head)
    head = package(package_key(decoder, "head", structure(decoder.head), str(greedy)),
                   lambda: torch.export.export(_Head(decoder, greedy), (x, decoder.final_norm, *head_tensors)))

    def run_layers(x, t, cos, sin, eps, matvec, layers):
        """``decode_layers``' signature; eps and matvec are compiled in."""
        runner, weights, positions, lengths = by_call[id(layers[0][2][0])]
        if t not in positions or cos.shape[0] not in lengths:  # outside the package's sizes (SIZES)
            return decode_layers(x, t, cos, sin, eps, matvec, layers)
        inputs = [x, marker[:t], cos, sin]
        for (keys, values, _), tensors in zip(layers, weights):
            inputs += (keys, values, *tensors)
        return runner.boxed_run(inputs)[0], ()

    def run_head(x, norm, eps, weights, matvec, greedy_step):
        """``decode_head``'s signature; all but x and the norm are compiled in."""
        if greedy_step != greedy:
            raise ValueError(f"this decoder's head was compiled ahead for greedy={greedy}, and this step asks "
                             f"for {'the next token' if greedy_step else 'logits'}. Fix: compile_ahead(decoder, "
                             f"greedy={greedy_step}) on a new decoder")
        return head.boxed_run([x, norm, *head_tensors])[0], ()

    decoder.decode_layers, decoder.decode_head = run_layers, run_head
    return AheadOfTime(folder, compiled, time.perf_counter() - start)
