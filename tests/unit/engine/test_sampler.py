"""Sampler: greedy, filters, and randomness keyed by (seed, token index)."""

from __future__ import annotations

import torch

from pdserve.engine.sampler import SamplingRow, draw_key, sample


def row(temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int = 1, i: int = 0):
    return SamplingRow(temperature, top_k, top_p, seed, i)


def test_greedy_is_argmax() -> None:
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 0.0, 1.0]])
    assert sample(logits, [row(0.0), row(0.0)]) == [1, 0]


def test_same_seed_and_index_draw_the_same_token_in_any_batch() -> None:
    torch.manual_seed(0)
    logits = torch.randn(1, 500)
    alone = sample(logits, [row(seed=42, i=7)])
    batched = sample(
        torch.cat([torch.randn(3, 500), logits]),
        [row(seed=s) for s in (1, 2, 3)] + [row(seed=42, i=7)],
    )
    assert alone[0] == batched[3]
    draws = {sample(logits, [row(seed=42, i=i)])[0] for i in range(40)}
    assert len(draws) > 5  # the index really changes the draw


def test_top_k_one_is_greedy_and_top_k_limits_support() -> None:
    torch.manual_seed(1)
    logits = torch.randn(1, 100)
    best = int(logits.argmax())
    assert {sample(logits, [row(top_k=1, seed=s)])[0] for s in range(30)} == {best}
    top3 = set(torch.topk(logits[0], 3).indices.tolist())
    assert {sample(logits, [row(top_k=3, seed=s)])[0] for s in range(200)} <= top3


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    # p=0.7: 0.5 < 0.7 so the second token is needed, 0.8 >= 0.7 so the third is not.
    seen = {sample(logits, [row(top_p=0.7, seed=s)])[0] for s in range(300)}
    assert seen == {0, 1}


def test_distribution_follows_probabilities() -> None:
    probs = torch.tensor([0.7, 0.2, 0.1])
    logits = torch.log(probs).unsqueeze(0)
    counts = torch.zeros(3)
    n = 3000
    for s in range(n):
        counts[sample(logits, [row(seed=s)])[0]] += 1
    freq = counts / n
    assert torch.allclose(freq, probs, atol=0.03), freq


def test_draw_key_depends_on_both_parts() -> None:
    assert draw_key(1, 2) != draw_key(2, 1)
    assert draw_key(1, 2) == draw_key(1, 2)


def test_a_vanishing_temperature_or_top_p_is_greedy_not_nan() -> None:
    """Found by the worker protocol fuzz: temperature 1e-300 (the scaled logits overflow) or
    top_p 5e-324 (0 in float32) sampled from NaN probabilities and returned token 0."""
    torch.manual_seed(2)
    logits = torch.randn(1, 100)
    best = int(logits.argmax())
    assert best != 0
    for tiny in (row(temperature=1e-300), row(temperature=5e-324), row(top_p=5e-324),
                 row(temperature=1e-45, top_p=1e-300)):  # fmt: skip
        assert sample(logits, [tiny]) == [best]
