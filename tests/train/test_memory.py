"""Choosing the training batch from the device's free memory, and gradient accumulation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from muse.presets import get_preset
from muse.train import memory
from muse.train.memory import activation_bytes_per_sequence, plan_batch
from muse.train.pretrain import accumulate_gradients, build_model
from muse.train.router_balance import RouterLoadBalance

CPU = torch.device("cpu")
# What the 24 GB CPU machine of CI and users reports free with little else running.
FREE_ON_A_24_GB_MACHINE = 22_000_000_000


def planned_peak(plan: memory.BatchPlan, preset: str) -> float:
    text = get_preset(preset).text_config
    return (memory.RUNTIME_BYTES["cpu"] + memory.training_state_bytes(text)
            + plan.micro_batch_size * plan.bytes_per_sequence)


def saved_activation_bytes(preset: str, seq_len: int) -> int:
    """Bytes autograd keeps for the backward pass of one sequence, weights left out."""
    config = get_preset(preset)
    model = build_model(config, seed=0)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    tokens = torch.randint(0, config.text_config.vocab_size, (1, seq_len))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logits = model(tokens).logits
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1))
    return sum(kept.values())


@pytest.mark.parametrize("preset", ["muse-spark-default", "muse-spark-tiny"])
def test_the_activation_estimate_covers_what_autograd_keeps(preset: str) -> None:
    kept = saved_activation_bytes(preset, 256)
    estimate = activation_bytes_per_sequence(get_preset(preset).text_config, 256)
    # Above what is kept (the backward pass needs more on top), yet not so far above that
    # it wastes most of the memory.
    assert kept <= estimate <= 3 * kept


def test_the_readme_command_fits_a_24_gb_cpu_machine() -> None:
    """`muse train pretrain --preset muse-spark-default ...` with no batch flags."""
    plan = plan_batch(get_preset("muse-spark-default").text_config, CPU,
                      available_bytes=FREE_ON_A_24_GB_MACHINE)
    assert plan.seq_len == 1024 and 1 <= plan.batch_size <= memory.CPU_BATCH_SIZE
    assert plan.micro_batch_size == plan.batch_size
    assert planned_peak(plan, "muse-spark-default") <= FREE_ON_A_24_GB_MACHINE / 2


def test_a_given_batch_too_large_for_memory_is_split_into_micro_batches() -> None:
    text = get_preset("muse-spark-default").text_config
    plan = plan_batch(text, CPU, batch_size=32, available_bytes=FREE_ON_A_24_GB_MACHINE)
    assert plan.batch_size == 32 and plan.seq_len == 1024
    assert plan.micro_batch_size < 32 and plan.accumulation_steps > 1
    assert plan.micro_batch_size * plan.accumulation_steps >= 32
    assert planned_peak(plan, "muse-spark-default") <= FREE_ON_A_24_GB_MACHINE / 2


def test_a_gpu_keeps_the_recipe_batch_and_accumulates_when_short_of_memory() -> None:
    text = get_preset("muse-spark-default").text_config
    roomy = plan_batch(text, torch.device("cuda"), available_bytes=140_000_000_000)
    assert (roomy.batch_size, roomy.micro_batch_size, roomy.seq_len) == (32, 32, 1024)
    small = plan_batch(text, torch.device("cuda"), available_bytes=16_000_000_000)
    assert small.batch_size == 32 and small.micro_batch_size < 32


def test_little_memory_shortens_the_sequence_unless_it_was_given() -> None:
    text = get_preset("muse-spark-default").text_config
    chosen = plan_batch(text, CPU, available_bytes=5_000_000_000)
    assert memory.MIN_SEQ_LEN <= chosen.seq_len < 1024 and chosen.batch_size >= 1
    given = plan_batch(text, CPU, seq_len=1024, available_bytes=5_000_000_000)
    assert given.seq_len == 1024 and given.micro_batch_size == 1


def test_the_free_memory_of_this_machine_is_read() -> None:
    free = memory.available_memory_bytes(CPU)
    assert free is not None and free > 0


@pytest.mark.parametrize("micro_batch_size", [1, 3])
def test_accumulated_gradients_equal_those_of_the_whole_batch(micro_batch_size: int) -> None:
    config = get_preset("muse-spark-tiny")
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.text_config.vocab_size, (4, 33), generator=generator)
    batch = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:],
             # Rows with different numbers of trained tokens, so the normalisation matters.
             "sources": torch.randint(0, 3, (4, 32), generator=generator)}

    def gradients(rows_per_pass: int) -> dict[str, torch.Tensor]:
        model = build_model(config, seed=0)
        balance = RouterLoadBalance(model, config.text_config.num_experts_per_tok)
        accumulate_gradients(model, balance, batch, rows_per_pass, 0.0, CPU)
        return {name: p.grad for name, p in model.named_parameters()}

    whole, split = gradients(4), gradients(micro_batch_size)
    for name, grad in whole.items():
        torch.testing.assert_close(split[name], grad, rtol=1e-4, atol=1e-7, msg=name)
