"""Token ids -> text, a few tokens at a time, with stop strings.

Text is released only when it is final: never half a UTF-8 character (a byte-level token can
end inside one) and never the start of what may become a stop string.
"""

from __future__ import annotations

from dataclasses import dataclass

from muse.engine.sampling_params import SamplingParams

REPLACEMENT_CHAR = "\ufffd"


@dataclass
class DetokenizedDelta:
    text: str  # newly released text
    stop: str | None = None  # the stop string met, if any (generation must end)
    # With a stop string: how many of the new tokens it took to meet it (the rest, which a
    # speculative step may have produced in the same update, are not part of the output).
    num_tokens: int | None = None


class IncrementalDetokenizer:
    def __init__(self, tokenizer, params: SamplingParams,
                 hidden_token_ids: frozenset[int] | None = None) -> None:
        """`hidden_token_ids`: tokens left out of the text (instead of skipping all special
        tokens), so a chat reply can keep the tags its parsers read."""
        self.tokenizer = tokenizer
        self.params = params
        self.hidden_token_ids = hidden_token_ids
        self.skip_special_tokens = params.skip_special_tokens and hidden_token_ids is None
        self.token_ids: list[int] = []
        self.num_tokens_seen = 0
        # Decode windows: text of ids[prefix:read] is already part of `text`.
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""  # everything decoded so far
        self.released = 0  # how much of `text` was handed out
        self.hold_back = max((len(s) for s in params.stop), default=1) - 1
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def update(self, new_token_ids: list[int], finished: bool = False,
               drop_last: bool = False) -> DetokenizedDelta:
        """Feed new tokens; `drop_last` leaves a final stop token out of the text."""
        if self.stopped:
            return DetokenizedDelta("")
        if self.params.stop and len(new_token_ids) > 1:
            # Several tokens at once (speculative decoding): one at a time, so a stop string
            # ends the output at the token that completes it, as in plain decoding.
            pieces = []
            for index, token in enumerate(new_token_ids):
                last = index == len(new_token_ids) - 1
                delta = self.update([token], finished=finished and last,
                                    drop_last=drop_last and last)
                pieces.append(delta.text)
                if delta.stop is not None:
                    return DetokenizedDelta("".join(pieces), delta.stop, index + 1)
            return DetokenizedDelta("".join(pieces))
        self.num_tokens_seen += len(new_token_ids)
        ids = new_token_ids[:-1] if drop_last else new_token_ids
        for token in ids:
            if self.hidden_token_ids is not None and token in self.hidden_token_ids:
                continue
            self.token_ids.append(token)
            before = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
            after = self._decode(self.token_ids[self.prefix_offset:])
            if len(after) > len(before) and not after.endswith(REPLACEMENT_CHAR):
                self.text += after[len(before):]
                self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        if finished and self.read_offset < len(self.token_ids):
            # A generation that ends inside a character still reports its bytes.
            before = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
            self.text += self._decode(self.token_ids[self.prefix_offset:])[len(before):]
            self.read_offset = len(self.token_ids)
        stop = self._find_stop()
        if stop is not None:
            self.stopped = True
            return DetokenizedDelta(self._release(len(self.text)), stop, len(new_token_ids))
        end = len(self.text) if finished else max(self.released, len(self.text) - self.hold_back)
        return DetokenizedDelta(self._release(end))

    def _find_stop(self) -> str | None:
        if not self.params.stop or self.num_tokens_seen < self.params.min_tokens:
            return None
        # Only the unreleased tail (plus a stop string's length) can hold a new match.
        start = max(0, self.released - self.hold_back)
        first: tuple[int, str] | None = None
        for stop in self.params.stop:
            at = self.text.find(stop, start)
            if at != -1 and (first is None or at < first[0]):
                first = (at, stop)
        if first is None:
            return None
        at, stop = first
        self.text = self.text[:at + len(stop)] if self.params.include_stop_str_in_output \
            else self.text[:at]
        return stop

    def _release(self, end: int) -> str:
        end = max(end, self.released)
        piece = self.text[self.released:end]
        self.released = end
        return piece
