"""Subgroups on ``accl`` for every membership pattern torch allows (issue 11, reproduction 1).

torch's ``new_group`` is called by every rank, but a backend's creator only on the members; groups
whose members joined different numbers of earlier groups used to hang (per-rank tag counters).
Each group is checked by an all_reduce whose result names exactly its members.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from mpi4py import MPI

import torchhpc.accl as accl
from torchhpc.runtime import errors

MPI_RANKS = (2, 3, 4)
MPI_TIMEOUT = 150
MPI_VARIANTS = ("mpich",)  # plain np3/np4 already run with local rank > rank


@pytest.fixture(scope="module", autouse=True)
def world():
    dist.init_process_group("accl", timeout=timedelta(seconds=30))
    yield
    dist.destroy_process_group()


def check(group, ranks: list[int]) -> None:
    """All-reduce each member's (global rank + 1) over ``group``: the sum names the members."""
    me = dist.get_rank()
    if me not in ranks:
        assert group == dist.GroupMember.NON_GROUP_MEMBER
        return
    assert dist.get_process_group_ranks(group) == ranks
    t = torch.tensor([float(me + 1)])
    dist.all_reduce(t, group=group)
    assert t.item() == sum(r + 1 for r in ranks), (ranks, t.item())


def test_overlapping_pairs_issue_reproduction() -> None:
    """The issue's reproduction at 3 ranks (and its analogue at 2 and 4): [0, 1] then [1, 2]."""
    n = dist.get_world_size()
    pairs = [[0, 1], [1, 2]] if n >= 3 else [[0, 1], [1]]
    groups = [dist.new_group(p) for p in pairs]
    for g, p in zip(groups, pairs, strict=True):
        check(g, p)


def test_pipeline_neighbour_pairs_then_reverse_use_order() -> None:
    n = dist.get_world_size()
    pairs = [[i, i + 1] for i in range(n - 1)]
    groups = [dist.new_group(p) for p in pairs]
    for g, p in reversed(list(zip(groups, pairs, strict=True))):  # use them in another order than made
        check(g, p)


def test_subsets_singletons_nested_and_repeated() -> None:
    n = dist.get_world_size()
    patterns = [[0], [n - 1], list(range(1, n)), list(range(n)), list(range(n - 1)) or [0],
                [0, n - 1], [0, n - 1], [n - 1], list(range(0, n, 2))]
    groups = [dist.new_group(p) for p in patterns]
    for g, p in zip(groups, patterns, strict=True):
        check(g, sorted(set(p)))
    # repeated membership gives independent groups: interleave collectives on both copies
    a, b = groups[5], groups[6]
    if dist.get_rank() in (0, n - 1):
        x, y = torch.ones(3), torch.full((3,), 2.0)
        wa = dist.all_reduce(x, group=a, async_op=True)
        wb = dist.all_reduce(y, group=b, async_op=True)
        wb.wait()
        wa.wait()
        k = len({0, n - 1})
        assert x.tolist() == [k] * 3 and y.tolist() == [2.0 * k] * 3


def test_unsorted_member_order() -> None:
    n = dist.get_world_size()
    ranks = list(reversed(range(n)))
    g = dist.new_group(ranks, sort_ranks=False)
    assert dist.get_group_rank(g, dist.get_rank()) == ranks.index(dist.get_rank())
    t = torch.tensor([float(dist.get_rank())])
    dist.broadcast(t, group_src=0, group=g)  # group rank 0 is global rank n-1
    assert t.item() == n - 1


def test_new_subgroups_and_by_enumeration() -> None:
    n = dist.get_world_size()
    size = 2 if n % 2 == 0 else 1
    cur, subs = dist.new_subgroups(group_size=size)
    me = dist.get_rank()
    check(cur, [r for r in range(n) if r // size == me // size])
    assert len(subs) == n // size
    enum = [[r] for r in range(n) if r % 2] + [[r for r in range(n) if r % 2 == 0]]
    cur, _ = dist.new_subgroups_by_enumeration(enum)
    check(cur, next(e for e in enum if me in e))


def test_local_synchronization_members_only() -> None:
    """``use_local_synchronization=True``: only members call new_group, pairs made in rank order."""
    n, me = dist.get_world_size(), dist.get_rank()
    made = {}
    for i in range(n - 1):
        if me in (i, i + 1):
            made[i] = dist.new_group([i, i + 1], use_local_synchronization=True)
    for i, g in made.items():
        check(g, [i, i + 1])


def test_subgroup_of_subgroup() -> None:
    """A group inside a group: ``split_group`` of a subgroup where torch allows it, else new_group."""
    n = dist.get_world_size()
    outer_ranks = list(range(n - 1)) if n > 2 else [0, 1]
    outer = dist.new_group(outer_ranks)
    inner_ranks = outer_ranks[: max(1, len(outer_ranks) - 1)]
    inner = dist.new_group(inner_ranks)
    check(outer, outer_ranks)
    check(inner, inner_ranks)


def test_failure_on_one_member_raises_on_all() -> None:
    """A rank-local error in group creation (bad pg_options on one rank) is an error on every member."""
    n, me = dist.get_world_size(), dist.get_rank()
    bad = n - 1
    opts = object() if me == bad else accl.AcclOptions()
    t0 = time.monotonic()
    if me == bad:
        with pytest.raises(TypeError, match="pg_options must be torchhpc.accl.AcclOptions"):
            dist.new_group(backend="accl", pg_options=opts)
    else:
        with pytest.raises(errors.RemoteError, match=rf"rank {bad}: TypeError: accl: pg_options must be"):
            dist.new_group(backend="accl", pg_options=opts)
    assert time.monotonic() - t0 < 20
    # the world still works afterwards
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == n


def test_missing_member_times_out_instead_of_hanging() -> None:
    """A member that never creates the group: the others get the group timeout, not a hang (runs last:
    the ranks' group counters disagree afterwards, as in any program that skips a new_group)."""
    n, me = dist.get_world_size(), dist.get_rank()
    skipper = n - 1  # never the group's first member, so nothing is left sent and unreceived
    t0 = time.monotonic()
    if me != skipper:
        with pytest.raises(errors.PeerTimeoutError, match=r"did not join within 2 s|no answer from the group's"):
            dist.new_group(timeout=timedelta(seconds=2))
        assert time.monotonic() - t0 < 15
    MPI.COMM_WORLD.Barrier()
