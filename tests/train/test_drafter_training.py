"""`muse train drafter` on a CPU: the data, a short run, and the offline acceptance metric."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from muse.checkpoint import load_config, load_reference_model
from muse.cli import build_parser, main
from muse.engine.sampling_params import SamplingParams
from muse.init_checkpoint import init_random_checkpoint
from muse.llm import LLM
from muse.presets import get_preset
from muse.speculative.drafter import (
    IGNORE_INDEX,
    BlockLayout,
    DrafterTrainOutput,
    MuseDrafter,
    load_drafter,
)
from muse.tokenizer import MuseTokenizer
from muse.train.data.conversations import TEXT_TASKS
from muse.train.data.split import HELD_OUT, TRAIN
from muse.train import drafter as drafter_training
from muse.train.drafter import (
    IntervalStats,
    build_optimizer,
    chunk_rows,
    count_accepted,
    drafter_config,
    evaluate_acceptance,
    greedy_drafts,
    mask_token_id,
    target_batch,
    train_step,
)
from muse.train.drafter_data import DrafterExample, build_data, render_prompt, sample_prompts
from muse.train.drafter_options import SUMMARY_FILE, DrafterTrainArgs

MAX_TOKENS = 12
SMALL = dict(markov_rank=16, intermediate_size=64)


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random muse-spark-tiny checkpoint (float32), peaked enough to repeat itself."""
    folder = tmp_path_factory.mktemp("tiny")
    init_random_checkpoint(get_preset("muse-spark-tiny"), folder, seed=0, std=0.1)
    return folder


@pytest.fixture(scope="module")
def data(target: Path):
    return build_data(str(target), num_train=6, num_eval=4, seed=0, max_tokens=MAX_TOKENS,
                      device="cpu", mask_token_id=mask_token_id(target))


@pytest.fixture(scope="module")
def reference(target: Path):
    return load_reference_model(target).requires_grad_(False)


def test_prompts_are_seeded_and_train_and_held_out_never_meet() -> None:
    tokenizer = MuseTokenizer.base()

    def rendered(seed: int, split: str) -> list[tuple[int, ...]]:
        return [tuple(render_prompt(tokenizer, p)) for p in sample_prompts(60, seed, split)]

    train = rendered(0, TRAIN)
    assert train == rendered(0, TRAIN) and train != rendered(1, TRAIN)
    held_out = rendered(0, HELD_OUT) + rendered(1, HELD_OUT)
    assert not set(train) & set(held_out)
    assistant = tokenizer.token_to_id("<|assistant|>")
    # Every prompt ends with the generation prompt, as LLM.chat renders it.
    assert all(assistant in ids[-3:] for ids in train)
    prompts = sample_prompts(60, 0, TRAIN)
    assert {p.task for p in prompts} == {task.name for task in TEXT_TASKS}
    assert all(p.messages[-1]["role"] != "assistant" for p in prompts)


def test_answers_are_the_engines_greedy_output(target: Path, data) -> None:
    assert len(data.train) == 6 and len(data.eval) == 4
    assert not {tuple(e.prompt_ids) for e in data.train} & {tuple(e.prompt_ids)
                                                           for e in data.eval}
    assert data.stats["answers_with_mask_token"] == 0
    llm = LLM(str(target), device="cpu", seed=5)
    examples = data.train + data.eval
    outputs = llm.generate([{"prompt_token_ids": e.prompt_ids} for e in examples],
                           SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                          skip_special_tokens=False), use_tqdm=False)
    for example, output in zip(examples, outputs):
        assert example.response_ids == list(output.outputs[0].token_ids)
        assert 1 <= len(example.response_ids) <= MAX_TOKENS
        assert example.input_ids[example.response_start:] == example.response_ids


def test_a_short_run_lowers_the_loss_and_writes_a_loadable_drafter(target: Path,
                                                                    tmp_path: Path) -> None:
    out = tmp_path / "drafter"
    main(["train", "drafter", "--target", str(target), "--out", str(out), "--num-prompts", "6",
          "--eval-prompts", "3", "--max-tokens", str(MAX_TOKENS), "--steps", "24",
          "--batch-size", "3", "--lr", "3e-3", "--markov-rank", "16", "--intermediate-size",
          "64", "--device", "cpu", "--log-every", "4", "--seed", "2"])
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [4, 8, 12, 16, 20, 24]
    assert log[-1]["loss"] < 0.9 * log[0]["loss"]
    assert log[-1]["cross_entropy"] < log[0]["cross_entropy"]
    assert all(r["lr"] > 0 and r["tokens_per_s"] > 0 and r["confidence_bce"] > 0 for r in log)

    drafter = load_drafter(out)
    text = load_config(target).text_config
    drafter.config.check_target(text)
    assert drafter.config.method == "dspark" and drafter.config.confidence_head
    assert drafter.config.target_layer_ids == [1, 2, 3]  # 5 features capped at N - 3
    assert drafter.config.mask_token_id == 31 and drafter.config.dtype == "bfloat16"
    assert (out / "model.safetensors").stat().st_size < 2_000_000
    summary = json.loads((out / SUMMARY_FILE).read_text())
    assert summary["steps"] == 24 and summary["config"] == drafter.config.to_dict()
    assert summary["mask_token"] == {"id": 31, "token": "<|reserved_31|>"}
    figures = summary["eval"]
    assert figures["blocks"] > 0 and 1.0 <= figures["mean_acceptance_length"] <= 8.0
    assert len(figures["accepted_by_position"]) == 7

    # The saved drafter runs: bound to the target, it proposes a block.
    reference = load_reference_model(target)
    drafter = load_drafter(out, dtype=torch.float32)
    drafter.bind_target(reference.model.embed_tokens, reference.lm_head)
    ids = torch.arange(40, 60)
    with torch.no_grad():
        hidden = torch.cat(list(reference(ids[None], hidden_layers=[1, 2, 3])
                                .hidden_states.values()), dim=-1)[0]
    proposal = drafter.propose(hidden[:10], torch.arange(10), [10], ids[10:11],
                               torch.tensor([10]), [drafter.new_cache()])
    assert proposal.tokens.shape == (1, 7) and proposal.confidence.shape == (1, 7)


class Oracle(nn.Module):
    """A test double that drafts the sequence's own next tokens: every draft is accepted."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config

    def forward_batch(self, hidden, input_ids, layout: BlockLayout) -> DrafterTrainOutput:
        targets = layout.anchors[:, None] + torch.arange(1, self.config.block_size)
        last = layout.lengths[layout.sequence_index][:, None] - 1
        labels = torch.where(targets <= last, input_ids[layout.sequence_index[:, None],
                                                        torch.minimum(targets, last)],
                             IGNORE_INDEX)
        logits = 30.0 * F.one_hot(labels.clamp(min=0), self.config.vocab_size).float()
        return DrafterTrainOutput(logits=logits, labels=labels,
                                  sequence_index=layout.sequence_index,
                                  num_sequences=layout.num_sequences)


def test_acceptance_is_the_block_size_for_an_oracle_and_about_one_for_a_random_drafter(
        target: Path, data, reference) -> None:
    assert count_accepted(torch.tensor([[5, 6, 7], [5, 0, 7], [0, 6, 7]]),
                          torch.tensor([[5, 6, 7]] * 3)).tolist() == [3, 1, 0]
    text = reference.config
    oracle = Oracle(drafter_config(text, DrafterTrainArgs(method="dflash", **SMALL), 31))
    short = DrafterExample("tools", data.eval[0].prompt_ids, data.eval[0].response_ids[:7])
    report = evaluate_acceptance(oracle, reference, data.eval + [short], torch.device("cpu"))
    # An answer of n tokens holds n - 7 whole blocks (none in the short one).
    assert report["blocks"] == sum(len(e.response_ids) - 7 for e in data.eval) > 0
    assert report["mean_acceptance_length"] == 8.0
    assert report["accepted_by_position"] == [1.0] * 7

    config = drafter_config(text, DrafterTrainArgs(**SMALL), 31)
    drafter = MuseDrafter(config)
    drafter.init_weights(seed=0)
    drafter.bind_target(reference.model.embed_tokens, reference.lm_head).eval()
    report = evaluate_acceptance(drafter, reference, data.eval, torch.device("cpu"))
    assert 1.0 <= report["mean_acceptance_length"] < 1.1
    assert report["accepted_by_position"][0] < 0.1
    assert set(report["tasks"]) == {e.task for e in data.eval}
    assert report["loss"]["cross_entropy"] > 5.0


@pytest.mark.parametrize("options", [{"method": "dspark"}, {"method": "dflash"},
                                     {"method": "dflash", "candidate_selector": True}])
def test_packed_greedy_drafts_are_the_inference_walks_drafts(data, reference,
                                                             options: dict) -> None:
    """Where the sequence continues with the walk's own drafts, the packed forward's argmax
    reproduces all of them (the Markov bias then sees the same previous tokens); with a
    candidate selector the evaluation takes the walk's drafts."""
    config = drafter_config(reference.config, DrafterTrainArgs(**options, **SMALL), 31)
    drafter = MuseDrafter(config)
    drafter.init_weights(seed=3, std=0.2)
    drafter.bind_target(reference.model.embed_tokens, reference.lm_head).eval()
    example = max(data.train, key=lambda e: len(e.input_ids))
    batch = target_batch(reference, [example.input_ids], config.target_layer_ids, False,
                         torch.device("cpu"))
    ids, hidden = batch.input_ids[0], batch.hidden[0]
    anchor = example.response_start
    with torch.no_grad():
        walk = drafter.propose(hidden[:anchor], torch.arange(anchor), [anchor],
                               ids[anchor:anchor + 1], torch.tensor([anchor]),
                               [drafter.new_cache()]).tokens[0]
        forced = torch.cat([ids[:anchor + 1], walk])
        packed = greedy_drafts(drafter, hidden[:forced.shape[0]], forced,
                               torch.tensor([anchor]))[0]
    assert packed.tolist() == walk.tolist()
    assert int(count_accepted(packed[None], walk[None])) == config.num_draft_tokens


def test_chunks_keep_whole_sequences_inside_the_budgets() -> None:
    counts, lengths = [5, 0, 3, 4, 2], [30, 9, 20, 40, 10]
    assert chunk_rows(counts, lengths, 8) == [[0, 2, 3, 4]]
    # Longest first, a new chunk when the blocks would pass the budget.
    assert chunk_rows(counts, lengths, 8, max_blocks=9) == [[0, 3], [2, 4]]
    assert chunk_rows(counts, lengths, 8, max_blocks=7) == [[3], [0], [2, 4]]
    assert chunk_rows(counts, lengths, 8, max_blocks=1) == [[3], [0], [2], [4]]
    # Padded attention cells: sequences x most blocks x B x (longest + B).
    assert chunk_rows(counts, lengths, 8, max_cells=2 * 5 * 8 * 48) == [[0, 3], [2, 4]]


def test_a_step_in_chunks_equals_one_batched_step(data, reference, monkeypatch) -> None:
    """The batch's loss is the anchor-weighted mean of its sequences' losses however it is
    split: the same step in one forward or in one chunk per sequence moves the weights
    alike."""
    args = DrafterTrainArgs(**SMALL, max_anchors=5)
    config = drafter_config(reference.config, args, 31)
    device = torch.device("cpu")

    def one_step(chunk_blocks: int):
        monkeypatch.setattr(drafter_training, "chunk_blocks", lambda *_: chunk_blocks)
        drafter = MuseDrafter(config)
        drafter.init_weights(seed=4)
        drafter.bind_target(reference.model.embed_tokens, reference.lm_head).train()
        stats = IntervalStats()
        norm = train_step(drafter, reference, build_optimizer(drafter, args, device),
                          data.train, 1e-3, args, device, torch.Generator().manual_seed(0),
                          stats)
        return norm, drafter.state_dict(), stats.record()

    norm, weights, record = one_step(10_000)
    chunked_norm, chunked_weights, chunked_record = one_step(1)
    torch.testing.assert_close(chunked_norm, norm)
    # Adam divides each gradient by its own size, so where one is near zero the summation
    # order of the chunks moves that weight by up to ~1e-5 of the step's 1e-3; a wrong
    # weighting of the chunks moves many weights by about the whole step.
    for name, value in weights.items():
        torch.testing.assert_close(chunked_weights[name], value, atol=1e-4, rtol=1e-3)
    for name in ("loss", "cross_entropy", "probability_l1", "confidence_bce"):
        assert record[name] == pytest.approx(chunked_record[name], rel=1e-5)
    assert record["blocks_per_s"] > 0 and record["train_acceptance_length"] >= 1.0


def test_cli_help_shows_the_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["train", "drafter", "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for expected in ("--method {dspark,dflash}", "(default: dspark)", "draft layers (default: 1)",
                     "(default: 8)", "(default: 512)", "peak learning rate (default: 0.0006)",
                     "<|reserved_31|>", "(default: TARGET/drafter)"):
        assert expected in text, expected
