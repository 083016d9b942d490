"""Suffix decoding: the index counts every substring exactly (through additions, token-by-token
extension and removal), matches the longest suffix, and the proposer drafts what followed it
in the request or in earlier requests' outputs, within min_token_prob, max_spec_factor and the
room."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from muse.engine.request import Request, RequestStatus
from muse.engine.sampling_params import SamplingParams
from muse.speculative.suffix import SuffixIndex, SuffixProposer


def _request(request_id: str, prompt: Sequence[int], output: Sequence[int] = ()) -> Request:
    request = Request(request_id, list(prompt), SamplingParams(max_tokens=1000))
    request.output_token_ids = list(output)
    request.status = RequestStatus.RUNNING
    return request


def _finish(proposer: SuffixProposer, *requests: Request) -> None:
    """As the engine does: the last step commits the requests' tokens (observe), then they
    are no longer running (retain)."""
    proposer.observe(list(requests))
    for request in requests:
        request.status = RequestStatus.FINISHED
    proposer.retain({i for i in proposer.running if i not in {r.request_id for r in requests}})


def _draft(proposer: SuffixProposer, request: Request, room: int = 8) -> list[int]:
    drafts = proposer.propose([request], [room])
    assert len(drafts) == 1 and drafts[0].probs is None
    return list(drafts[0].tokens)


def _occurrences(sequences: list[list[int]], pattern: list[int]) -> int:
    n = len(pattern)
    return sum(seq[i:i + n] == pattern for seq in sequences for i in range(len(seq) - n + 1))


def _unique(start: int, n: int) -> list[int]:
    """Tokens seen nowhere else in a test."""
    return list(range(start, start + n))


# --- The proposer ------------------------------------------------------------------------------

def test_repeated_pattern_in_one_request_is_drafted() -> None:
    pattern = [7, 8, 9, 10, 11, 12, 13, 14]
    prompt = _unique(100, 5) + pattern + _unique(200, 5)
    request = _request("a", prompt, [300] + pattern[:4])
    proposer = SuffixProposer(max_spec_factor=1.0)
    # Matched: [7, 8, 9, 10] (300 before it never occurred): up to 4 drafts.
    assert _draft(proposer, request) == pattern[4:8]
    # Incremental: the accepted tokens extend the same index.
    request.output_token_ids += pattern[4:6]
    index = proposer.running["a"].index
    assert _draft(proposer, request, room=1) == [pattern[6]]
    assert proposer.running["a"].index is index


def test_no_match_no_draft() -> None:
    proposer = SuffixProposer()
    assert _draft(proposer, _request("a", _unique(0, 30))) == []


def test_pattern_of_an_earlier_request_is_drafted_for_a_new_one() -> None:
    tool_call = [50, 51, 52, 53, 54, 55, 56, 57, 58, 59]
    proposer = SuffixProposer()
    first = _request("first", _unique(100, 20), _unique(400, 3) + tool_call + [2])
    assert _draft(proposer, first) == []  # nothing repeats yet
    _finish(proposer, first)
    assert "first" not in proposer.running and "first" in proposer.cached
    second = _request("second", _unique(600, 40), _unique(700, 4) + tool_call[:5])
    assert _draft(proposer, second) == tool_call[5:10]


def test_output_of_a_request_never_proposed_for_is_cached_through_observe() -> None:
    pattern = _unique(900, 6)
    proposer = SuffixProposer()
    done = _request("done", [1, 2, 3], pattern)
    proposer.observe([done])
    _finish(proposer, done)
    assert _draft(proposer, _request("next", [4, 5], pattern[:3])) == pattern[3:6]


def test_own_index_wins_a_tie_and_the_longer_match_wins_otherwise() -> None:
    proposer = SuffixProposer()
    old = _request("old", [0], [20, 21, 22, 30, 31, 32])
    _finish(proposer, old)
    # Own: [20, 21, 22] then 40; shared: [20, 21, 22] then 30. Same length: own wins.
    tie = _request("tie", _unique(100, 3) + [20, 21, 22, 40, 41, 42] + [101], [20, 21, 22])
    assert _draft(proposer, tie) == [40, 41, 42]
    # One token longer in the shared index: it wins.
    longer = _request("longer", _unique(200, 3) + [21, 22, 40, 41] + [201], [20, 21, 22])
    assert _draft(proposer, longer) == [30, 31, 32]


def test_min_token_prob_stops_where_no_continuation_dominates() -> None:
    # [1, 2] followed by 4 different tokens, once each: p = 1/4 for any of them.
    prompt = []
    for i in range(4):
        prompt += _unique(100 + 10 * i, 2) + [1, 2, 50 + i, 60 + i]
    request = _request("a", prompt + [300], [1, 2])
    assert _draft(SuffixProposer(min_token_prob=0.3), request) == []
    low = _draft(SuffixProposer(min_token_prob=0.2), request)
    assert len(low) == 2 and low[0] in range(50, 54) and low[1] == low[0] + 10
    # Three of four agree: p = 3/4, drafted; a later branch multiplies it down.
    prompt = []
    for i, (a, b) in enumerate([(50, 60), (50, 61), (50, 61), (51, 62)]):
        prompt += _unique(100 + 10 * i, 2) + [1, 2, a, b]
    request = _request("b", prompt + [300], [1, 2])
    # After 50: 61 twice, 60 once -> 3/4 * 2/3 = 1/2.
    assert _draft(SuffixProposer(min_token_prob=0.5), request) == [50, 61]
    assert _draft(SuffixProposer(min_token_prob=0.6), request) == [50]
    assert _draft(SuffixProposer(min_token_prob=0.8), request) == []


def test_max_spec_factor_bounds_the_draft_by_the_match_length() -> None:
    pattern = _unique(500, 30)
    request = _request("a", [0] + pattern + [1], pattern[:3])  # match: 3 tokens
    assert _draft(SuffixProposer(max_spec_factor=1.0), request, room=20) == pattern[3:6]
    assert _draft(SuffixProposer(max_spec_factor=2.0), request, room=20) == pattern[3:9]
    assert _draft(SuffixProposer(max_spec_factor=0.5), request, room=20) == pattern[3:4]
    assert _draft(SuffixProposer(max_spec_factor=0.01), request, room=20) == pattern[3:4]


def test_room_is_respected() -> None:
    pattern = _unique(500, 30)
    request = _request("a", [0] + pattern + [1], pattern[:10])
    proposer = SuffixProposer()
    assert _draft(proposer, request, room=4) == pattern[10:14]
    assert _draft(proposer, request, room=1) == pattern[10:11]
    assert _draft(proposer, request, room=0) == []
    drafts = proposer.propose([request, request], [2, 0])
    assert [list(d.tokens) for d in drafts] == [pattern[10:12], []]


def test_drafts_go_past_the_tree_depth() -> None:
    # A period-3 loop, longer than the depth: drafting follows suffix links at the cap.
    loop = [5, 6, 7] * 20
    request = _request("a", [0], loop)
    draft = _draft(SuffixProposer(max_tree_depth=4, max_spec_factor=4.0), request, room=12)
    assert draft == [5, 6, 7] * 4
    # Two occurrences of a 10-token run, then 2 or 3 (1/2 each), depth 4.
    run = _unique(40, 10)
    request = _request("b", [1] + run + [2] + run + [3], run[:4])
    proposer = SuffixProposer(max_tree_depth=4, max_spec_factor=2.0, min_token_prob=0.6)
    assert _draft(proposer, request) == run[4:10]


def test_old_outputs_are_evicted_beyond_max_cached_requests() -> None:
    proposer = SuffixProposer(max_cached_requests=2)
    patterns = [_unique(1000 * (i + 1), 8) for i in range(3)]
    for i, pattern in enumerate(patterns):
        _finish(proposer, _request(f"r{i}", [0], pattern))
    assert list(proposer.cached) == ["r1", "r2"]
    assert len(proposer.global_index.sequences) == 2
    assert proposer.global_index.count_of(patterns[0][:2]) == 0
    drafts = [_draft(proposer, _request(f"q{i}", [1], p[:4])) for i, p in enumerate(patterns)]
    assert drafts == [[], patterns[1][4:8], patterns[2][4:8]]
    # Nothing cached at all.
    none = SuffixProposer(max_cached_requests=0)
    _finish(none, _request("x", [0], patterns[0]))
    assert not none.cached and _draft(none, _request("y", [1], patterns[0][:4])) == []


def test_retain_drops_requests_and_caches_only_finished_outputs() -> None:
    proposer = SuffixProposer()
    running = _request("running", [1, 2, 3], [4])
    finished = _request("finished", [1, 2, 3], _unique(50, 6))
    preempted = _request("preempted", [1, 2, 3], _unique(80, 6))
    for request in (running, finished, preempted):
        _draft(proposer, request)
    finished.status = RequestStatus.FINISHED
    preempted.status = RequestStatus.WAITING
    proposer.retain({"running"})
    assert set(proposer.running) == {"running"}
    assert list(proposer.cached) == ["finished"]
    assert proposer.global_index.count_of(_unique(50, 6)) == 1
    assert proposer.global_index.count_of(_unique(80, 2)) == 0
    # A request finishing twice in view (observe after retain) is cached once.
    proposer.observe([finished])
    proposer.retain({"running"})
    assert len(proposer.global_index.sequences) == 1


def test_output_cut_back_rebuilds_the_own_index() -> None:
    proposer = SuffixProposer()
    request = _request("a", [9, 1, 2, 3, 4, 9], [1, 2, 3, 4, 5, 6])
    _draft(proposer, request)
    request.output_token_ids = [1, 2]  # e.g. a stop string cut the output
    assert _draft(proposer, request) == [3, 4, 9]  # matched [9, 1, 2]
    assert list(proposer.running["a"].index.sequences[0]) == [9, 1, 2, 3, 4, 9, 1, 2]


def test_config_knobs() -> None:
    class Config:
        suffix_decoding_max_tree_depth = 7
        suffix_decoding_max_spec_factor = 2.5
        suffix_decoding_min_token_prob = 0.25
        suffix_decoding_max_cached_requests = 3

    proposer = SuffixProposer(Config(), max_tree_depth=9)
    assert (proposer.max_tree_depth, proposer.max_spec_factor, proposer.min_token_prob,
            proposer.max_cached_requests) == (9, 2.5, 0.25, 3)
    default = SuffixProposer(object())
    assert default.max_tree_depth == 24 and default.min_token_prob == 0.1
    for bad in ({"max_tree_depth": 0}, {"max_spec_factor": 0.0}, {"min_token_prob": 1.5},
                {"max_cached_requests": -1}):
        with pytest.raises(ValueError):
            SuffixProposer(**bad)


# --- The index, against brute force ------------------------------------------------------------

def _children(index: SuffixIndex, node: int) -> dict[int, int]:
    if node in index.kids:
        return index.kids[node]
    return {index.best[node]: index.child[node]} if index.best[node] != -1 else {}


def _check_structure(index: SuffixIndex) -> None:
    """Every node's count, out, best and link agree with its children and brute force."""
    sequences = [list(seq) for seq in index.sequences.values()]
    stack: list[tuple[int, list[int]]] = [(0, [])]
    seen = 0
    while stack:
        node, string = stack.pop()
        seen += 1
        children = _children(index, node)
        counts = {t: 1 if c < 0 else index.count[c] for t, c in children.items()}
        assert index.out[node] == sum(counts.values())
        if counts:
            best = index.best[node]
            assert best in counts and index.best_count[node] == counts[best]
            # A stale node (its best lost counts) is rescanned when a draft reads it.
            assert node in index._stale or counts[best] == max(counts.values())
            assert children[best] == index.child[node]
            assert len(children) == 1 or node in index.kids
        if string:
            assert index.count[node] == _occurrences(sequences, string) >= 1
            link = 0
            for token in string[1:]:
                link = _children(index, link)[token]
            assert link == index.link[node]
        for token, child in children.items():
            assert len(string) < index.depth
            if child >= 0:
                stack.append((child, string + [token]))
            else:
                assert _occurrences(sequences, string + [token]) == 1
    assert seen == index.num_nodes  # removed nodes were all freed


def test_index_counts_match_brute_force_through_adds_extends_and_removes() -> None:
    rng = random.Random(0)
    for _ in range(150):
        depth, vocab = rng.randint(1, 6), rng.randint(2, 4)
        index, live = SuffixIndex(depth), {}
        for _ in range(rng.randint(1, 8)):
            if live and rng.random() < 0.35:
                seq_id = rng.choice(list(live))
                index.remove(seq_id)
                del live[seq_id]
            else:
                seq = [rng.randrange(vocab) for _ in range(rng.randint(0, 30))]
                if rng.random() < 0.5:
                    seq_id = index.add(seq)
                else:
                    seq_id, done = index.open(), 0
                    while done < len(seq):
                        step = rng.randint(1, 5)
                        index.extend(seq_id, seq[done:done + step])
                        done += step
                live[seq_id] = seq
            sequences = list(live.values())
            for _ in range(30):
                pattern = [rng.randrange(vocab) for _ in range(rng.randint(1, depth + 1))]
                assert index.count_of(pattern) == _occurrences(sequences, pattern)
            _check_structure(index)
        for seq_id in list(live):
            index.remove(seq_id)
        assert index.num_nodes == 1 and index.out[0] == 0 and index.best[0] == -1
        assert not index.kids


def _longest_with_continuation(sequences: list[list[int]], context: list[int],
                               max_match: int) -> int:
    for n in range(min(max_match, len(context)), 0, -1):
        suffix = context[-n:]
        if any(seq[i:i + n] == suffix for seq in sequences for i in range(len(seq) - n)):
            return n
    return 0


def _continues(sequences: list[list[int]], suffix: list[int], draft: list[int],
               depth: int) -> bool:
    """Each draft token, with the (at most depth - 1) tokens of suffix + draft before it,
    occurs in `sequences` (the index stores strings of up to depth tokens)."""
    return all(_occurrences(sequences, (suffix + draft[:j])[-depth:]) > 0
               for j in range(1, len(draft) + 1))


def test_drafts_always_continue_what_followed_the_match() -> None:
    """Random sequences over a small vocabulary: the match is the longest suffix followed by
    a token in the index, and each draft token, with the match and drafts before it (its
    last max_tree_depth + 1 tokens), occurs in an indexed sequence."""
    rng = random.Random(1)
    for trial in range(120):
        depth, vocab = rng.randint(1, 8), rng.randint(2, 5)
        proposer = SuffixProposer(max_tree_depth=depth, max_spec_factor=rng.choice([0.5, 1, 3]),
                                  min_token_prob=rng.choice([0.0, 0.1, 0.4]),
                                  max_cached_requests=rng.randint(0, 4))
        for r in range(rng.randint(1, 6)):
            request = _request(f"{trial}-{r}", [rng.randrange(vocab) for _ in range(
                rng.randint(1, 20))])
            for _ in range(rng.randint(0, 25)):
                room = rng.randint(0, 10)
                draft = _draft(proposer, request, room)
                assert len(draft) <= room
                context = request.prompt_token_ids + request.output_token_ids
                shared = [list(seq) for seq in proposer.global_index.sequences.values()]
                own_n = _longest_with_continuation([context], context, depth)
                shared_n = _longest_with_continuation(shared, context, depth)
                state = proposer.running[request.request_id]
                if room:
                    assert state.index.own_match(state.seq_id)[2] == own_n
                assert proposer.global_index.match(context)[2] == shared_n
                if room and proposer.global_index.sequences:  # carried on from step to step
                    assert proposer.global_index.settle(state.shared_locus)[2] == shared_n
                if draft:
                    # From the longer match (own on a tie), or the other when that one
                    # drafted nothing.
                    assert any(_continues(sequences, context[-n:], draft, depth + 1)
                               and len(draft) <= max(1, int(proposer.max_spec_factor * n))
                               for n, sequences in ((own_n, [context]), (shared_n, shared))
                               if n), (context, shared, draft)
                else:
                    assert own_n == shared_n == 0 or proposer.min_token_prob > 0 or room == 0
                # The model accepts part of the draft or says something else.
                accepted = draft[:rng.randint(0, len(draft))]
                request.output_token_ids += accepted + [rng.randrange(vocab)]
            if rng.random() < 0.8:
                _finish(proposer, request)
            else:
                proposer.retain(set())  # preempted: dropped, not cached
        _check_structure(proposer.global_index)


def test_first_draft_token_is_a_most_frequent_continuation() -> None:
    rng = random.Random(2)
    for _ in range(200):
        depth, vocab = rng.randint(2, 6), 3
        sequences = [[rng.randrange(vocab) for _ in range(rng.randint(5, 40))]
                     for _ in range(rng.randint(2, 5))]
        index = SuffixIndex(depth)
        ids = [index.add(seq) for seq in sequences]
        # Sequences added and taken out again leave stale bests behind.
        for _ in range(rng.randint(0, 3)):
            gone = index.add([rng.randrange(vocab) for _ in range(rng.randint(5, 40))])
            if len(ids) > 1 and rng.random() < 0.5:
                index.remove(ids.pop(rng.randrange(len(ids))))
                sequences = [list(index.sequences[i]) for i in ids]
            index.remove(gone)
        context = [rng.randrange(vocab) for _ in range(10)]
        locus = index.match(context)
        n = locus[2]
        draft = index.draft(locus, 1, 0.0)
        assert bool(draft) == (n > 0 or any(sequences))
        assert n == _longest_with_continuation(sequences, context, depth)
        if n:
            suffix = context[-n:]
            follow = {t: _occurrences(sequences, suffix + [t]) for t in range(vocab)}
            assert follow[draft[0]] == max(follow.values())


def test_prompt_window_bounds_the_own_index() -> None:
    pattern = _unique(500, 10)
    prompt = [1] + pattern + _unique(1000, 100) + [2]
    request = _request("a", prompt, pattern[:4])
    assert _draft(SuffixProposer(prompt_window=50), request) == []
    assert _draft(SuffixProposer(prompt_window=None), request) == pattern[4:8]
    assert _draft(SuffixProposer(prompt_window=len(prompt)), request) == pattern[4:8]


def test_index_budget_spreads_a_long_prompt_over_calls() -> None:
    pattern = _unique(500, 10)
    prompt = [1] + pattern + _unique(1000, 300) + [2]
    proposer = SuffixProposer(index_budget=100)
    steady = _request("steady", [3] + pattern + [4], pattern[:4])
    assert _draft(proposer, steady) == pattern[4:8]
    new = _request("new", prompt, pattern[:4])
    # 100 of 316 tokens indexed a call: nothing of its own to draft from until caught up,
    # while the steady request's few new tokens are always indexed.
    for _ in range(3):
        steady.output_token_ids.append(pattern[len(steady.output_token_ids)])
        drafts = proposer.propose([new, steady], [8, 8])
        assert list(drafts[0].tokens) == []
        rest = pattern[len(steady.output_token_ids):]
        assert list(drafts[1].tokens)[:len(rest)] == rest
    assert _draft(proposer, new) == pattern[4:8]


def test_shared_match_is_carried_across_steps_and_rebuilt_when_the_index_changes() -> None:
    run = _unique(100, 60)
    proposer = SuffixProposer(max_tree_depth=4, max_spec_factor=1.0)
    old = [1] + run + [2]
    _finish(proposer, _request("old", [0], old))
    request = _request("new", _unique(500, 5), [])
    for step in range(len(run) - 1):
        request.output_token_ids.append(run[step])
        draft = _draft(proposer, request, room=3)
        state = proposer.running["new"]
        length = proposer.global_index.settle(state.shared_locus)[2]
        assert length == min(step + 1, 4) == proposer.global_index.match(
            request.prompt_token_ids + request.output_token_ids)[2]
        assert draft == old[step + 2:step + 2 + min(3, length)]
        if step == 30:  # another output arrives: the match is found again from scratch
            _finish(proposer, _request("other", [0], [run[0], 3, 4]))
