"""Tokenizer wrapper and the streaming detokenizer (tiny in-process tokenizer and the real one)."""

from __future__ import annotations

import pytest

from aie_lessons.tokenizer import StreamingDetokenizer, Tokenizer, byte_level_alphabet

TEXTS = ["Hello, world!", "中文测试：你好，世界。", "emoji 🤗 👍🏽 ✨ café", "tabs\tand  spaces\n2024"]


def stream(tokenizer: Tokenizer, ids: list[int]) -> list[str]:
    detok = StreamingDetokenizer(tokenizer)
    return [detok.push(i) for i in ids] + [detok.flush()]


def test_byte_level_alphabet_covers_every_byte_once():
    alphabet = byte_level_alphabet()
    assert sorted(alphabet.values()) == list(range(256))
    assert alphabet["Ġ"] == ord(" ") and alphabet["A"] == ord("A")


@pytest.mark.parametrize("text", TEXTS)
def test_streaming_is_exact_and_never_emits_replacement_chars(tiny_dir, text):
    tokenizer = Tokenizer.from_pretrained(tiny_dir)
    pieces = stream(tokenizer, tokenizer.encode(text))
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_tiny_tokenizer_really_splits_characters(tiny_dir):
    """Otherwise the test above would pass for a detokenizer that decodes token by token."""
    tokenizer = Tokenizer.from_pretrained(tiny_dir)
    ids = tokenizer.encode("👍🏽")
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)


def test_flush_reports_an_unfinished_character_instead_of_dropping_it(tiny_dir):
    tokenizer = Tokenizer.from_pretrained(tiny_dir)
    ids = tokenizer.encode("🤗")
    partial = [i for i in ids if tokenizer.token_bytes(i) != "🤗".encode()][:1]
    assert partial, "the emoji should span several tokens in the tiny tokenizer"
    detok = StreamingDetokenizer(tokenizer)
    assert detok.push(partial[0]) == ""
    assert detok.flush() == "\ufffd"


def test_special_tokens_stream_as_their_text(tiny_dir):
    tokenizer = Tokenizer.from_pretrained(tiny_dir)
    im_start = tokenizer.token_id("<|im_start|>")
    assert "".join(stream(tokenizer, [im_start])) == "<|im_start|>"


@pytest.mark.oracle
@pytest.mark.parametrize("text", TEXTS)
def test_real_tokenizer_streams_exactly(real_model_dir, text):
    tokenizer = Tokenizer.from_pretrained(real_model_dir)
    ids = tokenizer.encode(text)
    assert "".join(stream(tokenizer, ids)) == tokenizer.decode(ids) == text


@pytest.mark.oracle
def test_real_tokenizer_splits_digits_one_by_one(real_model_dir):
    tokenizer = Tokenizer.from_pretrained(real_model_dir)
    assert [tokenizer.decode([i]) for i in tokenizer.encode("x 2024")] == ["x", " ", "2", "0", "2", "4"]


def test_out_of_range_token_is_a_clear_error(tiny_dir):
    tokenizer = Tokenizer.from_pretrained(tiny_dir)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tokenizer.token_bytes(10**6)


def test_missing_tokenizer_names_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="aie fetch-model"):
        Tokenizer.from_pretrained(tmp_path)
