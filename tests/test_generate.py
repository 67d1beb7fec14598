"""The skeleton loop: stop rules, context limits, streaming, timings."""

from __future__ import annotations

import pytest
import torch

from aie_lessons.generate import (
    ContextLengthError,
    SamplingParams,
    StopStrings,
    check_fits_context,
    generate,
    greedy_step,
)
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
    with pytest.raises(ValueError, match="empty"):
        generate(model, tokenizer, [], SamplingParams(max_new_tokens=1))


def test_generate_matches_a_hand_written_greedy_loop(tiny):
    model, tokenizer = tiny
    prompt = tokenizer.encode("The quick brown fox")
    result = generate(model, tokenizer, prompt, SamplingParams(max_new_tokens=12))
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(len(result.token_ids)):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
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
    with torch.no_grad():  # make EOS the best token everywhere
        model.lm_head.weight[tokenizer.eos_token_id] += 100.0
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
