"""Logprobs over HTTP: which tokens each piece of text carries, and OpenAI's two shapes.

The engine hands over one `TokenLogprobs` per token with the tokens; the text those tokens make
reaches the client later and in other cuts (`TextStream` holds back half a UTF-8 character and
text that may begin a stop string). A piece carries the logprobs of the tokens whose text it
completes: a token that made no text yet (the first bytes of a character) goes with the token
that completes the character. Every token is delivered once, in order; after a stop-string cut
the tokens whose text starts at or after the cut are dropped (they are not part of the
answer), while usage still counts every token up to the one that completed the stop string.

Token strings follow vLLM: the token's text on its own (a byte-level token holding part of a
character shows U+FFFD), and `bytes` its UTF-8 encoding.
"""

from __future__ import annotations

from typing import NamedTuple

from graphrelay.capture.iteration.controls.logprobs import TokenLogprobs
from graphrelay.capture.serving.detokenize import TextStream


class TokenEntry(NamedTuple):
    token: int
    logprobs: TokenLogprobs  # its top list is already cut to the request's n
    offset: int  # where its text starts in the completion text


class LogprobCursor:
    """One request's logprobs, handed out with the text pieces of its `TextStream`."""

    def __init__(self, text: TextStream):
        self._text = text
        self._logprobs: list[TokenLogprobs] = []  # as they arrived, beside the pushed tokens
        self._sent = 0  # tokens delivered so far
        self._shown = 0  # characters of text returned so far

    def add(self, logprobs: list[TokenLogprobs]) -> None:
        """The logprobs of the tokens about to be pushed to the text stream."""
        self._logprobs.extend(logprobs)

    def take(self, piece: str, last: bool) -> list[TokenEntry]:
        """The tokens `piece` (the text stream's next result) carries; `last`: the request ends."""
        self._shown += len(piece)
        ends, tokens = self._text.ends, self._text.tokens
        if self._text.stopped:  # the text ends at the cut: keep the tokens that start before it
            upto = self._sent
            while upto < len(tokens) and self._start(upto) < self._shown:
                upto += 1
        elif last:
            upto = len(tokens)
        else:  # up to the last token that made text already returned
            upto, i = self._sent, self._sent
            while i < len(tokens) and ends[i] <= self._shown:
                i += 1
                if ends[i - 1] > self._start(i - 1):
                    upto = i
        entries = [TokenEntry(tokens[i], self._logprobs[i], self._start(i)) for i in range(self._sent, upto)]
        self._sent = len(tokens) if self._text.stopped or last else upto
        return entries

    def _start(self, i: int) -> int:
        return self._text.ends[i - 1] if i else 0


class TokenStrings:
    """Each token id's string as the logprobs show it (cached: the same alternatives recur)."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        text = self._cache.get(token)
        if text is None:
            piece = self._tokenizer.convert_ids_to_tokens(token)
            text = self._cache[token] = self._tokenizer.convert_tokens_to_string([piece])
        return text


def chat_logprobs(entries: list[TokenEntry], strings: TokenStrings) -> dict:
    """`choices[i].logprobs` of a chat completion (or of one streamed chunk)."""

    def one(token: int, logprob: float) -> dict:
        text = strings(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**one(e.token, e.logprobs.logprob), "top_logprobs": [one(t, lp) for t, lp in e.logprobs.top]}
                        for e in entries], "refusal": None}


def completion_logprobs(entries: list[TokenEntry], strings: TokenStrings) -> dict:
    """`choices[i].logprobs` of a completion: per token its string, logprob, its top n as
    {string: logprob} (with the sampled token, as OpenAI's legacy API returns up to n + 1)
    and where its text starts."""
    tops = []
    for e in entries:
        top = {strings(t): lp for t, lp in e.logprobs.top}
        top.setdefault(strings(e.token), e.logprobs.logprob)
        tops.append(top)
    return {"tokens": [strings(e.token) for e in entries], "token_logprobs": [e.logprobs.logprob for e in entries],
            "top_logprobs": tops, "text_offset": [e.offset for e in entries]}
