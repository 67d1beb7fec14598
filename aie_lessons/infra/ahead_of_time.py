"""Stage 09's decode step compiled ahead of time (AOTInductor), so a new process loads it in
milliseconds.

``torch.compile`` keeps its generated code on disk (``compile_cache``), but every new process
still traces the Python of the step again before it can look that code up: seconds of
``aie generate``'s start-up, which a short answer never earns back. ``torch.export`` traces the
step once into a graph, AOTInductor compiles the graph into a shared library packaged as a
``.pt2`` file, and a later process only ``dlopen``s it. So the compiled decoder pays off from
the first token, and ``aie generate`` uses it for every answer.

The packages live in ``data/cache/inductor/aot/`` (beside inductor's own cache, wherever
``TORCHINDUCTOR_CACHE_DIR`` puts it), one per compiled function, named by a hash of all
they depend on: the PyTorch version, the CPU's vector instructions, the source of the modules
the step is made of (a learner's recommitted stage 09 compiles anew) and the exact structure,
dtypes and shapes of the weights. Delete the folder (``make clean`` does) to compile again.

What varies within a model is given to ``torch.export`` as dynamic sizes: the length of a
request's KV cache and RoPE tables, and the position ``t``. An ``int`` argument cannot stay
symbolic through AOTInductor, so ``t`` travels as the length of an empty (t, 0) tensor — a
view of one preallocated tensor, free to make.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import platform
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

from aie_lessons.fast_decode import FastDecoder, decode_head, decode_layers
from aie_lessons.infra.compile_cache import INDUCTOR_CACHE, INDUCTOR_CACHE_ENV

# Size checks on every input at every call: dynamo's guards are gone, but the shapes are ours
# (the decoder builds every input), so the wrapper's re-check of each stride is skipped.
INDUCTOR_OPTIONS = {"size_asserts": False}
# The modules whose code ends up inside the compiled step: a change to any must compile anew.
STEP_SOURCES = ("aie_lessons.fast_decode", "aie_lessons.model", "aie_lessons.quantize")


def aot_folder() -> Path:
    """Where the packages are kept: ``aot`` in inductor's cache folder (``compile_cache``)."""
    return Path(os.environ.get(INDUCTOR_CACHE_ENV, INDUCTOR_CACHE)) / "aot"


def leaves(value: Any) -> list[torch.Tensor]:
    """The tensors in ``value`` — nested tuples, lists and dataclasses (a ``KernelMatrix``) — in
    a fixed order: what the exported function takes as its flat inputs."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in leaves(item)]
    if dataclasses.is_dataclass(value):
        return [t for f in dataclasses.fields(value) for t in leaves(getattr(value, f.name))]
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
        return dataclasses.replace(value, **{f.name: rebuild(getattr(value, f.name), tensors)
                                             for f in dataclasses.fields(value) if f.init})
    return value


def structure(value: Any) -> str:
    """What a compiled function is specialised to: each tensor's dtype and shape, and every other
    value (a scheme, a flag) as written. Two inputs with one ``structure`` share a package."""
    if isinstance(value, torch.Tensor):
        return f"{value.dtype}{tuple(value.shape)}"
    if isinstance(value, (tuple, list)):
        return "(" + ",".join(structure(item) for item in value) + ")"
    if dataclasses.is_dataclass(value):
        return type(value).__name__ + structure([getattr(value, f.name) for f in dataclasses.fields(value)])
    return repr(value)


def package_key(*parts: str) -> str:
    """A hash of everything a compiled package depends on (see the module docstring)."""
    sources = b"".join(Path(sys.modules[name].__file__).read_bytes() for name in STEP_SOURCES)
    # ATen's name for the widest vector instructions here (AVX512, AVX2…): free to read, where
    # inductor's own choice compiles test programs (seconds). Code built for one runs on any
    # machine with the same name, so a copied cache folder is safe.
    machine = f"{platform.machine()}-{torch.backends.cpu.get_cpu_capability()}"
    text = "|".join((torch.__version__, machine, hashlib.sha256(sources).hexdigest(), *parts))
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
    """The step could not be exported or compiled here (a C++ compiler that fails, an operation
    AOTInductor cannot take); the message is the first line of the reason."""


@dataclasses.dataclass
class AheadOfTime:
    """What ``compile_ahead`` did: ``compiled`` packages (and the seconds it took), or only
    ``loaded`` ones."""

    folder: Path
    compiled: int
    loaded: int
    seconds: float


def _package(folder: Path, key: str, export: Callable[[], torch.export.ExportedProgram]) -> tuple[Any, bool]:
    """The loaded package ``key`` from ``folder``, compiled first (True) if it is not there; its
    ``boxed_run(list of tensors)`` returns the function's outputs as a list.
    Written under a temporary name and renamed, so a process stopped mid-way leaves no half file."""
    path = folder / f"{key}.pt2"
    compiled = not path.exists()
    if compiled:
        folder.mkdir(parents=True, exist_ok=True)
        partial = folder / f"{key}.{os.getpid()}.partial.pt2"
        try:
            with warnings.catch_warnings():  # PyTorch's packaging trips a deprecation of its own (LeafSpec)
                warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
                torch._inductor.aoti_compile_and_package(export(), package_path=str(partial),
                                                         inductor_configs=INDUCTOR_OPTIONS)
        except Exception as exc:  # export's and inductor's errors share no base class: each is reported
            partial.unlink(missing_ok=True)
            raise CompileFailed(f"{type(exc).__name__}: {str(exc).strip() or 'no message'}") from exc
        os.replace(partial, path)
    # The loader that ``torch._inductor.aoti_load_package`` wraps, taken directly: the wrapper first
    # asks inductor which vector instructions this CPU has, which compiles and loads test programs
    # in child processes (2 s per process), only to warn on a mismatch the package's name already
    # rules out; and at every call it re-parses the argument layout that ours never changes.
    return torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1), compiled


def compile_ahead(decoder: FastDecoder, greedy: bool, folder: Path | None = None,
                  on_compile: Callable[[], None] | None = None) -> AheadOfTime:
    """Give ``decoder`` (built with ``compile=False``) an ahead-of-time compiled step: its
    ``decode_layers`` and ``decode_head`` become calls into packages from ``folder`` (default
    ``aot_folder()``), compiled there first where missing; ``on_compile`` is called before the
    first compile, to tell the user about the wait. ``greedy`` chooses the head's version: the
    next token, or the logits for sampling. The decoder then decodes as before, from any process.
    """
    if decoder.decode_layers is not decode_layers:
        raise ValueError("compile_ahead takes a decoder built with compile=False: its step is compiled here")
    folder = folder or aot_folder()
    start, counts = time.perf_counter(), {True: 0, False: 0}
    config, name = decoder.model.config, type(decoder).__name__
    # Example inputs: a three-token request with room for 16 (sizes 0 and 1 would be taken
    # for constants by the tracer); the cache length and the position are marked dynamic.
    calls, cos, sin, _ = decoder._prefill([0, 0, 0], 16)
    x = decoder.embed[0].float()
    marker = torch.empty(config.max_position_embeddings, 0, device=x.device)
    length = torch.export.Dim("cache_length", min=3, max=config.max_position_embeddings)
    position = torch.export.Dim("position", min=1, max=config.max_position_embeddings - 1)
    loaded: dict[str, Any] = {}  # calls whose layers have one structure share one package

    def package(key: str, export: Callable[[], torch.export.ExportedProgram]) -> Any:
        if key not in loaded:
            if not counts[True] and on_compile and not (folder / f"{key}.pt2").exists():
                on_compile()
            loaded[key], compiled = _package(folder, key, export)
            counts[compiled] += 1
        return loaded[key]

    def export_layers(layers: list[Any]) -> torch.export.ExportedProgram:
        cache = tuple(size for _, _, weights in layers  # each layer's keys and values, then its weights
                      for size in ({1: length}, {1: length}, *[None] * len(leaves(weights))))
        return torch.export.export(_Layers(decoder, layers), (x, marker[:3], cos, sin, *leaves(layers)),
                                   dynamic_shapes=(None, {0: position}, {0: length}, {0: length}, cache))

    # A request's calls are new lists each time, but their weights are the decoder's own: the
    # first weight of a call's first layer names the call.
    by_call = {id(layers[0][2][0]): package(package_key("layers", name, repr(config), structure(layers)),
                                            lambda layers=layers: export_layers(layers))
               for layers in calls}
    head_tensors = leaves(decoder.head)
    head = package(package_key("head", name, repr(config), structure(decoder.head), str(greedy)),
                   lambda: torch.export.export(_Head(decoder, greedy), (x, decoder.final_norm, *head_tensors)))

    def run_layers(x, t, cos, sin, eps, matvec, layers):
        """``decode_layers``' signature; eps and matvec are compiled in."""
        return by_call[id(layers[0][2][0])].boxed_run([x, marker[:t], cos, sin, *leaves(layers)])[0], ()

    def run_head(x, norm, eps, weights, matvec, greedy_step):
        """``decode_head``'s signature; all but x and the norm are compiled in."""
        if greedy_step != greedy:
            raise ValueError(f"this decoder's head was compiled ahead for greedy={greedy}, and this step asks "
                             f"for {'the next token' if greedy_step else 'logits'}. Fix: compile_ahead(decoder, "
                             f"greedy={greedy_step}) on a new decoder")
        return head.boxed_run([x, norm, *head_tensors])[0], ()

    decoder.decode_layers, decoder.decode_head = run_layers, run_head
    return AheadOfTime(folder, counts[True], counts[False], time.perf_counter() - start)
