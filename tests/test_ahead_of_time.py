"""Stage 09's steps compiled ahead of time (the batch-1 decoder's and the engine's): the same
logits and tokens as the eager step, loaded by a later compiler instead of compiled again, and a
failure that says why and leaves nothing behind."""

from __future__ import annotations

import pytest
import torch

from aie_lessons.fast_decode import FastDecoder, KernelMatrix, QuantizedFastDecoder
from aie_lessons.infra.ahead_of_time import AheadOfTime, CompileFailed, aot_folder, leaves, rebuild, structure
from aie_lessons.model import LlamaModel
from aie_lessons.quantize import SCHEMES, quantize_model
from aie_lessons.sampling import SamplingParams
from low_precision import int8_input_tolerance

IDS = list(range(3, 17))  # a 5-token prompt, then 9 tokens fed one step at a time


def test_leaves_and_rebuild_take_nested_weights_apart_and_back():
    kernel = KernelMatrix(torch.ones(4, 2, dtype=torch.int8), torch.ones(4, dtype=torch.bfloat16), SCHEMES["int8"])
    value = [(torch.zeros(2, 3), torch.zeros(2, 3)), (kernel, (torch.ones(5), kernel))]
    flat = leaves(value)
    assert len(flat) == 7 and flat[2] is kernel.weights and flat[5] is flat[2]
    replaced = rebuild(value, iter([t + 1 for t in flat]))
    assert structure(replaced) == structure(value)
    assert isinstance(replaced[1][0], KernelMatrix) and replaced[1][0].scheme is SCHEMES["int8"]
    assert all(torch.equal(a, b + 1) for a, b in zip(leaves(replaced), flat))
    assert structure([torch.zeros(2, 3)]) != structure([torch.zeros(2, 3, dtype=torch.bfloat16)])


def test_structure_names_functions_and_leaves_dynamic_sizes_open():
    """Two calls that differ only in a size marked dynamic share a package; a function is named,
    never written as its address (which differs from one process to the next)."""
    a, b = torch.zeros(3, 8), torch.zeros(3, 9)
    assert structure(a) != structure(b)
    for tensor in (a, b):
        torch._dynamo.mark_dynamic(tensor, 1)
    assert structure(a) == structure(b) == "torch.float32(3,?)@cpu"
    assert structure((len, 1e-5)) == "(builtins.len,1e-05)"


def test_the_step_remembers_a_call_for_as_long_as_it_lives():
    """The flat inputs of a ``Call`` (a step's layers) are remembered, known by identity, and
    forgotten when the list goes: no finished request's cache is kept alive. A plain list is
    flattened at every call."""
    import gc

    from aie_lessons.fast_decode import Call

    step = AheadOfTime()(lambda x, layers: x)
    calls = [Call([torch.zeros(2)]) for _ in range(3)]
    for call in calls:
        assert step._flat(call)[0][0] is call[0]
    assert len(step.memo) == 3
    again = step._flat(calls[1])[0]
    assert again is step.memo[id(calls[1])][1], "a known list is not flattened again"
    del calls[:2], call
    gc.collect()
    assert list(step.memo) == [id(calls[0])]
    plain = [torch.zeros(2)]
    step._flat(plain)
    assert id(plain) not in step.memo


def test_frozen_rows_are_remembered_and_a_plain_tensor_is_keyed_by_a_tuple():
    """A frozen dataclass (the engine's ``DecodeRows``, one per step) is remembered like a
    ``Call`` and forgotten with it; one whose fields can be replaced is flattened at every call.
    Packages are looked up by a key per call: a plain tensor's shape is part of it, a size marked
    dynamic is not; the outputs come back in the function's structure, and a package that returns
    another number of outputs than its function is refused."""
    import dataclasses
    import gc
    from collections import namedtuple

    from torch.utils import _pytree as pytree

    from aie_lessons.engine.compiled_runner import DecodeRows
    from aie_lessons.infra.ahead_of_time import _Package, _rebuilder

    @dataclasses.dataclass
    class Replaceable:
        x: torch.Tensor

    step = AheadOfTime()(lambda x, rows: x)
    t = torch.zeros(2)
    rows = DecodeRows(t, t, t, t[None], t[None].bool())
    first = step._flat(rows)[0]
    assert step._flat(rows)[0] is first and list(step.memo) == [id(rows)]
    del rows
    gc.collect()
    assert not step.memo
    step._flat(Replaceable(t))
    assert not step.memo

    class Echo:  # a loaded package that returns its inputs
        def boxed_run(self, inputs):
            return list(inputs)

    packaged = []

    def package(function, args, inputs):
        packaged.append(tuple(inputs[0].shape))
        return _Package(Echo(), pytree.tree_structure((inputs[0], [inputs[1]])), [])

    step = AheadOfTime()(lambda x, rows: x)
    step.compiler.package = package
    x = torch.ones(3, 8)
    out = step(x, Replaceable(t))
    assert out[0] is x and out[1][0] is t
    step(torch.ones(3, 8), Replaceable(t))
    step(torch.ones(4, 8), Replaceable(t))
    for width in (8, 9):
        marked = torch.ones(3, width)
        torch._dynamo.mark_dynamic(marked, 1)
        step(marked, Replaceable(t))
    assert packaged == [(3, 8), (4, 8), (3, 8)]

    Pair = namedtuple("Pair", "a b")
    value = (torch.zeros(1), [torch.ones(1), (torch.zeros(2),)], {"k": torch.ones(3)}, None, Pair(t, t))
    flat, spec = pytree.tree_flatten(value)
    rebuilt = _rebuilder(spec)(iter(flat))
    assert pytree.tree_structure(rebuilt) == spec and all(a is b for a, b in zip(pytree.tree_leaves(rebuilt), flat))
    with pytest.raises(CompileFailed, match="returned 2 outputs where its function returns 3"):
        _Package(Echo(), pytree.tree_structure((t, t, t)), [])([t, t])


def test_bound_methods_are_refused_before_anything_is_compiled(tmp_path):
    """A bound method would compile its object's tensors in as constants, under a key that ignores them."""
    class Holder:
        weight = torch.ones(2)

        def scale(self, x):
            return x * self.weight

    with pytest.raises(TypeError, match="not bound methods.*Fix: pass what the method needs as arguments"):
        AheadOfTime(tmp_path)(Holder().scale)(torch.ones(2))


def test_a_package_that_does_not_load_is_compiled_again(tmp_path, monkeypatch):
    """A truncated or foreign file under a package's name is replaced, not a crash on every run."""
    from aie_lessons.infra import ahead_of_time

    (tmp_path / "k.pt2").write_bytes(b"not a package")
    loads, compiles = [], []

    def load(path):
        loads.append(path.read_bytes())
        if path.read_bytes() == b"not a package":
            raise RuntimeError("PytorchStreamReader failed reading zip archive")
        return "runner"

    monkeypatch.setattr(ahead_of_time, "_load", load)
    monkeypatch.setattr(ahead_of_time, "_compile", lambda folder, path, export: compiles.append(path.write_bytes(b"new")))
    assert ahead_of_time._package(tmp_path, "k", lambda: None) == ("runner", True)
    assert loads == [b"not a package", b"new"] and len(compiles) == 1


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_ahead_the_step_gives_the_eager_logits(tiny_untied_dir, dtype, tmp_path):
    """Logits at every step against the same decoder run eagerly, with fp32 and bf16 weights; the
    greedy head (a package of its own) gives the eager tokens; a second compiler, as a later
    process would, loads every package instead of compiling it. bf16's packages are compiled into
    an empty folder, so that every test run compiles; fp32's are the machine's (``aot_folder()``),
    which the command-line runs of this tiny model share: whichever comes first compiles them."""
    model = LlamaModel.from_pretrained(tiny_untied_dir, dtype=dtype)  # bf16 weights, fp32 activations
    eager = FastDecoder(model, compile=False)
    expected = eager.forced_logits(IDS[:5], IDS[5:])
    folder = tmp_path if dtype == torch.bfloat16 else aot_folder()
    compiler = AheadOfTime(folder)
    decoder = FastDecoder(model, compile=compiler)
    assert (decoder.forced_logits(IDS[:5], IDS[5:]) - expected).abs().max().item() <= 1e-4
    # A one-token prompt: its first step (position 1) is outside the sizes export kept, so it
    # runs eagerly, and the next ones compiled; the logits are the eager decoder's all the same.
    short = eager.forced_logits(IDS[:1], IDS[1:6])
    assert (decoder.forced_logits(IDS[:1], IDS[1:6]) - short).abs().max().item() <= 1e-4
    greedy = SamplingParams(max_new_tokens=6, ignore_eos=True)
    assert list(decoder.tokens(IDS[:5], greedy)) == list(eager.tokens(IDS[:5], greedy))
    assert len(compiler.packages) == 3  # the layers (both calls share one structure), the head twice
    if folder == tmp_path:
        assert compiler.compiled == 3 and len(list(tmp_path.glob("*.pt2"))) == 3
    later = AheadOfTime(folder)  # another prompt length: the position is a size, not part of the key
    assert list(FastDecoder(model, compile=later).tokens(IDS[:3], greedy)) == list(eager.tokens(IDS[:3], greedy))
    assert later.compiled == 0 and len(later.packages) == 2


@pytest.mark.slow
def test_quantized_weights_compile_ahead_through_the_kernels(tiny_dir, tmp_path):
    """int8 integers in the blocks and an int4-g32 head, with their scales, travel as inputs (the
    block's views among them); the schemes are compiled in. Into an empty folder: both integer
    kernels' operators inside a package are compiled in every test run."""
    model = quantize_model(LlamaModel.from_pretrained(tiny_dir), "int8", head="int4-g32")
    eager_decoder = QuantizedFastDecoder(model, compile=False)
    eager = eager_decoder.forced_logits(IDS[:5], IDS[5:])
    compiler = AheadOfTime(tmp_path)
    decoder = QuantizedFastDecoder(model, compile=compiler)
    # The course's integer kernels run as an operator of their own inside the package
    compiled = decoder.forced_logits(IDS[:5], IDS[5:])
    assert compiler.compiled == len(compiler.packages) > 0
    assert (compiled - eager).abs().max().item() <= int8_input_tolerance(eager_decoder, eager)


@pytest.mark.slow
def test_the_engines_step_compiled_ahead_keeps_the_eager_engines_tokens(tiny_untied_dir):
    """The engine's batched step over the paged pool, compiled ahead for each bucket: the greedy
    tokens of the eager engine, as requests finish and the batch moves between buckets. The
    packages are the machine's (``aot_folder()``): the bucket of one row is also the command
    line's step for one prompt on this model, compiled by whichever runs first."""
    from aie_lessons.engine.compiled_runner import compiled_engine
    from aie_lessons.engine.paged_engine import paged_engine
    from aie_lessons.kv_cache import kv_cache_bytes
    from aie_lessons.tokenizer import Tokenizer

    model = LlamaModel.from_pretrained(tiny_untied_dir)
    tokenizer = Tokenizer.from_pretrained(tiny_untied_dir)
    settings = dict(max_seqs=4, token_budget=16, kv_bytes=kv_cache_bytes(model.config, 64, 4, torch.float32),
                    block_size=4)
    prompts = ["hello world", "the quick brown fox jumps over", "a", "over the lazy dog"]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (14, 6, 9, 11)]
    expected = paged_engine(model, tokenizer, decode="gather", **settings).generate(prompts, params)
    compiler = AheadOfTime()
    engine = compiled_engine(model, tokenizer, compile=compiler, **settings)
    engine.runner.warm_up()
    assert engine.runner.buckets == (1, 2, 4) and len(engine.runner.calls) == 1
    assert len(compiler.packages) == 6  # per bucket, the layers' call and the head
    assert [r.token_ids for r in engine.generate(prompts, params)] == [r.token_ids for r in expected]


def test_a_compile_that_fails_says_why_and_leaves_no_file(tiny_dir, tmp_path, monkeypatch):
    """A compile stopped half-way (here after writing part of the package): the error names the
    cause, and no file is left to be loaded next time. tests/test_cli.py runs a real compiler
    that fails (the compiler is chosen once per process, so it needs a process of its own)."""
    def half_written(program, package_path, **options):
        open(package_path, "wb").write(b"PK")
        raise RuntimeError("the C++ compiler exited with status 1")

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", half_written)
    told = []
    decoder = FastDecoder(LlamaModel.from_pretrained(tiny_dir), compile=AheadOfTime(tmp_path, lambda: told.append(1)))
    with pytest.raises(CompileFailed, match=r"^RuntimeError: the C\+\+ compiler exited with status 1 \(the whole "
                                            r"error: .*failure\.log\)$"):
        decoder.warm_up()
    assert told == [1] and [p.name for p in tmp_path.iterdir()] == ["failure.log"]
    assert "half_written" in (tmp_path / "failure.log").read_text()  # the traceback, for whoever digs


@pytest.mark.oracle
def test_real_model_compiled_ahead_gives_the_eager_steps_logits(real_model_dir):
    """On the course model, in the cache folder the CLI uses: every step's logits of a chat
    answer against the same step run eagerly, within fp32's summation-order noise."""
    from aie_lessons.tokenizer import Tokenizer

    model = LlamaModel.from_pretrained(real_model_dir)
    prompt = Tokenizer.from_pretrained(real_model_dir).encode_chat("What is the capital of France?")
    eager = FastDecoder(model, compile=False)
    answer = list(eager.tokens(prompt, SamplingParams(max_new_tokens=16)))
    expected = eager.forced_logits(prompt, answer)
    decoder = FastDecoder(model, compile=AheadOfTime())
    error = (decoder.forced_logits(prompt, answer) - expected).abs().max().item()
    assert error <= 1e-4 * expected.abs().max().item(), error
