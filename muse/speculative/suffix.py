"""Suffix decoding (`method: "suffix"`): drafts from what followed the latest tokens before,
in the request itself or in the outputs of earlier requests (arXiv:2411.04975).

Agentic loops repeat themselves: the same tool call with other arguments, the same file
re-emitted with one edit, the same answer format. A request's next tokens are then often
the ones that followed its latest tokens somewhere already seen. Two indexes answer where:

- one per running request, over its prompt and output, extended as tokens are committed;
- one shared by all, over the outputs of the last `max_cached_requests` finished requests
  (the oldest output is taken out when a new one comes in).

The index: a suffix trie of bounded depth with counts
------------------------------------------------------
Chosen over a suffix tree or automaton because its counts are exact and cheap to keep while
tokens arrive and outputs leave. With D = `max_tree_depth`, every substring of up to D + 1
tokens of the indexed sequences is a path from the root (matches are up to D tokens, and the
token after a match is counted too). A node counts the occurrences of its string, `out` those
followed by one more token (the sum of its children's counts), and keeps its most frequent
child (`best`), so a draft step is a few array reads. Nodes also keep a suffix link (the node
of their string less its first token).

What keeps it small and cheap in Python:

- A string that occurs once is not stored as a chain of nodes: its parent holds a *stub*, the
  (sequence, position) of that one occurrence, and the chain is read from the sequence itself.
  A stub becomes a node on the string's second occurrence. Text that never repeats costs a few
  stubs per token; only repeated substrings get nodes (at most D + 1 per repeated token).
- Appending a token touches only the nodes of the sequence's suffixes that occurred before
  (the *active* nodes, at most D + 1, found from the previous token's active nodes): O(D) per
  token, whatever the context length. The longest active node is the longest earlier match of
  the request's own suffix, for free.
- Matching a request against the shared index walks its last D tokens with the suffix links
  (O(D) a step); taking an output out walks the output's own substrings down again, O(D) per
  token, and drops the nodes no longer counted.
- Nodes are ids into flat integer arrays, not objects: nothing for the garbage collector to
  walk however large the index grows.

Drafting
--------
Take the longest suffix of the sequence (at most D tokens) that occurs, followed by a token,
in the request's own index or the shared one; on a tie the request's own index wins (its loop
is the one being repeated), and when the chosen index drafts nothing the other one is tried.
From the match, follow the most frequent continuation token by token (a tie goes to the one
seen last), multiplying a running probability by (count of the chosen child) / (occurrences of
the node that continue); stop when it falls below `min_token_prob`, after
`max(1, max_spec_factor * match length)` tokens, or at the room. Past depth D + 1 the walk goes
on from the last D tokens (the suffix link), so drafts are not bounded by the depth; a stub's
single occurrence is followed as it stands, at probability factor 1. Drafts carry no q: they
are verified as one-hot.

Costs (CPython): indexing takes about 2 to 10 microseconds a token (more where text repeats:
up to D + 1 counts a token) and 50 to 250 bytes a token; a step costs some tens of
microseconds a request. A new request's prompt is indexed from `prompt_window` tokens before
its end, spread over steps by `index_budget` (see `SuffixProposer`).
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from muse.engine.request import Request

if TYPE_CHECKING:
    from muse.speculative.proposer import Drafts

DEFAULT_MAX_TREE_DEPTH = 24
DEFAULT_MAX_SPEC_FACTOR = 1.0
DEFAULT_MIN_TOKEN_PROB = 0.1
DEFAULT_MAX_CACHED_REQUESTS = 1000
# A request's own index covers this many prompt tokens before its end (None: all of them).
PROMPT_WINDOW: int | None = 32768
# Tokens of backlog one `propose` call indexes at most (a new request's prompt)...
INDEX_BUDGET = 8192
# ... beyond a backlog this small, always indexed (a step's accepted tokens).
_ALWAYS_INDEXED = 64

# A stub is one int: (sequence id << _SHIFT) | position of its occurrence's last token. In a
# child slot it is stored bitwise negated (negative), a node by its id (>= 0).
_SHIFT = 32
_MASK = (1 << _SHIFT) - 1

# Where a match ends: the deepest node on its path, the stub when the match runs on inside a
# string occurring once (then the node is not its end), and the match's length.
Locus = tuple[int, int | None, int]
ROOT: Locus = (0, None, 0)


class SuffixIndex:
    """Occurrence counts of every substring, up to `depth` = `max_match + 1` tokens, of
    some sequences: matches are suffixes of up to `max_match` tokens, and what follows them is
    counted too.

    A sequence is either added whole (`add`) or opened and extended token by token (`open`,
    `extend`); `remove` takes a whole sequence out again.

    Nodes are ids into flat arrays, not objects: millions of them then cost 48 bytes each and
    nothing for the garbage collector to walk. Node i's string occurs `count[i]` times,
    `out[i]` of them followed by a token (within the depth); `best[i]` is its most frequent
    next token (-1: none), counting `best_count[i]`, and `child[i]` that child (a node id, or a
    negated stub); `link[i]` is the node of the string less its first token. The children of
    a node with two or more are in `kids[i]` (token -> child slot), single children only in
    `best`/`child`. Node 0 is the root, the empty string.
    """

    def __init__(self, max_match: int) -> None:
        if max_match < 1:
            raise ValueError(f"max_match must be at least 1, got {max_match}")
        self.max_match = max_match
        self.depth = max_match + 1
        self.count = array("q", [0])
        self.out = array("q", [0])
        self.best = array("q", [-1])
        self.best_count = array("q", [0])
        self.child = array("q", [0])
        self.link = array("q", [-1])
        self.kids: dict[int, dict[int, int]] = {}
        self._free: list[int] = []  # ids of removed nodes, for reuse
        # Nodes whose best child lost counts since it was chosen: `best` is then a child
        # and `best_count` its count, but another child may count more. Found again when a
        # draft reads the node (a rescan on every loss would cost the fan-out each time).
        self._stale: set[int] = set()
        self.sequences: dict[int, array] = {}
        # Per open sequence, the nodes of its suffixes that occurred before (index = length).
        self._active: dict[int, list[int]] = {}
        self._next_id = 0
        self.version = 0  # changes with every change of the index

    @property
    def num_nodes(self) -> int:
        return len(self.count) - len(self._free)

    def open(self) -> int:
        """A new, empty sequence to `extend`; its id."""
        seq_id = self._next_id
        if seq_id > _MASK:
            raise OverflowError("too many sequences in one suffix index")
        self._next_id += 1
        self.sequences[seq_id] = array("q")
        self._active[seq_id] = [0]
        return seq_id

    def add(self, tokens: Iterable[int]) -> int:
        """Index a whole sequence; its id."""
        seq_id = self.open()
        self.extend(seq_id, tokens)
        del self._active[seq_id]
        return seq_id

    def extend(self, seq_id: int, tokens: Iterable[int]) -> None:
        """Append tokens to an open sequence: per token, one count more for each suffix (up to
        `depth - 1` tokens) that occurred before, extended by it."""
        self.version += 1
        seq, active = self.sequences[seq_id], self._active[seq_id]
        sequences, depth, kids = self.sequences, self.depth, self.kids
        counts, outs, bests, best_counts, children = (
            self.count, self.out, self.best, self.best_count, self.child)
        base = seq_id << _SHIFT
        for token in tokens:
            position = len(seq)
            if position > _MASK:
                raise OverflowError("sequence too long for a suffix index")
            seq.append(token)
            grown = [0]  # the active nodes after this token, by length
            for node in active[:depth]:
                if bests[node] == token:
                    child = children[node]
                else:
                    others = kids.get(node)
                    child = None if others is None else others.get(token)
                if child is None:  # first occurrence: a stub
                    child, count = ~(base | position), 1
                    self._put(node, token, child)
                elif child < 0:  # second occurrence of a string seen once: a node
                    stub = ~child
                    other, end = sequences[stub >> _SHIFT], stub & _MASK
                    # grown[-1]: this string less its head (all shorter ones repeated).
                    new = self._new_node(2, grown[-1])
                    if len(grown) < depth and end + 1 < len(other):
                        bests[new], best_counts[new], children[new] = other[end + 1], 1, child - 1
                        outs[new] = 1
                    self._put(node, token, new)
                    child, count = new, 2
                else:
                    count = counts[child] + 1
                    counts[child] = count
                outs[node] += 1
                if count >= best_counts[node]:  # a tie goes to the latest continuation
                    bests[node], best_counts[node], children[node] = token, count, child
                # Counts fall with length, so the repeated suffixes are the first ones.
                if count > 1:
                    grown.append(child)
            active = grown
        self._active[seq_id] = active

    def remove(self, seq_id: int) -> None:
        """Take a sequence out: one count less on the path of each of its substrings."""
        self.version += 1
        seq, depth = self.sequences.pop(seq_id), self.depth
        self._active.pop(seq_id, None)
        counts = self.count
        for start in range(len(seq)):
            node = 0
            for position in range(start, min(start + depth, len(seq))):
                token = seq[position]
                child = self._get(node, token)
                if child is None:
                    raise RuntimeError("suffix index out of step with its sequences")
                if child < 0:  # a string occurring once: this occurrence
                    self._drop(node, token, 0)
                    break
                counts[child] -= 1
                self._drop(node, token, counts[child])
                if counts[child] == 0:  # its whole subtree was this occurrence
                    self._free_subtree(child)
                    break
                node = child

    def count_of(self, tokens: Sequence[int]) -> int:
        """Occurrences of `tokens` (1 to `depth` of them) in the indexed sequences."""
        if not 0 < len(tokens) <= self.depth:
            raise ValueError(f"count_of takes 1 to {self.depth} tokens, got {len(tokens)}")
        node, stub, length = self._walk(tokens)
        if length < len(tokens):
            return 0
        return 1 if stub is not None else self.count[node]

    # --- Matching and drafting -----------------------------------------------------------

    def own_match(self, seq_id: int) -> Locus:
        """The longest suffix of an open sequence that occurred earlier in it, followed by a
        token (length 0: none)."""
        active = self._active[seq_id]
        length = min(len(active) - 1, self.max_match)
        return self.settle((active[length], None, length))

    def match(self, tokens: Sequence[int]) -> Locus:
        """The longest suffix of `tokens` (at most `max_match` of them) that occurs in the
        index followed by a token (length 0: none). O(max_match) amortised."""
        return self.settle(self.feed(ROOT, tokens[-self.max_match:]))

    def feed(self, locus: Locus, tokens: Iterable[int]) -> Locus:
        """Where the longest suffix present (at most `max_match` tokens, or longer inside a
        string seen once) ends after `tokens` follow the text whose one `locus` is: one walk
        step per token, plus suffix-link steps paid for by earlier ones. `settle` the result
        to draft from it."""
        sequences, links, bests, children, kids = (
            self.sequences, self.link, self.best, self.child, self.kids)
        node, stub, length = locus
        max_match = self.max_match
        for token in tokens:
            while True:
                if stub is None:
                    if bests[node] == token:
                        child = children[node]
                    else:
                        others = kids.get(node)
                        child = None if others is None else others.get(token)
                    if child is not None:
                        length += 1
                        if child < 0:
                            stub = ~child
                        elif length > max_match:  # one past: drop the head
                            node, length = links[child], length - 1
                        else:
                            node = child
                        break
                    if length == 0:
                        break
                    node, length = links[node], length - 1
                else:
                    seq, end = sequences[stub >> _SHIFT], stub & _MASK
                    if end + 1 < len(seq) and seq[end + 1] == token:
                        stub, length = stub + 1, length + 1
                        break
                    node, stub, length = self._less_head(seq, end, length)
        return node, stub, length

    def settle(self, locus: Locus) -> Locus:
        """Shorten a match until what it matched is followed by a token somewhere; its
        length counted up to `max_match`."""
        node, stub, length = locus
        while length:
            if stub is not None:
                seq, end = self.sequences[stub >> _SHIFT], stub & _MASK
                if end + 1 < len(seq):
                    break
                node, stub, length = self._less_head(seq, end, length)
            elif self.out[node]:
                break
            else:
                node, length = self.link[node], length - 1
        return node, stub, min(length, self.max_match)

    def _less_head(self, seq: array, end: int, length: int) -> Locus:
        """The locus of a string seen once (`length` tokens of `seq` up to `end`) less its
        first token, found again from the root (at most `max_match` tokens of it)."""
        return self._walk(seq[end + 1 - min(length - 1, self.max_match):end + 1])

    def draft(self, locus: Locus, limit: int, min_prob: float) -> list[int]:
        """Up to `limit` tokens following `locus`, the most frequent continuation each time,
        while the running probability stays at or above `min_prob`."""
        node, stub, length = locus
        sequences, cap = self.sequences, self.depth
        outs, bests, best_counts, children, links = (
            self.out, self.best, self.best_count, self.child, self.link)
        stale = self._stale
        tokens: list[int] = []
        prob = 1.0
        while len(tokens) < limit:
            if stub is not None:  # inside a string seen once: read on in its sequence
                seq, end = sequences[stub >> _SHIFT], (stub & _MASK) + 1
                if end >= len(seq):
                    break
                tokens.append(seq[end])
                stub += 1
                continue
            out = outs[node]
            if not out:
                if length < cap:
                    break
                node, length = links[node], length - 1  # at the depth cap: drop the head
                out = outs[node]
                if not out:
                    break
            if stale and node in stale:
                self._rescan(node)
            prob *= best_counts[node] / out
            if prob < min_prob:
                break
            tokens.append(bests[node])
            length += 1
            child = children[node]
            if child < 0:
                stub = ~child
            else:
                node = child
        return tokens

    # --- Nodes ---------------------------------------------------------------------------

    def _get(self, node: int, token: int) -> int | None:
        if self.best[node] == token:
            return self.child[node]
        others = self.kids.get(node)
        return None if others is None else others.get(token)

    def _put(self, node: int, token: int, child: int) -> None:
        """Set (add or replace) the child of `token`; its count is reported separately."""
        best = self.best[node]
        others = self.kids.get(node)
        if best == -1 or best == token:
            self.best[node], self.child[node] = token, child
            if others is not None:
                others[token] = child
            return
        if others is None:
            others = self.kids[node] = {best: self.child[node]}
        others[token] = child

    def _drop(self, node: int, token: int, count: int) -> None:
        """The child of `token` lost an occurrence and now counts `count` (0: it goes)."""
        self.out[node] -= 1
        others = self.kids.get(node)
        if count == 0:
            if others is None:
                self.best[node], self.best_count[node], self.child[node] = -1, 0, 0
                return
            del others[token]
            if len(others) == 1:
                (self.best[node], self.child[node]), = others.items()
                self.best_count[node] = self._child_count(self.child[node])
                del self.kids[node]
                self._stale.discard(node)
                return
            if token == self.best[node]:
                self._rescan(node)  # the best went: another is needed now
            return
        if token == self.best[node]:
            self.best_count[node] = count
            if others is not None:
                self._stale.add(node)

    def _rescan(self, node: int) -> None:
        """Find a stale node's most frequent child again."""
        self._stale.discard(node)
        best, child = max(self.kids[node].items(),
                          key=lambda item: self._child_count(item[1]))
        self.best[node], self.child[node] = best, child
        self.best_count[node] = self._child_count(child)

    def _child_count(self, child: int) -> int:
        return 1 if child < 0 else self.count[child]

    def _new_node(self, count: int, link: int) -> int:
        if self._free:
            node = self._free.pop()
            self.count[node], self.out[node], self.best[node] = count, 0, -1
            self.best_count[node], self.child[node], self.link[node] = 0, 0, link
            return node
        node = len(self.count)
        self.count.append(count)
        self.out.append(0)
        self.best.append(-1)
        self.best_count.append(0)
        self.child.append(0)
        self.link.append(link)
        return node

    def _free_subtree(self, node: int) -> None:
        stack = [node]
        while stack:
            node = stack.pop()
            others = self.kids.pop(node, None)
            if others is not None:
                stack.extend(c for c in others.values() if c >= 0)
            elif self.best[node] != -1 and self.child[node] >= 0:
                stack.append(self.child[node])
            self.best[node] = -1
            self._stale.discard(node)
            self._free.append(node)

    def _walk(self, tokens: Sequence[int]) -> Locus:
        """The locus of the longest prefix of `tokens` in the index."""
        node, stub, length = 0, None, 0
        sequences = self.sequences
        for token in tokens:
            if stub is None:
                child = self._get(node, token)
                if child is None:
                    break
                if child < 0:
                    stub = ~child
                else:
                    node = child
            else:  # a string seen once goes on only as its one occurrence does
                seq, end = sequences[stub >> _SHIFT], (stub & _MASK) + 1
                if end >= len(seq) or seq[end] != token:
                    break
                stub += 1
            length += 1
        return node, stub, length


@dataclass
class _Running:
    request: Request
    index: SuffixIndex | None = None  # built from the request's first proposal on
    seq_id: int = 0
    start: int = 0  # the request's position of the index's first token
    # Its match in the shared index, carried on while that index does not change: the
    # index's version, the number of tokens it covers, the raw (unsettled) locus.
    shared_version: int = -1
    shared_known: int = 0
    shared_locus: Locus = ROOT


class SuffixProposer:
    """Suffix decoding over every running request. Knobs left as None come from `config`'s
    `suffix_decoding_*` fields when it has them, else the defaults above.

    Indexing costs a few microseconds a token (more where the text repeats), so a request's
    own index starts `prompt_window` tokens before the end of its prompt (None: at its
    start), and one `propose` call indexes at most `index_budget` tokens of backlog (a new
    request's prompt): a request not caught up yet drafts from the shared index only. A
    backlog of a few tokens, the steady state, is always indexed."""

    def __init__(self, config: Any = None, *, max_tree_depth: int | None = None,
                 max_spec_factor: float | None = None, min_token_prob: float | None = None,
                 max_cached_requests: int | None = None,
                 prompt_window: int | None = PROMPT_WINDOW,
                 index_budget: int = INDEX_BUDGET) -> None:
        def knob(value: Any, name: str, default: Any) -> Any:
            if value is not None:
                return value
            value = getattr(config, f"suffix_decoding_{name}", None)
            return default if value is None else value

        self.config = config
        self.max_tree_depth = int(knob(max_tree_depth, "max_tree_depth",
                                       DEFAULT_MAX_TREE_DEPTH))
        self.max_spec_factor = float(knob(max_spec_factor, "max_spec_factor",
                                          DEFAULT_MAX_SPEC_FACTOR))
        self.min_token_prob = float(knob(min_token_prob, "min_token_prob",
                                         DEFAULT_MIN_TOKEN_PROB))
        self.max_cached_requests = int(knob(max_cached_requests, "max_cached_requests",
                                            DEFAULT_MAX_CACHED_REQUESTS))
        self.prompt_window = prompt_window
        self.index_budget = index_budget
        if self.max_tree_depth < 1:
            raise ValueError(f"max_tree_depth must be at least 1, got {self.max_tree_depth}")
        if not self.max_spec_factor > 0:
            raise ValueError(f"max_spec_factor must be positive, got {self.max_spec_factor}")
        if not 0 <= self.min_token_prob <= 1:
            raise ValueError(f"min_token_prob must be in [0, 1], got {self.min_token_prob}")
        if self.max_cached_requests < 0:
            raise ValueError("max_cached_requests must be at least 0, got "
                             f"{self.max_cached_requests}")
        if prompt_window is not None and prompt_window < 0:
            raise ValueError(f"prompt_window must be at least 0, got {prompt_window}")
        if index_budget < 0:
            raise ValueError(f"index_budget must be at least 0, got {index_budget}")
        self.global_index = SuffixIndex(self.max_tree_depth)
        self.cached: OrderedDict[str, int] = OrderedDict()  # request id -> its sequence id
        self.running: dict[str, _Running] = {}

    def propose(self, requests: list[Request], rooms: list[int]) -> list[Drafts]:
        """Per request, up to `room` one-hot drafts."""
        # Imported here: the proposer module imports this one.
        from muse.speculative.proposer import Drafts
        budget = self.index_budget
        proposals = []
        for request, room in zip(requests, rooms):
            state = self._track(request)
            tokens: list[int] = []
            if room > 0:
                caught_up, used = self._sync(state, budget)
                budget -= used
                tokens = self._propose(state, room, caught_up)
            proposals.append(Drafts(tokens))
        return proposals

    def observe(self, committed: list[Request]) -> None:
        """Requests whose tokens a step committed are noted here, so that one finishing before
        its first proposal still leaves its output to the shared index."""
        for request in committed:
            self._track(request)

    def retain(self, request_ids: set[str]) -> None:
        """Forget requests no longer running; a finished one's output goes to the shared
        index first (a preempted one's index is rebuilt if it runs again)."""
        for request_id in [i for i in self.running if i not in request_ids]:
            request = self.running.pop(request_id).request
            if request.is_finished:
                self.cache_output(request_id, request.output_token_ids)

    def cache_output(self, request_id: str, tokens: Sequence[int]) -> None:
        """Index a finished request's output, taking the oldest one out past
        `max_cached_requests`."""
        if self.max_cached_requests == 0 or not tokens or request_id in self.cached:
            return
        self.cached[request_id] = self.global_index.add(tokens)
        while len(self.cached) > self.max_cached_requests:
            _, seq_id = self.cached.popitem(last=False)
            self.global_index.remove(seq_id)

    def _track(self, request: Request) -> _Running:
        state = self.running.get(request.request_id)
        if state is None or state.request is not request:
            state = self.running[request.request_id] = _Running(request)
        return state

    def _propose(self, state: _Running, room: int, caught_up: bool) -> list[int]:
        request = state.request
        known = request.num_prompt_tokens + len(request.output_token_ids)
        own_index, shared_index = state.index, self.global_index
        own = own_index.own_match(state.seq_id) if caught_up else ROOT
        shared = ROOT
        if shared_index.sequences:
            new = known - state.shared_known
            if state.shared_version == shared_index.version and 0 <= new < self.max_tree_depth:
                raw = shared_index.feed(state.shared_locus, request.token_ids(
                    state.shared_known, known))
            else:
                raw = shared_index.feed(ROOT, request.token_ids(
                    max(0, known - self.max_tree_depth), known))
            state.shared_version, state.shared_known, state.shared_locus = (
                shared_index.version, known, raw)
            shared = shared_index.settle(raw)
        # The longer match first, the request's own on a tie; the other if it drafts nothing.
        order = [(own_index, own), (shared_index, shared)]
        if shared[2] > own[2]:
            order.reverse()
        for index, locus in order:
            if locus[2] == 0:
                continue
            limit = min(room, max(1, int(self.max_spec_factor * locus[2])))
            tokens = index.draft(locus, limit, self.min_token_prob)
            if tokens:
                return tokens
        return []

    def _sync(self, state: _Running, budget: int) -> tuple[bool, int]:
        """Index the request's known tokens not indexed yet, within `budget` unless only a few
        are missing; whether it is caught up, and how many tokens it indexed."""
        request = state.request
        num_prompt = request.num_prompt_tokens
        known = num_prompt + len(request.output_token_ids)
        index = state.index
        if index is not None:
            seq = index.sequences[state.seq_id]
            have = state.start + len(seq)
            if have > known or (seq and request.token_ids(have - 1, have)[0] != seq[-1]):
                index = None  # the output was cut back: start over
                state.shared_version = -1
        if index is None:
            index = state.index = SuffixIndex(self.max_tree_depth)
            state.seq_id = index.open()
            window = self.prompt_window
            state.start = 0 if window is None else max(0, num_prompt - window)
        have = state.start + len(index.sequences[state.seq_id])
        missing = known - have
        count = missing if missing <= _ALWAYS_INDEXED else min(missing, max(budget, 0))
        if count:
            index.extend(state.seq_id, request.token_ids(have, have + count))
        return count == missing, count
