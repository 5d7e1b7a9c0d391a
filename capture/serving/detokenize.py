"""A completion's text as its tokens arrive: incremental detokenization and stop strings.

The engine never sees text. On the host, each request's tokens are turned into text piece by
piece by the tokenizer library's streaming decoder (`tokenizers.decoders.DecodeStream`), which
holds back the bytes of a character split across tokens, so no piece ever ends in half a
character. Stop strings are matched on that text: the visible text ends exactly before the
first stop string, which is not included, and the tokens end with the one that completed it.
Text that could still become the start of a stop string is held back until it cannot.

Stop strings act with the overlap loop's lag: the loop has already launched the next
iteration(s) of a request when its stop string is seen, so the owner aborts the request and
discards the tokens that still arrive (`TextStream` ignores them), as the loop itself does for
stop tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from graphrelay.capture.serving.inbox import CollectingSink, Inbox
from graphrelay.capture.serving.workloads import Request

if TYPE_CHECKING:
    from graphrelay.capture.model.text import TextCodec
    from graphrelay.capture.serving.loop import RequestOutput


class TextStream:
    """One request's completion: feed tokens with `push`, end with `finish`.

    `tokens` are the completion's tokens (cut at a stop string); the concatenation of every
    `push` and `finish` result is its text. `ends[i]` is where token i's text ends in the
    decoded text (the returned text is a prefix of it), so a caller can tell which tokens a
    returned piece covers (the HTTP server's streamed logprobs).
    """

    def __init__(self, codec: "TextCodec", stop: Sequence[str] = ()):
        from tokenizers.decoders import DecodeStream  # a model dependency, like the codec

        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._codec = codec
        self._tokenizer = codec.tokenizer.backend_tokenizer  # the Rust tokenizer the decoder steps with
        self._decoder = DecodeStream(skip_special_tokens=True)
        self._stop = tuple(stop)
        self.tokens: list[int] = []
        self.ends: list[int] = []
        self._decoded = 0  # characters the decoder has produced
        self.stopped = False  # a stop string was found: the text and tokens are final
        self._shown: list[str] = []  # the pieces returned so far
        self._held = ""  # decoded text not returned yet: it may begin a stop string

    def push(self, tokens: Sequence[int]) -> str:
        """Take the next tokens; return the text they make visible (maybe ""). After a stop
        string everything is ignored."""
        if self.stopped:
            return ""
        step, tokenizer, stop = self._decoder.step, self._tokenizer, self._stop
        for token in tokens:
            self.tokens.append(token)
            piece = step(tokenizer, token)
            if piece:
                self._decoded += len(piece)
                self._held += piece
                if stop and self._cut_at_stop():
                    self.ends.append(self._decoded)
                    break
            self.ends.append(self._decoded)
        if not stop:  # nothing to hold back: the per-token path of every stream without stop strings
            text, self._held = self._held, ""
            self._shown.append(text)
            return text
        return self._release(self._held if self.stopped else self._held[: len(self._held) - self._may_start_stop()])

    def finish(self) -> str:
        """The request ended (stop token or length): the rest of the text. The streaming
        decoder may still hold the bytes of the last tokens; the whole decode has them."""
        if self.stopped:
            return ""
        whole, shown = self._codec.decode(self.tokens), "".join(self._shown)
        # `whole` starts with the text already returned (else the streamed view stands, and
        # what the streaming decoder still holds is lost: no tokenizer tested here does that).
        if whole.startswith(shown):
            self._held = whole[len(shown) :]
        self._cut_at_stop()
        return self._release(self._held)

    def _cut_at_stop(self) -> bool:
        """Cut the held text before its first stop string, if any."""
        hits = [i for i in (self._held.find(s) for s in self._stop) if i >= 0]
        if not hits:
            return False
        self._held = self._held[: min(hits)]
        self.stopped = True
        return True

    def _may_start_stop(self) -> int:
        """Length of the longest end of the held text that a stop string begins with."""
        longest = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(self._held)), longest, -1):
                if self._held.endswith(s[:n]):
                    longest = n
                    break
        return longest

    def _release(self, text: str) -> str:
        self._held = "" if self.stopped else self._held[len(text) :]
        self._shown.append(text)
        return text


class TextSink(CollectingSink):
    """A batch run's sink for text requests: each output gets its `text`, and a request with
    stop strings is cut at the first one (finish reason "stop") and aborted through `inbox`,
    its later tokens discarded."""

    def __init__(self, codec: "TextCodec", inbox: Inbox, requests: Sequence[Request]):
        super().__init__()
        self._inbox = inbox
        self._streams = {r.id: TextStream(codec, r.stop) for r in requests}
        self._text: dict[str, list[str]] = {r.id: [] for r in requests}

    def on_tokens(self, request_id: str, tokens: list[int], logprobs=None) -> None:
        stream = self._streams[request_id]
        if stream.stopped:
            return
        self._text[request_id].append(stream.push(tokens))
        if stream.stopped:
            self._inbox.abort(request_id)

    def on_finish(self, output: "RequestOutput") -> None:
        stream = self._streams.pop(output.id)
        text = self._text.pop(output.id)
        text.append(stream.finish())
        if stream.stopped:
            output.tokens, output.finish_reason = list(stream.tokens), "stop"
        output.text = "".join(text)
        super().on_finish(output)

