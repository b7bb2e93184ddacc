"""Padding, packing and sharding of rollouts: label alignment, token budgets, balanced equal-count rank shards."""

from __future__ import annotations

import pytest
import torch

from trainer.policy.batch import (
    Sample,
    budget_micro_batches,
    micro_batch_tokens,
    pack_batch,
    pad_batch,
    prefers_prefix,
    prefix_batch,
    prefix_positions,
    shard_for_ranks,
    split_to_count,
    unpad_logprobs,
    with_policy_gradient,
)


def test_should_align_loss_mask_and_logprobs_with_response_labels_when_padding():
    a = Sample([1, 2, 3], [4, 5], advantage=1.0, old_logprobs=[-0.1, -0.2])
    b = Sample([1], [6, 7, 8], advantage=-1.0, old_logprobs=[-0.3, -0.4, -0.5], response_mask=[1, 0, 1])
    batch = pad_batch([a, b], pad_id=0)
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 5], [1, 6, 7, 8, 0]]
    # the shortest prompt has 1 token, so the window starts at position 0 and spans all T-1 labels
    assert batch.start == 0
    assert batch.labels.tolist() == [[2, 3, 4, 5], [6, 7, 8, 0]]
    # label position i predicts input_ids[i+1]: a's response labels sit at 2..3, b's at 0..2
    assert batch.loss_mask.tolist() == [[0, 0, 1, 1], [1, 0, 1, 0]]
    assert batch.old_logprobs[0, 2:].tolist() == pytest.approx([-0.1, -0.2])
    assert batch.old_logprobs[1, :3].tolist() == pytest.approx([-0.3, -0.4, -0.5])
    assert batch.ref_logprobs is None
    assert unpad_logprobs([a, b], batch, batch.old_logprobs) == [
        pytest.approx([-0.1, -0.2]),
        pytest.approx([-0.3, -0.4, -0.5]),
    ]
    assert batch.advantages.tolist() == [1.0, -1.0]


def test_should_give_every_rank_the_same_count_and_similar_tokens_when_sharding():
    samples = [Sample([0] * 3, [0] * n) for n in [50, 1, 40, 2, 30, 3, 20, 4]]
    shards = shard_for_ranks(samples, 2)
    assert sorted(i for s in shards for i in s) == list(range(8))
    assert [len(s) for s in shards] == [4, 4]
    tokens = [sum(samples[i].length for i in s) for s in shards]
    assert abs(tokens[0] - tokens[1]) <= 12
    with pytest.raises(ValueError):
        shard_for_ranks(samples[:3], 2)


def test_should_skip_prompt_positions_when_every_prompt_is_long():
    a = Sample([1, 2, 3, 4], [5, 6], old_logprobs=[-1.0, -2.0])
    b = Sample([1, 2, 3], [7], old_logprobs=[-3.0])
    batch = pad_batch([a, b], pad_id=0)
    assert batch.start == 2  # positions 0..1 only predict prompt tokens
    assert batch.labels.tolist() == [[4, 5, 6], [7, 0, 0]]
    assert batch.loss_mask.tolist() == [[0, 1, 1], [1, 0, 0]]
    assert batch.old_logprobs.tolist() == [[0.0, -1.0, -2.0], [-3.0, 0.0, 0.0]]
    assert unpad_logprobs([a, b], batch, batch.old_logprobs) == [[-1.0, -2.0], [-3.0]]


def test_should_pad_with_pad_id_when_lengths_differ():
    batch = pad_batch([Sample([5], [6]), Sample([5, 5, 5], [6, 6])], pad_id=9)
    assert batch.input_ids[0].tolist() == [5, 6, 9, 9, 9]
    assert batch.attention_mask.sum(1).tolist() == [2, 5]
    assert torch.equal(batch.labels, batch.input_ids[:, 1:])


def test_should_run_each_distinct_prompt_once_when_samples_share_prompts():
    a = Sample([1, 2, 3], [4, 5], advantage=1.0, old_logprobs=[-0.1, -0.2])
    b = Sample([7], [6, 7, 8], advantage=-1.0, old_logprobs=[-0.3, -0.4, -0.5], response_mask=[1, 0, 1])
    c = Sample([1, 2, 3], [9], advantage=0.5, old_logprobs=[-0.6])
    batch = prefix_batch([a, b, c], pad_id=0)
    assert batch.prompt_ids.tolist() == [[1, 2, 3], [0, 0, 7]]  # left-padded: all end at the last column
    assert batch.prompt_mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert batch.rows.tolist() == [0, 1, 0]
    # column j is response token j, for every sample
    assert batch.labels.tolist() == [[4, 5, 0], [6, 7, 8], [9, 0, 0]]
    assert batch.response_mask.tolist() == [[1, 1, 0], [1, 1, 1], [1, 0, 0]]
    assert batch.loss_mask.tolist() == [[1, 1, 0], [1, 0, 1], [1, 0, 0]]
    assert batch.old_logprobs[1].tolist() == pytest.approx([-0.3, -0.4, -0.5])
    assert batch.ref_logprobs is None
    assert unpad_logprobs([a, b, c], batch, batch.old_logprobs) == [
        pytest.approx([-0.1, -0.2]),
        pytest.approx([-0.3, -0.4, -0.5]),
        pytest.approx([-0.6]),
    ]


def test_should_keep_each_prompt_group_on_one_rank_when_groups_divide_evenly():
    samples = [Sample([g] * (3 + g), [0] * (1 + (g * 7 + i) % 5)) for g in range(4) for i in range(4)]
    shards = shard_for_ranks(samples, 2)
    assert sorted(i for s in shards for i in s) == list(range(16))
    assert [len(s) for s in shards] == [8, 8]
    for shard in shards:
        prompts = [tuple(samples[i].prompt_ids) for i in shard]
        assert len(set(prompts)) == 2 and all(prompts.count(p) == 4 for p in prompts)
    # 3 groups over 2 ranks cannot stay whole: sample-level dealing, equal counts
    shards = shard_for_ranks(samples[:12], 2)
    assert [len(s) for s in shards] == [6, 6]


def test_should_keep_samples_with_an_advantage_and_top_up_with_the_shortest_others_when_skipping():
    samples = [
        Sample([1, 2], [3] * n, advantage=a) for n, a in [(5, 0.0), (2, 1.0), (1, 0.0), (3, -1.0), (4, 0.5)]
    ]
    assert with_policy_gradient(samples, 1) == [samples[1], samples[3], samples[4]]
    # 3 with a gradient over 2 ranks: the shortest zero-advantage sample makes it 4
    assert with_policy_gradient(samples, 2) == [samples[1], samples[3], samples[4], samples[2]]
    assert with_policy_gradient(samples[1:2] + samples[3:4], 2) == [samples[1], samples[3]]
    assert with_policy_gradient([samples[0], samples[2]], 2) == []  # nothing to train on


def test_should_restart_positions_and_predict_only_response_tokens_when_packing():
    a = Sample([1, 2, 3], [4, 5], advantage=1.0, old_logprobs=[-0.1, -0.2])
    b = Sample([1], [6, 7, 8], advantage=-1.0, old_logprobs=[-0.3, -0.4, -0.5], response_mask=[1, 0, 1])
    batch = pack_batch([a, b], pad_id=0)
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 5, 1, 6, 7, 8]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3]]
    assert batch.cu_seqlens.tolist() == [0, 5, 9] and batch.max_seqlen == 5
    # a's response is predicted from positions 2..3, b's from 5..7 (b's prompt is its one token at 5)
    assert batch.predict.tolist() == [2, 3, 5, 6, 7]
    assert batch.flat_labels.tolist() == [4, 5, 6, 7, 8]
    assert batch.labels.tolist() == [[4, 5, 0], [6, 7, 8]]
    assert batch.loss_mask.tolist() == [[1, 1, 0], [1, 0, 1]]
    window = batch.to_window(torch.tensor([-0.1, -0.2, -0.3, -0.4, -0.5]))
    torch.testing.assert_close(window, torch.tensor([[-0.1, -0.2, 0.0], [-0.3, -0.4, -0.5]]))
    torch.testing.assert_close(window, batch.old_logprobs)
    assert unpad_logprobs([a, b], batch, window) == [
        pytest.approx([-0.1, -0.2]),
        pytest.approx([-0.3, -0.4, -0.5]),
    ]


@pytest.mark.parametrize("packed", [True, False])
def test_should_keep_every_micro_batch_within_the_budget_when_filling_by_tokens(packed):
    lengths = [50, 7, 33, 12, 48, 3, 20, 20, 9, 41]
    bins = budget_micro_batches(lengths, 64, packed)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(micro_batch_tokens([lengths[i] for i in b], packed) <= 64 for b in bins)
    # first-fit decreasing packs 243 tokens into 4 micro-batches of 64 (the fewest possible)
    assert len(bins) == (4 if packed else 6)
    with pytest.raises(ValueError, match="65 tokens"):
        budget_micro_batches([65], 64, packed)


def test_should_split_the_largest_micro_batch_when_another_rank_runs_more():
    lengths = [30, 30, 20, 10, 5]
    bins = budget_micro_batches(lengths, 64, packed=True)  # [[0, 1], [2, 3, 4]]
    split = split_to_count(bins, 4, lengths)
    assert len(split) == 4
    assert sorted(i for b in split for i in b) == list(range(5))
    assert all(sum(lengths[i] for i in b) <= 64 for b in split)
    assert split_to_count(bins, 2, lengths) == bins
    with pytest.raises(ValueError, match="cannot fill 6"):
        split_to_count(bins, 6, lengths)


def test_should_prefer_the_shared_prompt_layout_only_when_it_runs_fewer_positions():
    prompt = list(range(1, 21))
    group = [Sample(prompt, [7] * n) for n in (4, 5, 4, 5)]
    assert prefix_positions(group) == 20 + 4 * 5 and prefers_prefix(group)  # 40 against 98 packed
    ragged = [Sample(prompt, [7] * n) for n in (1, 60, 2, 3)]
    assert prefix_positions(ragged) == 20 + 4 * 60 and not prefers_prefix(ragged)  # 260 against 146
    distinct = [Sample([k] * 20, [7] * 4) for k in range(4)]  # no prompt shared: nothing to gain
    assert not prefers_prefix(distinct)
