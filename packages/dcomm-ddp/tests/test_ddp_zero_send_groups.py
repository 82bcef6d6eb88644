"""Which pieces (one owner's parameters in one bucket) ZeRO overlap sends back together, and how a group is laid out.

The end-to-end behaviour (bit-identical to non-overlapped ZeRO, one all-gather per group on the
fused path) is tested on gloo ranks in test_ddp_zero_overlap.py (``_send_groups``).
"""

import pytest
import torch

from dcomm.ddp._zero.send_groups import MAX_PADDING, choose_groups, merge_owners, pack_group


def test_each_owner_once_per_group_and_like_sizes_together() -> None:
    # 8 buckets, 2 owners, two sizes: the large ones pair up, then the small ones.
    buckets = [(100, i % 2, "f32") for i in range(4)] + [(3, i % 2, "f32") for i in range(4)]
    groups = choose_groups(buckets, world=2)
    assert groups == [[0, 1], [2, 3], [4, 5], [6, 7]]
    for group in groups:
        assert len({buckets[i][1] for i in group}) == len(group)


def test_groups_hold_one_kind_only() -> None:
    buckets = [(10, 0, "f32"), (10, 1, "f64"), (10, 1, "f32"), (10, 0, "f64")]
    assert choose_groups(buckets, world=2) == [[0, 2], [1, 3]]


@pytest.mark.parametrize(
    ("buckets", "world", "expected"),
    [
        ([(10, 0, "a"), (10, 0, "a")], 2, []),  # one owner: nothing to gather
        ([(10, 0, "a")], 4, []),  # a group of one
        ([(100, 0, "a"), (10, 1, "a")], 4, []),  # 3 * 100 > 110: broadcasts move less
        ([(100, 0, "a"), (60, 1, "a"), (60, 2, "a")], 4, []),  # 3 * 100 > 220
        ([(100, 0, "a"), (100, 1, "a"), (100, 2, "a")], 4, [[0, 1, 2]]),  # 300 <= 300
        ([(100, 0, "a"), (10, 1, "a")], 2, [[0, 1]]),  # 1 * 100 <= 110
    ],
)
def test_a_group_is_kept_only_where_it_moves_no_more_than_broadcasts(
    buckets: list[tuple[int, int, str]], world: int, expected: list[list[int]]
) -> None:
    assert choose_groups(buckets, world) == expected


def test_a_group_puts_each_owners_parameters_at_its_slot_and_keeps_their_values() -> None:
    a = [torch.nn.Parameter(torch.arange(6.0).reshape(2, 3)), torch.nn.Parameter(torch.tensor([7.0]))]
    b = [torch.nn.Parameter(torch.tensor([8.0, 9.0]))]
    before = [p.detach().clone() for p in a + b]
    group, starts = pack_group([(1, a), (0, b)], world=2)
    assert group.piece == 7
    assert group.members == 2
    assert starts == [7, 0]
    assert group.flat.tolist() == [8, 9, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 7]
    for p, value in zip(a + b, before, strict=True):
        assert torch.equal(p, value)
        assert p.untyped_storage().data_ptr() == group.flat.untyped_storage().data_ptr()
    output, piece = group.pair(rank=1)
    assert output is group.flat
    assert piece.tolist() == [0, 1, 2, 3, 4, 5, 7]


@pytest.mark.parametrize(
    ("pieces", "world", "expected"),
    [
        # Equal shares (50 each) from pieces of every size: one group of all.
        ([(30, 0, "a"), (50, 1, "a"), (20, 0, "a")], 2, [[0, 1, 2]]),
        # Shares 55 and 45: padding 10 of 100 elements, the most allowed.
        ([(55, 0, "a"), (45, 1, "a")], 2, [[0, 1]]),
        # Shares 56 and 44: padding 12 of 100 is too much.
        ([(56, 0, "a"), (44, 1, "a")], 2, []),
        # One owner: nothing to gather; each kind on its own.
        ([(10, 0, "a"), (10, 0, "a"), (5, 0, "b"), (5, 1, "b")], 2, [[2, 3]]),
        # A rank that owns nothing of a kind is padded in full: 4 * 10 > 1.1 * 30.
        ([(10, 0, "a"), (10, 1, "a"), (10, 2, "a")], 4, []),
    ],
)
def test_merging_takes_every_piece_of_a_kind_where_the_owners_shares_are_nearly_equal(
    pieces: list[tuple[int, int, str]], world: int, expected: list[list[int]]
) -> None:
    assert MAX_PADDING == 0.1
    assert merge_owners(pieces, world) == expected


def test_a_merged_group_puts_each_owners_pieces_back_to_back_in_its_slot() -> None:
    a1, a2 = torch.nn.Parameter(torch.tensor([1.0, 2.0])), torch.nn.Parameter(torch.tensor([3.0]))
    b = torch.nn.Parameter(torch.tensor([4.0, 5.0]))
    group, starts = pack_group([(0, [a1]), (1, [b]), (0, [a2])], world=2)
    assert (group.piece, group.members) == (3, 3)
    assert starts == [0, 3, 2]
    assert group.flat.tolist() == [1, 2, 3, 4, 5, 0]
    assert [a1.tolist(), a2.tolist(), b.tolist()] == [[1, 2], [3], [4, 5]]
