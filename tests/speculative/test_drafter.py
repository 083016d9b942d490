"""The block-diffusion drafter: config, checkpoint, masks, V2 modules, DSpark heads, loss."""

from __future__ import annotations

import json
import math

import pytest
import torch

from muse.checkpoint.layout import CheckpointError
from muse.config import FULL, SLIDING, ConfigError, RopeParameters, TextConfig
from muse.reference.model import MuseForCausalLM
from muse.speculative.drafter import (
    IGNORE_INDEX,
    BlockLayout,
    DynamicConv,
    MuseDrafter,
    load_drafter,
    save_drafter,
)
from muse.speculative.drafter_config import DrafterConfig, default_target_layer_ids
from muse.speculative.drafter_loss import block_target_logits, decay_weights, drafter_loss

VOCAB, MASK, LENGTH = 64, 63, 24
TARGET = TextConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=6, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=8, num_experts=0, intermediate_size=64,
                    moe_latent_size=None, sliding_window=8)
ALL_V2 = dict(dynamic_conv=True, conv_group_size=8, candidate_selector=True, selector_top_k=5,
              selector_rank=8, confidence_head=True, markov_rank=8)
DSPARK = dict(method="dspark", markov_rank=8, markov_gated=True, confidence_head=True)


def make_config(**overrides) -> DrafterConfig:
    values = dict(mask_token_id=MASK, num_target_features=2, num_hidden_layers=2,
                  dtype="float32")
    values.update(overrides)
    return DrafterConfig.for_target(TARGET, **values)


def make_drafter(target: MuseForCausalLM, seed: int = 1, **overrides) -> MuseDrafter:
    drafter = MuseDrafter(make_config(**overrides))
    drafter.init_weights(seed=seed, std=0.1)
    return drafter.bind_target(target.model.embed_tokens, target.lm_head)


def sequence(target: MuseForCausalLM, config: DrafterConfig, seed: int = 0):
    """Token ids [L], the target's fused-layer hidden states [L, K*d] and logits [L, V]."""
    ids = torch.randint(0, VOCAB - 1, (LENGTH,), generator=torch.Generator().manual_seed(seed))
    return (ids,) + target_features(target, config, ids)


def target_features(target, config, ids):
    with torch.no_grad():
        out = target(ids[None], hidden_layers=config.target_layer_ids)
    hidden = torch.cat([out.hidden_states[i][0] for i in config.target_layer_ids], dim=-1)
    return hidden, out.logits[0]


def propose_at(drafter, hidden, ids, anchors, temperature=0.0, generator=None):
    """One propose call for fresh requests whose anchors sit at `anchors` of the sequence."""
    caches = [drafter.new_cache() for _ in anchors]
    return drafter.propose(
        torch.cat([hidden[:a] for a in anchors]), torch.cat([torch.arange(a) for a in anchors]),
        list(anchors), ids[list(anchors)], torch.tensor(anchors), caches, temperature, generator)


def forced(drafter, hidden, ids, anchor, tokens):
    """The training forward of one block whose gold continuation is `tokens` (teacher forcing
    with the drafts themselves)."""
    forced_ids = ids.clone()
    forced_ids[anchor + 1:anchor + 1 + tokens.shape[0]] = tokens
    with torch.no_grad():
        return drafter(hidden, forced_ids, torch.tensor([anchor]))


def strengthen_sequential_terms(drafter) -> None:
    """Large Markov / pair weights, so a walk that ignored the previous draft would differ."""
    for name, param in drafter.named_parameters():
        if name.startswith(("candidate_selector", "markov_head", "previous_token_embedding")):
            torch.nn.init.normal_(param, std=1.0)


# -- configuration ------------------------------------------------------------------------------

def test_config_round_trips_through_config_json(tmp_path) -> None:
    yarn = RopeParameters(rope_type="yarn", factor=4.0, original_max_position_embeddings=64)
    config = make_config(**DSPARK, layer_types=[SLIDING, FULL], sliding_window=6, block_size=6,
                         rope_parameters={FULL: yarn})
    config.save(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    assert data["model_type"] == "muse_drafter" and data["architectures"] == ["MuseDrafter"]
    assert data["rope_parameters"][FULL]["rope_type"] == "yarn"
    assert DrafterConfig.load(tmp_path) == config
    assert DrafterConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


@pytest.mark.parametrize("field, value, fragment", [
    ("method", "eagle", "`method`"),
    ("mask_token_id", VOCAB, "`mask_token_id`"),
    ("block_size", 1, "`block_size`"),
    ("target_layer_ids", [1, 1], "`target_layer_ids`"),
    ("num_key_value_heads", 3, "`num_key_value_heads`"),
    ("layer_types", [SLIDING, FULL], "`sliding_window`"),
    ("layer_types", [FULL], "`layer_types`"),
    ("conv_group_size", 5, "`conv_group_size`"),
    ("selector_top_k", VOCAB + 1, "`selector_top_k`"),
    ("markov_rank", 0, "`markov_rank`"),
    ("dtype", "float33", "`dtype`"),
])
def test_invalid_fields_are_named(field, value, fragment) -> None:
    flags = dict(dynamic_conv=True, candidate_selector=True, method="dflash",
                 confidence_head=True)
    with pytest.raises(ConfigError, match=fragment):
        make_config(**{**flags, field: value})


def test_selector_and_markov_bias_are_exclusive_and_unknown_keys_named() -> None:
    with pytest.raises(ConfigError, match="`candidate_selector`"):
        make_config(method="dspark", candidate_selector=True)
    data = make_config().to_dict()
    with pytest.raises(ConfigError, match="blok_size"):
        DrafterConfig.from_dict({**data, "blok_size": 4})
    with pytest.raises(ConfigError, match="`model_type`"):
        DrafterConfig.from_dict({**data, "model_type": "muse_spark"})
    with pytest.raises(ConfigError, match="`hidden_size`"):
        make_config().check_target(TextConfig(hidden_size=48))


def test_default_target_layer_ids_follow_the_spread() -> None:
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(28, 3) == [1, 13, 25]
    assert default_target_layer_ids(62, 1) == [31]
    for layers, features in [(40, 4), (62, 6), (9, 6)]:
        ids = default_target_layer_ids(layers, features)
        assert ids == [round(1 + i * (layers - 4) / (features - 1)) for i in range(features)]
        assert ids[0] == 1 and ids[-1] == layers - 3 and len(set(ids)) == features
    with pytest.raises(ConfigError, match="num_target_layers"):
        default_target_layer_ids(6, 4)


# -- checkpoint ---------------------------------------------------------------------------------

@pytest.mark.parametrize("options", [ALL_V2, DSPARK])
def test_save_load_round_trip_gives_identical_outputs(tmp_path, target, options) -> None:
    drafter = make_drafter(target, **options)
    assert not any(name.startswith(("embed", "lm_head")) for name in drafter.state_dict())
    save_drafter(drafter, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    loaded = load_drafter(tmp_path).bind_target(target.model.embed_tokens, target.lm_head)
    ids, hidden, _ = sequence(target, drafter.config)
    anchors = torch.tensor([2, 9, 15])
    with torch.no_grad():
        expected, actual = drafter(hidden, ids, anchors), loaded(hidden, ids, anchors)
    assert torch.equal(expected.logits, actual.logits)
    assert torch.equal(expected.confidence, actual.confidence)
    assert torch.equal(propose_at(drafter, hidden, ids, [5, 11]).tokens,
                       propose_at(loaded, hidden, ids, [5, 11]).tokens)


def test_load_casts_and_rejects_a_checkpoint_that_does_not_fit(tmp_path, target) -> None:
    save_drafter(make_drafter(target), tmp_path, dtype=torch.bfloat16)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    assert load_drafter(tmp_path).fc.weight.dtype == torch.bfloat16
    assert load_drafter(tmp_path, dtype=torch.float32).fc.weight.dtype == torch.float32
    make_config(confidence_head=True).save(tmp_path)
    with pytest.raises(CheckpointError, match="confidence_head.weight"):
        load_drafter(tmp_path)


# -- masks: packed training equals per-request inference -------------------------------------

@pytest.mark.parametrize("options", [
    {}, dict(dynamic_conv=True, conv_group_size=8),
    dict(layer_types=[SLIDING, FULL], sliding_window=5)])
def test_packed_training_matches_incremental_inference(target, options) -> None:
    drafter = make_drafter(target, **options)
    if drafter.config.dynamic_conv:
        # Leave the identity so the convolution actually mixes rows.
        for conv in drafter.modules():
            if isinstance(conv, DynamicConv):
                torch.nn.init.normal_(conv.delta_proj.weight, std=0.1)
                torch.nn.init.normal_(conv.base, std=0.5)
    ids, hidden, _ = sequence(target, drafter.config)
    anchors = [6, 10, 17, 21]
    with torch.no_grad():
        packed = drafter(hidden, ids, torch.tensor(anchors)).logits.softmax(dim=-1)

    # Two requests, stepped the way the engine does it: each step appends the rows committed
    # since the last one, so the caches grow by different (ragged) amounts.
    caches = [drafter.new_cache(), drafter.new_cache()]
    starts = [0, 0]
    for step, pair in enumerate([(anchors[0], anchors[1]), (anchors[2], anchors[3])]):
        rows = [torch.arange(start, a) for start, a in zip(starts, pair)]
        proposal = drafter.propose(
            torch.cat([hidden[r] for r in rows]), torch.cat(rows), [len(r) for r in rows],
            ids[list(pair)], torch.tensor(pair), caches, temperature=1.0)
        starts = list(pair)
        torch.testing.assert_close(proposal.probs, packed[2 * step:2 * step + 2],
                                   atol=1e-5, rtol=1e-4)
    assert [c.num_rows for c in caches] == anchors[2:]


def test_blocks_are_non_causal_inside(target) -> None:
    drafter = make_drafter(target)
    ids, hidden, _ = sequence(target, drafter.config)
    anchors = torch.tensor([4, 12])
    embed = target.model.embed_tokens
    bump = torch.zeros(drafter.config.block_size, TARGET.hidden_size)
    bump[-1] = 1.0
    with torch.no_grad():
        plain = drafter(hidden, ids, anchors).logits
        drafter.bind_target(lambda tokens: embed(tokens) + bump, target.lm_head)
        bumped = drafter(hidden, ids, anchors).logits
    # Slot 1 (block position 1) sees the last block position.
    assert (plain[:, 0] - bumped[:, 0]).abs().max() > 1e-4


def test_packed_blocks_see_only_their_context_and_their_own_rows(target) -> None:
    drafter = make_drafter(target)
    ids, hidden, _ = sequence(target, drafter.config)
    anchors = torch.tensor([5, 9, 14])
    with torch.no_grad():
        packed = drafter(hidden, ids, anchors).logits
        for j, anchor in enumerate(anchors.tolist()):
            alone = drafter(hidden, ids, anchors[j:j + 1]).logits[0]
            torch.testing.assert_close(alone, packed[j], atol=1e-5, rtol=1e-4)
        # Rows at or after the anchor (and other tokens there) change nothing for block 0...
        changed_hidden, changed_ids = hidden.clone(), ids.clone()
        changed_hidden[anchors[0]:] += 3.0
        changed_ids[anchors[0] + 1:] = (changed_ids[anchors[0] + 1:] + 7) % (VOCAB - 1)
        later = drafter(changed_hidden, changed_ids, anchors).logits
        torch.testing.assert_close(later[0], packed[0], atol=1e-5, rtol=1e-4)
        # ...but do change the blocks whose anchors come later.
        assert (later[1] - packed[1]).abs().max() > 1e-4
        earlier_hidden = hidden.clone()
        earlier_hidden[anchors[0] - 1] += 3.0
        assert (drafter(earlier_hidden, ids, anchors).logits[0] - packed[0]).abs().max() > 1e-4


# -- batched training: several sequences in one forward -----------------------------------------

BATCH_LENGTHS = [LENGTH, 13, 19]
BATCH_ANCHORS = [[2, 9, 15, 21, 23], [7], [0, 4, 11, 18]]


def leave_identity(drafter) -> None:
    """Random dynamic-convolution weights, so the convolution actually mixes rows."""
    generator = torch.Generator().manual_seed(5)
    for conv in drafter.modules():
        if isinstance(conv, DynamicConv):
            with torch.no_grad():
                conv.delta_proj.weight.normal_(std=0.1, generator=generator)
                conv.base.normal_(std=0.5, generator=generator)


def padded_batch(target, config):
    """Sequences of BATCH_LENGTHS right-padded to LENGTH: ids [S, L], hidden [S, L, K*d] and
    logits [S, L, V], with junk past each end (NaN features, other tokens, huge logits) that
    must never be seen."""
    ids, hidden, logits = [], [], []
    for seed, length in enumerate(BATCH_LENGTHS):
        i, h, lg = (t.clone() for t in sequence(target, config, seed))
        i[length:] = (i[length:] + 5) % (VOCAB - 1)
        h[length:] = float("nan")
        lg[length:] = 1e4
        ids.append(i), hidden.append(h), logits.append(lg)
    return torch.stack(ids), torch.stack(hidden), torch.stack(logits)


def shuffled_layout(order_seed: int = 0):
    """The BATCH_ANCHORS blocks in a random flat order (sequences interleaved), and that
    order as indices into the per-sequence concatenation."""
    flat = torch.tensor([a for anchors in BATCH_ANCHORS for a in anchors])
    index = torch.repeat_interleave(torch.arange(len(BATCH_ANCHORS)),
                                    torch.tensor([len(a) for a in BATCH_ANCHORS]))
    order = torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(order_seed))
    return BlockLayout.build(BATCH_LENGTHS, flat[order], index[order]), order


@pytest.mark.parametrize("options", [
    {}, DSPARK, dict(method="dflash", dynamic_conv=True, conv_group_size=8), ALL_V2,
    dict(layer_types=[SLIDING, FULL], sliding_window=5, dynamic_conv=True, conv_group_size=8)])
def test_batched_forward_equals_per_sequence_forwards(target, options) -> None:
    drafter = make_drafter(target, **options)
    leave_identity(drafter)
    strengthen_sequential_terms(drafter)
    ids, hidden, _ = padded_batch(target, drafter.config)
    layout, order = shuffled_layout()
    assert layout.slots == 5 and layout.num_blocks == 10
    with torch.no_grad():
        batched = drafter.forward_batch(hidden, ids, layout)
        alone = [drafter(hidden[s, :n], ids[s, :n], torch.tensor(BATCH_ANCHORS[s]))
                 for s, n in enumerate(BATCH_LENGTHS)]
    for field in ("logits", "labels", "confidence", "selector_scores", "selector_labels"):
        expected = [getattr(out, field) for out in alone]
        if expected[0] is None:
            assert getattr(batched, field) is None, field
            continue
        expected = torch.cat(expected)[order]
        if expected.is_floating_point():
            torch.testing.assert_close(getattr(batched, field), expected, atol=1e-5, rtol=1e-4)
        else:
            assert torch.equal(getattr(batched, field), expected), field
    assert torch.isfinite(batched.logits).all()
    # The short sequence's block runs past its end: those slots are ignored.
    assert (batched.labels[order == 5] == IGNORE_INDEX).sum() == 2
    assert torch.equal(batched.sequence_index, layout.sequence_index)


@pytest.mark.parametrize("gamma", [None, 2.0])
def test_batched_loss_is_the_anchor_weighted_mean_of_sequence_losses(target, gamma) -> None:
    drafter = make_drafter(target, **DSPARK)
    ids, hidden, logits = padded_batch(target, drafter.config)
    layout, _ = shuffled_layout(order_seed=1)
    size = drafter.config.block_size
    target_logits = block_target_logits(logits, layout.anchors, size, layout.sequence_index,
                                        layout.lengths)
    batched = drafter_loss(drafter.config, drafter.forward_batch(hidden, ids, layout),
                           target_logits, gamma)
    batched.total.backward()
    batched_grads = {name: p.grad.clone() for name, p in drafter.named_parameters()}
    drafter.zero_grad()

    # The old training step: one forward, loss and backward per sequence, weighted by its
    # share of the anchors.
    total_anchors = sum(len(a) for a in BATCH_ANCHORS)
    expected = {name: 0.0 for name, value in vars(batched).items() if value is not None}
    for s, length in enumerate(BATCH_LENGTHS):
        anchors = torch.tensor(BATCH_ANCHORS[s])
        share = len(BATCH_ANCHORS[s]) / total_anchors
        loss = drafter_loss(drafter.config, drafter(hidden[s, :length], ids[s, :length], anchors),
                            block_target_logits(logits[s, :length], anchors, size), gamma)
        (loss.total * share).backward()
        for name in expected:
            expected[name] = expected[name] + getattr(loss, name).detach() * share
    for name, value in expected.items():
        torch.testing.assert_close(getattr(batched, name).detach(), value)
    for name, param in drafter.named_parameters():
        torch.testing.assert_close(batched_grads[name], param.grad, atol=1e-6, rtol=1e-4)
    assert all(torch.isfinite(g).all() for g in batched_grads.values())


def test_block_layout_places_blocks_and_rejects_bad_anchors() -> None:
    layout = BlockLayout.build([10, 6], torch.tensor([3, 1, 5, 0]), torch.tensor([1, 0, 1, 0]))
    assert layout.slots == 2 and layout.num_sequences == 2
    assert layout.grid_index.tolist() == [2, 0, 3, 1]
    assert layout.grid_anchors.tolist() == [[1, 0], [3, 5]]
    same = BlockLayout.for_sequences([10, 6], [torch.tensor([1, 0]), torch.tensor([3, 5])])
    assert same.sequence_index.tolist() == [0, 0, 1, 1] and same.anchors.tolist() == [1, 0, 3, 5]
    for anchors, index in [([6], [1]), ([-1], [0]), ([2], [2]), ([], [])]:
        with pytest.raises(ValueError, match="anchors"):
            BlockLayout.build([10, 6], torch.tensor(anchors, dtype=torch.long),
                              torch.tensor(index, dtype=torch.long))


# -- V2 modules ---------------------------------------------------------------------------------

def test_dynamic_conv_is_identity_at_init(target) -> None:
    with_conv = make_drafter(target, dynamic_conv=True, conv_group_size=8)
    without = make_drafter(target)
    own = {k: v for k, v in with_conv.state_dict().items() if "_conv." not in k}
    without.load_state_dict(own)
    ids, hidden, _ = sequence(target, with_conv.config)
    anchors = torch.tensor([3, 8, 16])
    with torch.no_grad():
        assert torch.equal(with_conv(hidden, ids, anchors).logits,
                           without(hidden, ids, anchors).logits)


def test_dynamic_conv_follows_the_formula_inside_each_block() -> None:
    conv = DynamicConv(hidden_size=16, taps=2, group_size=4)
    torch.nn.init.normal_(conv.base)
    torch.nn.init.normal_(conv.delta_proj.weight)
    x = torch.randn(3, 5, 16)
    with torch.no_grad():
        out = conv(x)
        delta = conv.delta_proj(x).view(3, 5, 2, 4)
    # out[i, c] = sum_t (base[t, c] + delta[i, t, c // 4]) * x[i - t, c], nothing before row 0.
    expected = torch.zeros_like(x)
    for i in range(5):
        for tap in range(min(2, i + 1)):
            weight = conv.base[tap] + delta[:, i, tap].repeat_interleave(4, dim=-1)
            expected[:, i] += weight * x[:, i - tap]
    torch.testing.assert_close(out, expected)
    changed = x.clone()
    changed[0, -1] += 1.0
    with torch.no_grad():
        assert torch.equal(conv(changed)[1:], out[1:])


def test_greedy_selector_walk_is_argmax_consistent(target) -> None:
    drafter = make_drafter(target, **ALL_V2)
    strengthen_sequential_terms(drafter)
    ids, hidden, _ = sequence(target, drafter.config)
    anchors = [7, 13]
    proposal = propose_at(drafter, hidden, ids, anchors)
    assert torch.equal(proposal.probs.argmax(-1), proposal.tokens)
    assert torch.equal(proposal.probs.sum(-1), torch.ones(2, drafter.config.num_draft_tokens))
    assert torch.equal(proposal.probs.max(-1).values, torch.ones(2, 7))
    # Teacher-forcing the drafted tokens gives the same walk: each draft is the best pair score.
    for r, anchor in enumerate(anchors):
        out = forced(drafter, hidden, ids, anchor, proposal.tokens[r])
        assert torch.equal(out.selector_scores[0].argmax(-1), out.selector_labels[0])
    # Without the pair term the walk is the LM head's argmax.
    torch.nn.init.zeros_(drafter.candidate_selector.codebook_b.weight)
    with torch.no_grad():
        logits = drafter(hidden, ids, torch.tensor(anchors)).logits
    assert torch.equal(propose_at(drafter, hidden, ids, anchors).tokens, logits.argmax(-1))


def test_sampled_selector_q_is_the_k_way_softmax_of_the_pair_scores(target) -> None:
    drafter = make_drafter(target, **ALL_V2)
    strengthen_sequential_terms(drafter)
    ids, hidden, _ = sequence(target, drafter.config)
    anchors, temperatures = [7, 13, 19], torch.tensor([0.8, 1.5, 0.0])
    proposal = propose_at(drafter, hidden, ids, anchors, temperatures,
                          torch.Generator().manual_seed(0))
    top_k = drafter.config.selector_top_k
    torch.testing.assert_close(proposal.probs.sum(-1), torch.ones(3, 7))
    assert proposal.probs.gather(-1, proposal.tokens[..., None]).min() > 0
    assert torch.equal(proposal.probs[2].max(-1).values, torch.ones(7))
    for r, anchor in enumerate(anchors[:2]):
        out = forced(drafter, hidden, ids, anchor, proposal.tokens[r])
        candidates = out.logits[0].topk(top_k, dim=-1).indices
        inside = torch.zeros(7, VOCAB, dtype=torch.bool).scatter(-1, candidates, True)
        # No mass outside the top-k; inside, the softmax (whose smallest entries may
        # underflow to 0 in float32 when the pair scores are far apart).
        assert not proposal.probs[r][~inside].any()
        expected = (out.selector_scores[0] / temperatures[r]).softmax(-1)
        torch.testing.assert_close(proposal.probs[r].gather(-1, candidates), expected)


def test_confidence_head_outputs_probabilities(target) -> None:
    drafter = make_drafter(target, **DSPARK)
    ids, hidden, _ = sequence(target, drafter.config)
    proposal = propose_at(drafter, hidden, ids, [6, 12], temperature=1.0,
                          generator=torch.Generator().manual_seed(0))
    assert proposal.confidence.shape == (2, 7)
    assert ((proposal.confidence > 0) & (proposal.confidence < 1)).all()
    with torch.no_grad():
        trained = drafter(hidden, ids, torch.tensor([6, 12])).confidence
    assert ((trained > 0) & (trained < 1)).all()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_markov_walk_matches_teacher_forcing(target, temperature) -> None:
    drafter = make_drafter(target, **DSPARK)
    strengthen_sequential_terms(drafter)
    ids, hidden, _ = sequence(target, drafter.config)
    anchor = 9
    proposal = propose_at(drafter, hidden, ids, [anchor], temperature,
                          torch.Generator().manual_seed(0))
    out = forced(drafter, hidden, ids, anchor, proposal.tokens[0])
    if temperature == 0:
        assert torch.equal(out.logits[0].argmax(-1), proposal.tokens[0])
    else:
        torch.testing.assert_close(proposal.probs, out.logits.softmax(-1))
    torch.testing.assert_close(out.confidence, proposal.confidence, atol=1e-6, rtol=1e-5)


# -- loss ---------------------------------------------------------------------------------------

def test_decay_weights_follow_the_formula() -> None:
    weights = decay_weights(8)
    expected = torch.tensor([math.exp(-(k - 1) / 4) for k in range(1, 8)])
    torch.testing.assert_close(weights, expected)
    torch.testing.assert_close(decay_weights(16), torch.exp(-torch.arange(15.0) / 8))
    torch.testing.assert_close(decay_weights(8, gamma=2.0), torch.exp(-torch.arange(7.0) / 2))


def test_cross_entropy_is_the_decay_weighted_mean(target) -> None:
    drafter = make_drafter(target)
    ids, hidden, _ = sequence(target, drafter.config)
    # The last anchor's block runs past the sequence: its missing slots are ignored.
    anchors = torch.tensor([3, 10, LENGTH - 3])
    with torch.no_grad():
        out = drafter(hidden, ids, anchors)
    loss = drafter_loss(drafter.config, out)
    weights, total, norm = decay_weights(8), 0.0, 0.0
    for j, anchor in enumerate(anchors.tolist()):
        for k in range(1, 8):
            if anchor + k < LENGTH:
                ce = -out.logits[j, k - 1].log_softmax(-1)[ids[anchor + k]]
                total, norm = total + weights[k - 1] * ce, norm + weights[k - 1]
    torch.testing.assert_close(loss.total, total / norm)


@pytest.mark.parametrize("options", [{}, ALL_V2, DSPARK])
def test_loss_is_finite_and_overfits_one_batch(target, options) -> None:
    torch.manual_seed(0)
    drafter = make_drafter(target, **options)
    ids, hidden, logits = sequence(target, drafter.config)
    anchors = torch.tensor([1, 5, 8, 12, 16, 20])
    target_logits = block_target_logits(logits, anchors, drafter.config.block_size)
    optimizer = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    losses = []
    for _ in range(20):
        loss = drafter_loss(drafter.config, drafter(hidden, ids, anchors), target_logits)
        assert torch.isfinite(loss.total)
        optimizer.zero_grad()
        loss.total.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optimizer.step()
        losses.append({name: value.detach().item() for name, value in vars(loss).items()
                       if value is not None})
    # The DSpark and confidence terms have floors above zero (soft labels), so each term is
    # asked to fall, and the total by a quarter.
    assert losses[-1]["total"] < 0.75 * losses[0]["total"]
    assert all(losses[-1][name] < value for name, value in losses[0].items())
    assert all(p.grad is None for p in target.parameters())
