"""The skeleton loop: stop rules, context limits, streaming, timings."""

from __future__ import annotations

import pytest
import torch

from aie_lessons.generate import ContextLengthError, PromptError, check_fits_context, collect, generate
from aie_lessons.output import StopStrings
from aie_lessons.sampling import SamplingParams, greedy_step
from aie_lessons.model import LlamaModel
from aie_lessons.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return LlamaModel.from_pretrained(tiny_dir), Tokenizer.from_pretrained(tiny_dir)


def test_greedy_step_takes_the_last_position():
    logits = torch.zeros(2, 3, 5)
    logits[:, -1, 4] = 1.0
    logits[:, 0, 1] = 9.0
    assert greedy_step(logits).tolist() == [4, 4]


def test_stop_string_split_across_pushes_is_cut_and_held_back():
    stops = StopStrings(("END",))
    assert stops.push("abc E") == ("abc ", False)  # "E" could start "END": held back
    assert stops.push("N") == ("", False)
    assert stops.push("D and more") == ("", True)


def test_stop_strings_release_held_text_when_it_is_not_a_stop():
    stops = StopStrings(("END",))
    assert stops.push("E") == ("", False)
    assert stops.push("X") == ("EX", False)
    assert stops.flush() == ""


def test_earliest_of_several_stop_strings_wins():
    stops = StopStrings(("world", "lo"))
    assert stops.push("hello world") == ("hel", True)


def test_context_error_gives_the_numbers():
    with pytest.raises(ContextLengthError, match=r"60 tokens \+ max_new_tokens 10 = 70 tokens.*context is 64 tokens.*by 6 tokens"):
        check_fits_context(60, 10, 64)


def test_generate_refuses_a_prompt_longer_than_the_context(tiny):
    model, tokenizer = tiny
    with pytest.raises(ContextLengthError, match="context is 64 tokens"):
        generate(model, tokenizer, [5] * 70, SamplingParams(max_new_tokens=1))


def test_generate_refuses_an_empty_prompt(tiny):
    model, tokenizer = tiny
    with pytest.raises(PromptError, match="empty"):
        generate(model, tokenizer, [], SamplingParams(max_new_tokens=1))


def test_generate_refuses_token_ids_outside_the_vocabulary(tiny):
    model, tokenizer = tiny
    vocab = model.config.vocab_size
    with pytest.raises(PromptError, match=rf"\[{vocab}, -1\] are outside the vocabulary \(0 to {vocab - 1}\)"):
        generate(model, tokenizer, [3, vocab, -1], SamplingParams(max_new_tokens=1))


def test_the_model_refuses_a_cache_without_explicit_progress(tiny):
    """Positions and the cache column are the caller's to say: nothing is derived from the cache."""
    from aie_lessons.kv_cache import KVCache
    from aie_lessons.model import AttentionMetadata

    model, _ = tiny
    cache = KVCache(model.config, 1, 8)
    ids = torch.tensor([[3, 4]])
    with pytest.raises(ValueError, match="with a cache, pass positions"):
        model(ids, attn=AttentionMetadata(cache=cache, cache_start=0))
    with pytest.raises(ValueError, match="a cache needs cache_start"):
        model(ids, torch.arange(2)[None], AttentionMetadata(cache=cache))


def test_collect_stops_each_stream_at_its_own_end(tiny):
    """One row finishes early (a stop id); collect keeps feeding the other and stops when both end."""
    from aie_lessons.output import OutputStream

    _, tokenizer = tiny
    params = SamplingParams(max_new_tokens=3)
    streams = [OutputStream(tokenizer, [1], params, stop_ids={0}) for _ in range(2)]
    steps = iter([[5, 6], [0, 7], [9, 8], [10, 11]])
    results = collect(steps, streams)
    assert [r.token_ids for r in results] == [[5], [6, 7, 8]]
    assert [r.finish_reason for r in results] == ["eos", "length"]
    assert next(steps) == [10, 11], "collect must stop asking for steps once every stream finished"


def test_generate_matches_a_hand_written_greedy_loop(tiny):
    model, tokenizer = tiny
    prompt = tokenizer.encode("The quick brown fox")
    result = generate(model, tokenizer, prompt, SamplingParams(max_new_tokens=12))
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(len(result.token_ids)):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))  # positions default to 0…S-1
    assert result.token_ids == ids[len(prompt):]
    assert result.text == tokenizer.decode(result.token_ids)
    assert len(result.step_seconds) >= len(result.token_ids)


def test_streamed_text_equals_final_text(tiny):
    model, tokenizer = tiny
    pieces: list[str] = []
    result = generate(model, tokenizer, tokenizer.encode("中文"), SamplingParams(max_new_tokens=20),
                      on_text=pieces.append)
    assert "".join(pieces) == result.text
    assert all(p for p in pieces)


def test_eos_stops_generation_without_emitting_it(tiny_untied_dir):
    model = LlamaModel.from_pretrained(tiny_untied_dir)
    tokenizer = Tokenizer.from_pretrained(tiny_untied_dir)
    eos = torch.tensor([tokenizer.eos_token_id])  # make EOS the best token everywhere
    model.lm_head.register_forward_hook(lambda module, inputs, logits: logits.index_fill(-1, eos, 1e4))
    result = generate(model, tokenizer, tokenizer.encode("hi"), SamplingParams(max_new_tokens=5))
    assert result.finish_reason == "eos" and result.token_ids == []


def test_stop_string_ends_generation_and_is_not_shown(tiny):
    model, tokenizer = tiny
    full = generate(model, tokenizer, tokenizer.encode("The"), SamplingParams(max_new_tokens=16))
    stop = full.text[3:6]
    assert len(stop) == 3
    cut = generate(model, tokenizer, tokenizer.encode("The"),
                   SamplingParams(max_new_tokens=16, stop=(stop,)))
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]


def test_timings_summarise_the_steps(tiny):
    model, tokenizer = tiny
    result = generate(model, tokenizer, tokenizer.encode("a"), SamplingParams(max_new_tokens=4))
    timings = result.timings
    assert set(timings) == {"first_token_s", "total_s", "tokens", "decode_tokens_per_s"}
    assert timings["total_s"] == pytest.approx(sum(result.step_seconds))


def test_collect_names_the_running_sequences_when_steps_run_out(tiny):
    from aie_lessons.output import OutputStream

    _, tokenizer = tiny
    streams = [OutputStream(tokenizer, [1], SamplingParams(max_new_tokens=5), stop_ids=set()) for _ in range(2)]
    with pytest.raises(RuntimeError, match=r"ended while sequences \[0, 1\] were still running"):
        collect(iter([[3, 4]]), streams)


def test_collect_closes_the_step_iterator_when_done(tiny):
    """Closing runs the iterator's cleanup at once (a loop's KV cache is freed then, not later)."""
    from aie_lessons.output import OutputStream

    _, tokenizer = tiny
    closed = []

    def steps():
        try:
            while True:
                yield [3]
        finally:
            closed.append(True)

    collect(steps(), [OutputStream(tokenizer, [1], SamplingParams(max_new_tokens=2), stop_ids=set())])
    assert closed == [True]
