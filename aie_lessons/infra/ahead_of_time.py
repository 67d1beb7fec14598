"""Compiled steps ahead of time (AOTInductor): a compiler used where ``torch.compile`` would
be, whose code a later process loads in milliseconds.

``torch.compile`` keeps its generated code on disk (``compile_cache``), but every new process
still traces the Python of the step again before it can look that code up: seconds of
``aie generate``'s start-up, which a short answer never earns back. ``torch.export`` traces the
step once into a graph, AOTInductor compiles the graph into a shared library packaged as a
``.pt2`` file, and a later process only ``dlopen``s it.

``AheadOfTime()`` is a compiler: ``step = AheadOfTime()(fn)``, then ``step(*args)``, as with
``torch.compile(fn)``; stage 09's ``FastDecoder`` and ``CompiledPagedRunner`` take it as their
``compile`` option. The first call with a new kind of arguments exports ``fn`` with them as the
examples and compiles a package — or loads the one an earlier process compiled — and runs it;
later calls run the package. What the arguments become:

- tensors, anywhere in nested tuples, lists and dataclasses, are the package's inputs. Their
  sizes are fixed, except the dimensions marked dynamic (``torch._dynamo.mark_dynamic``, as for
  ``torch.compile``), which stay symbols;
- an ``int`` argument (at the top level) is a size too — a position — and travels as the length
  of an empty tensor, since an ``int`` cannot stay symbolic through AOTInductor;
- everything else (a float, a function such as the step's ``matvec``, a flag, a quantization
  scheme) is compiled in: another value gets another package.

Export infers from the code the range of each dynamic size (with bf16 weights a position of 1
falls outside it), and a package does not check its inputs; so a call outside its package's
ranges runs ``fn`` eagerly, as does a call with a dynamic size of 0 or 1 before its package
exists (the tracer would take those sizes for constants).

The packages live in ``data/cache/inductor/aot/`` (beside inductor's own cache, wherever
``TORCHINDUCTOR_CACHE_DIR`` puts it), named by a hash of all they depend on: the PyTorch version,
the CPU's instruction set extensions (inductor compiles for this very CPU), the source of the
modules the step is made of (a learner's recommitted stage 09 compiles anew, as does an edit of
this module) and of any function passed in, the function's name and the exact structure, dtypes,
shapes and device of its arguments. Delete the folder (``make clean`` does) to compile again. Two
processes compiling the same package both finish; the last rename wins.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import inspect
import marshal
import os
import platform
import sys
import tempfile
import time
import traceback
import warnings
import weakref
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch.utils import _pytree as pytree

from aie_lessons.infra.compile_cache import INDUCTOR_CACHE, INDUCTOR_CACHE_ENV, cache_folder

# The modules whose code ends up inside a compiled step: a change to any must compile anew.
STEP_SOURCES = ("aie_lessons.fast_decode", "aie_lessons.engine.compiled_runner", "aie_lessons.model",
                "aie_lessons.quantize", "aie_lessons.infra.int_kernels", __name__)


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
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [t for name in _fields(value) for t in leaves(getattr(value, name))]
    if isinstance(value, dict):
        raise TypeError("an ahead-of-time step takes its tensors in tuples, lists and dataclasses, not dicts")
    return []


def rebuild(value: Any, tensors: Any) -> Any:
    """``value`` with its tensors replaced, in ``leaves`` order, by the next ones of the iterator
    ``tensors``; everything else (a ``QuantScheme``) is kept: how the exported function turns its
    flat inputs back into the arguments the step expects."""
    if isinstance(value, torch.Tensor):
        return next(tensors)
    if isinstance(value, (tuple, list)):
        return type(value)(rebuild(item, tensors) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type) and leaves(value):
        return dataclasses.replace(value, **{name: rebuild(getattr(value, name), tensors) for name in _fields(value)})
    return value


def dynamic_dims(tensor: torch.Tensor) -> tuple[int, ...]:
    """The dimensions of ``tensor`` marked dynamic with ``torch._dynamo.mark_dynamic``."""
    return tuple(sorted(getattr(tensor, "_dynamo_dynamic_indices", ())))


def structure(value: Any) -> str:
    """What a compiled function is specialised to: each tensor's dtype, shape (a dynamic size as
    ``?``) and device, each function by name, and every other value (a scheme, a flag) as
    written. Two calls with one ``structure`` share a package."""
    if isinstance(value, torch.Tensor):
        dims = dynamic_dims(value)
        shape = ",".join("?" if i in dims else str(size) for i, size in enumerate(value.shape))
        return f"{value.dtype}({shape})@{value.device}"
    if isinstance(value, (tuple, list)):
        return "(" + ",".join(structure(item) for item in value) + ")"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return type(value).__name__ + structure([getattr(value, name) for name in _fields(value)])
    if callable(value):
        return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', type(value).__name__)}"
    return repr(value)


def _function_source(function: Callable) -> bytes:
    """The source of ``function``, or, for one typed into a notebook (no file holds it), its code."""
    function = getattr(function, "__func__", function)
    try:
        return inspect.getsource(function).encode()
    except (OSError, TypeError):  # its whole code object: the bytecode alone leaves out the constants
        code = getattr(function, "__code__", None)
        return marshal.dumps(code) if code is not None else repr(function).encode()


def package_key(function: Callable, args: tuple[Any, ...]) -> str:
    """A hash of everything a compiled package depends on (see the module docstring). An int
    argument is a size, so its value is left out: one package serves every position."""
    sources = [Path(importlib.import_module(name).__file__).read_bytes() for name in STEP_SOURCES]
    functions = [value for value in pytree.tree_leaves(args) if callable(value)]
    if any(inspect.ismethod(value) for value in (function, *functions)):
        raise TypeError("an ahead-of-time step takes plain functions (or staticmethods), not bound methods, whose "
                        "object's tensors would be compiled in as constants. Fix: pass what the method needs "
                        "as arguments")
    sources += [_function_source(value) for value in functions]
    args = tuple("int" if _is_size(value) else value for value in args)
    # Inductor compiles for this CPU (-march=native on x86): the extensions it may use are the
    # CPU's flags, which torch reads from cpuinfo for free (inductor's own ISA check compiles
    # test programs, seconds). A cache copied to a CPU with other extensions compiles anew.
    flags = ",".join(sorted(name for name, present in torch.cpu.get_capabilities().items() if present))
    text = "|".join((torch.__version__, platform.machine(), flags, hashlib.sha256(b"".join(sources)).hexdigest(),
                     structure(function), structure(args)))
    return hashlib.sha256(text.encode()).hexdigest()[:24]


class _Flat(torch.nn.Module):
    """``function`` taking flat tensors: the tensors of ``args`` in ``leaves`` order, then one
    empty (n, 0) tensor per ``int`` argument, whose length n is that argument."""

    def __init__(self, function: Callable, args: tuple[Any, ...]):
        super().__init__()
        self.function, self.args = function, args
        self.ints = [i for i, value in enumerate(args) if _is_size(value)]

    def forward(self, *inputs):
        tensors = iter(inputs[:len(inputs) - len(self.ints)])
        args = list(rebuild(self.args, tensors))
        for i, marker in zip(self.ints, inputs[len(inputs) - len(self.ints):]):
            args[i] = marker.shape[0]
        return self.function(*args)


def _remembered(value: Any) -> bool:
    """Whether ``AheadOfTimeFunction`` keeps what ``value`` flattens to: a list or a frozen
    dataclass instance that can be weakly referenced (see there)."""
    if not hasattr(value, "__weakref__"):
        return False
    if isinstance(value, list):
        return True
    params = getattr(type(value), "__dataclass_params__", None)
    return params is not None and params.frozen


def _is_size(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class CompileFailed(RuntimeError):
    """The step could not be exported, compiled or loaded here (a C++ compiler that fails, an
    operation AOTInductor cannot take); the first line says why, the rest where the details are."""


def size_ranges(program: torch.export.ExportedProgram, marked: list[tuple[int, int]],
                example: list[torch.Tensor]) -> str:
    """The sizes ``program`` takes for each ``marked`` (input, dim) — a dimension the caller
    marked dynamic — as "input.dim:low:high" joined by spaces (a package's metadata holds
    strings); input is the position among the flat inputs. A marked dimension that export kept
    fixed takes that one size, as does one whose range export does not state (a size it derives
    from others: ``example``, the inputs it was exported with, gives the size); none takes sizes
    0 or 1, which export would take for constants."""
    nodes = {node.name: node for node in program.graph.nodes if node.op == "placeholder"}
    names = program.graph_signature.user_inputs
    ranges = []
    for index, dim in marked:
        size = nodes[names[index]].meta["val"].shape[dim]
        bounds = None if isinstance(size, int) else program.range_constraints.get(size.node.expr)
        if bounds is None:
            low = high = example[index].shape[dim]
        else:
            low, high = int(bounds.lower), int(min(bounds.upper, sys.maxsize))
        ranges.append(f"{index}.{dim}:{max(low, 2)}:{high}")
    return " ".join(ranges)


def _compile(folder: Path, path: Path, export: Callable[[], tuple[torch.export.ExportedProgram, dict[str, str]]]) -> None:
    """Export and compile into ``path``, through a temporary file renamed at the end, so that a
    process stopped mid-way (Ctrl-C included) or a second one compiling too leaves no half file.
    A failure's whole story goes to ``failure.log`` beside it; the error says the first line."""
    folder.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(dir=folder, prefix=f".{path.stem}.", suffix=".partial.pt2")
    os.close(handle)
    try:
        with warnings.catch_warnings():  # PyTorch's packaging trips a deprecation of its own (LeafSpec)
            warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
            program, metadata = export()
            torch._inductor.aoti_compile_and_package(
                program, package_path=partial, inductor_configs={"aot_inductor.metadata": metadata})
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


def _package(folder: Path, key: str,
             export: Callable[[], tuple[torch.export.ExportedProgram, dict[str, str]]]) -> tuple[Any, bool]:
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


@dataclasses.dataclass
class _Package:
    """A loaded package, the output structure to rebuild, and the dynamic sizes it takes, as
    (input, dim, low, high)."""

    runner: Any
    out_spec: Any
    ranges: list[tuple[int, int, int, int]]

    def __post_init__(self) -> None:
        self.rebuild = _rebuilder(self.out_spec)

    def takes(self, inputs: list[torch.Tensor]) -> bool:
        """Whether every marked size of ``inputs`` lies in the range the package was exported for."""
        return all(low <= inputs[i].shape[dim] <= high for i, dim, low, high in self.ranges)

    def __call__(self, inputs: list[torch.Tensor]) -> Any:
        outputs = self.runner.boxed_run(inputs)
        if len(outputs) != self.out_spec.num_leaves:
            raise CompileFailed(f"the package returned {len(outputs)} outputs where its function returns "
                                f"{self.out_spec.num_leaves}: it was built for another version of the step. Fix: delete "
                                f"the compiler's folder ({aot_folder()} by default) to compile it again")
        return self.rebuild(iter(outputs))


def _rebuilder(spec: pytree.TreeSpec) -> Callable[[Iterator[Any]], Any]:
    """A function that builds ``spec``'s value from an iterator over its leaves. pytree's
    ``tree_unflatten`` walks the spec at every call (5 µs for a step's outputs, seven calls a
    step); this walks it once. Tuples and lists are built here, anything else by pytree."""
    if spec.is_leaf():
        return next
    if spec.type in (tuple, list):
        kind, parts = spec.type, [_rebuilder(child) for child in spec.children()]
        return lambda leaves: kind([part(leaves) for part in parts])
    return lambda leaves: pytree.tree_unflatten([next(leaves) for _ in range(spec.num_leaves)], spec)


class AheadOfTime:
    """A compiler for step functions, used where ``torch.compile`` is: ``AheadOfTime()(fn)``.

    Packages go to ``folder`` (default ``aot_folder()``). ``on_compile`` is called once, before
    the first package has to be compiled (not loaded), to tell the user about the wait: about a
    minute on a laptop. ``compiled`` counts the packages compiled, ``seconds`` the time spent
    compiling or loading them.
    """

    def __init__(self, folder: Path | None = None, on_compile: Callable[[], None] | None = None):
        self.folder = folder or aot_folder()
        self.on_compile = on_compile
        self.compiled, self.seconds = 0, 0.0
        self.packages: dict[str, _Package] = {}

    def __call__(self, function: Callable) -> AheadOfTimeFunction:
        return AheadOfTimeFunction(self, function)

    @torch.no_grad()
    def package(self, function: Callable, args: tuple[Any, ...], inputs: list[torch.Tensor]) -> _Package:
        """The package for ``function`` on arguments like ``args`` (flattened: ``inputs``),
        loaded, or compiled first where this machine has none."""
        key = package_key(function, args)
        if key in self.packages:
            return self.packages[key]
        start, path = time.perf_counter(), self.folder / f"{key}.pt2"
        module = _Flat(function, args)
        tensors = len(inputs) - len(module.ints)
        marked = [(i, d) for i, t in enumerate(inputs[:tensors]) for d in dynamic_dims(t)]
        marked += [(i, 0) for i in range(tensors, len(inputs))]  # the ints' markers
        dims: list[Any] = [None] * len(inputs)
        for i, d in marked:
            dims[i] = {**(dims[i] or {}), d: torch.export.Dim.AUTO}

        def export() -> tuple[torch.export.ExportedProgram, dict[str, str]]:
            marks = [(t, set(t._dynamo_dynamic_indices)) for t in inputs if dynamic_dims(t)]
            try:
                program = torch.export.export(module, tuple(inputs), dynamic_shapes=(tuple(dims),))
            finally:  # export clears the marks of its example inputs, which are the caller's tensors
                for tensor, indices in marks:
                    tensor._dynamo_dynamic_indices = indices
            return program, {"aie_ranges": size_ranges(program, marked, inputs),
                             "aie_outputs": pytree.treespec_dumps(program.call_spec.out_spec)}

        if self.on_compile and not self.compiled and not path.exists():
            self.on_compile()
        runner, fresh = _package(self.folder, key, export)
        self.compiled += fresh
        metadata = runner.get_metadata()
        ranges = [tuple(int(n) for n in entry.replace(".", ":").split(":")) for entry in metadata["aie_ranges"].split()]
        self.packages[key] = _Package(runner, pytree.treespec_loads(metadata["aie_outputs"]), ranges)
        self.seconds += time.perf_counter() - start
        return self.packages[key]


class AheadOfTimeFunction:
    """``function`` compiled ahead of time: call it with ``function``'s arguments.

    Flattening a step's arguments (five layers' weights and caches: some 40 tensors) costs tens
    of microseconds, paid at every call of every step; so what an argument flattens to is
    remembered, for as long as it lives and forgotten with it (never keeping a finished
    request's cache alive), where it can be weakly referenced and is a list (stage 09's
    ``Call``: a step's layers, built once per request or runner) or a frozen dataclass (the
    engine's ``DecodeRows``, one per step, handed to each of the step's calls of its layers).
    Other arguments are flattened at every call. What is remembered assumes that such a value's
    contents stay as they were at its first call: the same tensors, shapes and dynamic marks
    (frozen only stops a field from being replaced; a list's items are the caller's to keep).
    """

    def __init__(self, compiler: AheadOfTime, function: Callable):
        self.compiler, self.function = compiler, function
        self.memo: dict[int, tuple[weakref.ref, list[torch.Tensor], str]] = {}
        self.by_structure: dict[tuple[Any, ...], _Package] = {}

    def _flat(self, value: Any) -> tuple[list[torch.Tensor], str]:
        """The tensors and structure of one argument, remembered where the class says so."""
        if not _remembered(value):
            return leaves(value), structure(value)
        entry = self.memo.get(id(value))
        if entry is None or entry[0]() is not value:
            key = id(value)
            entry = (weakref.ref(value, lambda _, memo=self.memo, key=key: memo.pop(key, None)),
                     leaves(value), structure(value))
            self.memo[key] = entry
        return entry[1], entry[2]

    def __call__(self, *args: Any) -> Any:
        inputs: list[torch.Tensor] = []
        parts: list[Any] = []
        for value in args:
            if _is_size(value):
                parts.append("int")
            elif isinstance(value, torch.Tensor) and not getattr(value, "_dynamo_dynamic_indices", None):
                inputs.append(value)  # a tuple key costs a tenth of structure()'s string, at every call
                parts.append((value.dtype, value.shape, value.device))
            else:
                tensors, text = self._flat(value)
                inputs += tensors
                parts.append(text)
        sizes = [value for value in args if _is_size(value)]
        inputs += [torch.empty(n, 0, device=inputs[0].device if inputs else None) for n in sizes]
        key = tuple(parts)
        package = self.by_structure.get(key)
        if package is None:
            small = any(t.shape[d] < 2 for t in inputs[:len(inputs) - len(sizes)] for d in dynamic_dims(t))
            if small or any(n < 2 for n in sizes):  # export would take the size for a constant: wait
                return self.function(*args)
            package = self.by_structure[key] = self.compiler.package(self.function, args, inputs)
        if not package.takes(inputs):
            return self.function(*args)
        return package(inputs)
