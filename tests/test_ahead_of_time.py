"""Stage 09's decode step compiled ahead of time: the same logits as the eager step, loaded by a
later decoder instead of compiled again, and a failure that says why and leaves nothing behind."""

from __future__ import annotations

import pytest
import torch

from aie_lessons.fast_decode import FastDecoder, KernelMatrix, QuantizedFastDecoder
from aie_lessons.infra.ahead_of_time import CompileFailed, compile_ahead, leaves, rebuild, structure
from aie_lessons.model import LlamaModel
from aie_lessons.quantize import SCHEMES, quantize_model
from aie_lessons.sampling import SamplingParams

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


def test_a_decoder_compiled_by_torch_compile_is_refused(tiny_dir):
    with pytest.raises(ValueError, match="compile=False, and not given to compile_ahead before"):
        compile_ahead(FastDecoder(LlamaModel.from_pretrained(tiny_dir)), greedy=True)


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
def test_compiled_ahead_the_step_gives_the_eager_logits(tiny_untied_dir, dtype):
    """Logits at every step against the same decoder run eagerly, with fp32 and bf16 weights; a
    head compiled for logits refuses to be asked for tokens, naming the fix. The packages go to the folder the CLI's
    tests use (tests/test_cli.py follows one from compiling to loading in a fresh folder)."""
    model = LlamaModel.from_pretrained(tiny_untied_dir, dtype=dtype)  # bf16 weights, fp32 activations
    eager = FastDecoder(model, compile=False).forced_logits(IDS[:5], IDS[5:])
    decoder = FastDecoder(model, compile=False)
    compile_ahead(decoder, greedy=False)
    assert (decoder.forced_logits(IDS[:5], IDS[5:]) - eager).abs().max().item() <= 1e-4
    # A one-token prompt: its first step (position 1) is outside the sizes export kept, so it
    # runs eagerly, and the next ones compiled; the logits are the eager decoder's all the same.
    short = FastDecoder(model, compile=False).forced_logits(IDS[:1], IDS[1:6])
    assert (decoder.forced_logits(IDS[:1], IDS[1:6]) - short).abs().max().item() <= 1e-4
    with pytest.raises(ValueError, match=r"compile_ahead\(decoder, greedy=True\)"):
        list(decoder.tokens(IDS[:5], SamplingParams(max_new_tokens=3)))


@pytest.mark.slow
def test_quantized_weights_compile_ahead_through_the_kernels(tiny_dir):
    """int4-g32 integers and their scales travel as inputs; the scheme is compiled in."""
    model = quantize_model(LlamaModel.from_pretrained(tiny_dir), "int4-g32")
    eager = QuantizedFastDecoder(model, compile=False).forced_logits(IDS[:5], IDS[5:])
    decoder = QuantizedFastDecoder(model, compile=False)
    compile_ahead(decoder, greedy=False)
    assert (decoder.forced_logits(IDS[:5], IDS[5:]) - eager).abs().max().item() <= 1e-4


def test_a_compile_that_fails_says_why_and_leaves_no_file(tiny_dir, tmp_path, monkeypatch):
    """A compile stopped half-way (here after writing part of the package): the error names the
    cause, and no file is left to be loaded next time. tests/test_cli.py runs a real compiler
    that fails (the compiler is chosen once per process, so it needs a process of its own)."""
    def half_written(program, package_path, **options):
        open(package_path, "wb").write(b"PK")
        raise RuntimeError("the C++ compiler exited with status 1")

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", half_written)
    decoder = FastDecoder(LlamaModel.from_pretrained(tiny_dir), compile=False)
    told = []
    with pytest.raises(CompileFailed, match=r"^RuntimeError: the C\+\+ compiler exited with status 1 \(the whole "
                                            r"error: .*failure\.log\)$"):
        compile_ahead(decoder, greedy=True, folder=tmp_path, on_compile=lambda: told.append(True))
    assert told == [True] and [p.name for p in tmp_path.iterdir()] == ["failure.log"]
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
    decoder = FastDecoder(model, compile=False)
    compile_ahead(decoder, greedy=False)
    error = (decoder.forced_logits(prompt, answer) - expected).abs().max().item()
    assert error <= 1e-4 * expected.abs().max().item(), error
