"""Incremental detokenization and stop strings on the real tokenizer: the pieces join to the
whole decode, no piece holds half a character, and stop strings cut the text exactly before
themselves, at any token boundary, with the tokens that arrive later ignored."""

from __future__ import annotations

import random

import pytest

from graphrelay.capture.serving.detokenize import TextStream

SAMPLE = "Héllo, naïve wörld: 世界 🎉 says <b>hi</b> — then stops. STOP here? No, END."


def pieces(codec, tokens, stop=(), step=1):
    stream = TextStream(codec, stop)
    out = [stream.push(tokens[i : i + step]) for i in range(0, len(tokens), step)]
    out.append(stream.finish())
    return stream, out


@pytest.mark.parametrize("step", [1, 3])
def test_pieces_join_to_the_whole_decode_and_never_split_a_character(codec, step):
    tokens = codec.encode(SAMPLE)
    assert any(len(codec.decode([t])) and "\ufffd" in codec.decode([t]) for t in tokens), "no multi-token character"
    _, out = pieces(codec, tokens, step=step)
    assert "".join(out) == SAMPLE
    assert not any("\ufffd" in p for p in out)


def test_random_tokens_join_to_the_whole_decode(codec):
    rng = random.Random(0)
    vocab = len(codec.tokenizer)
    for _ in range(30):
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 25))]
        _, out = pieces(codec, tokens, step=rng.randint(1, 4))
        assert "".join(out) == codec.decode(tokens), tokens


@pytest.mark.parametrize("stop", ["STOP", "wörld", "🎉", "o", ". S", "</b>"])
@pytest.mark.parametrize("step", [1, 2])
def test_stop_string_cuts_the_text_exactly_before_it(codec, stop, step):
    tokens = codec.encode(SAMPLE)
    stream, out = pieces(codec, tokens + codec.encode(" more text after"), stop=(stop, "never-there"), step=step)
    want = SAMPLE[: SAMPLE.index(stop)]
    assert "".join(out) == want
    assert stream.stopped
    # The tokens end with the one that completed the stop string: fewer would not show it.
    kept = stream.tokens
    assert stop in codec.decode(kept) and stop not in codec.decode(kept[:-1])
    assert kept == tokens[: len(kept)]


def test_the_earliest_of_several_stop_strings_wins(codec):
    stream, out = pieces(codec, codec.encode(SAMPLE), stop=("END", "says", "STOP"))
    assert "".join(out) == SAMPLE[: SAMPLE.index("says")]


def test_a_partial_stop_string_is_held_back_then_released(codec):
    text = "alpha beta gamma"
    stream = TextStream(codec, ("gamma ray",))
    shown = [stream.push([t]) for t in codec.encode(text)]
    assert "".join(shown) == "alpha beta ", "the possible start of the stop string was shown"
    assert stream.finish() == "gamma" and not stream.stopped


def test_tokens_after_the_stop_are_ignored(codec):
    stream = TextStream(codec, ("beta",))
    assert stream.push(codec.encode("alpha beta")) == "alpha "
    assert stream.push(codec.encode(" gamma")) == "" and stream.finish() == ""
    assert codec.decode(stream.tokens) == "alpha beta"


def test_empty_stop_string_is_refused(codec):
    with pytest.raises(ValueError, match="non-empty"):
        TextStream(codec, ("",))
