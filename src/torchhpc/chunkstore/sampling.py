"""Neighbor sampling on a CSC graph whose arrays are ChunkTensors (or plain tensors).

The graph is ``indptr`` (num_nodes + 1) and ``indices`` (num_edges): the in-neighbors of node
``v`` are ``indices[indptr[v]:indptr[v+1]]``, optionally with per-edge weights ``probs``.
All sampling is vectorised over seeds (loops run only over the fan-out, never over nodes):

- uniform, with replacement: ``fanout`` independent uniform offsets per seed;
- uniform, without replacement: every neighbor when ``deg <= fanout``, else Floyd's algorithm
  (``fanout`` steps, each vectorised over the seeds) -- cost independent of the degree;
- weighted, with replacement: inverse-CDF lookup in a per-seed cumulative sum;
- weighted, without replacement: Efraimidis-Spirakis keys ``log(u) / w``, top ``fanout`` per seed.

With ChunkTensors spanning several nodes the gathers are collective, so every rank must call
the sampler the same number of times (with any number of seeds, also zero).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .chunk_tensor import ChunkTensor

__all__ = ["sample_neighbors", "NeighborSampler", "Block", "MiniBatch"]

Store = ChunkTensor | torch.Tensor


def _refuse(store: Store, error: BaseException) -> None:
    """A local error before the collective gather of ``store``: make the peers waiting in it raise too."""
    if isinstance(store, ChunkTensor):
        store._refuse_gather(error)


def _gather(store: Store, ids: torch.Tensor) -> torch.Tensor:
    if isinstance(store, ChunkTensor):
        return store.index(ids)
    return store.index_select(0, ids.to(store.device))


def _expand(start: torch.Tensor, deg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """All edge ids ``start[i] .. start[i]+deg[i]-1``, concatenated, with the segment ``i`` of each."""
    seg = torch.repeat_interleave(torch.arange(len(deg)), deg)
    seg_start = torch.cumsum(deg, 0) - deg
    return start[seg] + (torch.arange(len(seg)) - seg_start[seg]), seg


def _rand(shape: tuple[int, ...], gen: torch.Generator | None) -> torch.Tensor:
    return torch.rand(shape, generator=gen, dtype=torch.float64)


def _uniform(start, deg, k, replace, gen):
    """(segment, edge id) of uniform samples; ``k < 0`` takes every neighbor."""
    n = len(deg)
    if replace and k >= 0:
        seg = torch.nonzero(deg > 0).squeeze(1)
        off = (_rand((len(seg), k), gen) * deg[seg, None]).long()
        off = torch.minimum(off, deg[seg, None] - 1)
        return seg.repeat_interleave(k), (start[seg, None] + off).reshape(-1)
    small = (deg <= k) if k >= 0 else torch.ones(n, dtype=torch.bool)
    s_idx = torch.nonzero(small).squeeze(1)
    e_small, seg_small = _expand(start[s_idx], deg[s_idx])
    seg_small = s_idx[seg_small]
    b_idx = torch.nonzero(~small).squeeze(1)
    d = deg[b_idx]
    chosen = torch.empty((len(b_idx), max(k, 0)), dtype=torch.int64)
    for i in range(max(k, 0)):  # Floyd: a uniform k-subset of range(d) in k vectorised steps
        j = d - k + i
        t = torch.minimum((_rand((len(b_idx),), gen) * (j + 1)).long(), j)
        if i:
            t = torch.where((chosen[:, :i] == t[:, None]).any(1), j, t)
        chosen[:, i] = t
    seg_big = b_idx.repeat_interleave(max(k, 0))
    e_big = (start[b_idx, None] + chosen).reshape(-1)
    return torch.cat([seg_small, seg_big]), torch.cat([e_small, e_big])


def _weights(probs: Store, eids: torch.Tensor, next_store: Store) -> torch.Tensor:
    w = _gather(probs, eids).to(torch.float64).reshape(-1)
    if w.numel() and (not bool(torch.isfinite(w).all()) or bool((w < 0).any())):
        error = ValueError("edge probabilities must be finite and >= 0")
        _refuse(next_store, error)  # peers are about to gather from it
        raise error
    return w


def _weighted(start, deg, k, replace, probs, gen, next_store):
    eids, seg = _expand(start, deg)
    w = _weights(probs, eids, next_store)
    n = len(deg)
    if k < 0:
        keep = w > 0
        return seg[keep], eids[keep]
    if replace:
        total = torch.zeros(n, dtype=torch.float64).index_add_(0, seg, w)
        ok = torch.nonzero(total > 0).squeeze(1)
        cum = torch.cumsum(w, 0)
        seg_start = torch.cumsum(deg, 0) - deg
        cum_before = torch.cat([torch.zeros(1, dtype=torch.float64), cum[:-1]])
        base = cum_before[seg_start[ok]]
        target = base[:, None] + _rand((len(ok), k), gen) * total[ok, None]
        pick = torch.searchsorted(cum, target.reshape(-1), right=True)
        # rounding may step past the segment: clamp to its last edge of positive weight
        pos = torch.arange(len(w))
        last_pos = torch.full((n,), -1, dtype=torch.int64).scatter_reduce_(
            0, seg[w > 0], pos[w > 0], reduce="amax")
        pick = torch.minimum(pick, last_pos[ok].repeat_interleave(k))
        return ok.repeat_interleave(k), eids[pick]
    # Efraimidis-Spirakis: the k largest keys log(u)/w form a weighted sample without replacement.
    u = _rand((len(w),), gen).clamp_min(torch.finfo(torch.float64).tiny)
    key = torch.where(w > 0, torch.log(u) / w, torch.tensor(float("-inf"), dtype=torch.float64))
    by_key = torch.argsort(key, descending=True, stable=True)
    order = by_key[torch.argsort(seg[by_key], stable=True)]
    seg_start = torch.cumsum(deg, 0) - deg
    s = seg[order]
    rank = torch.arange(len(order)) - seg_start[s]
    keep = (rank < k) & (key[order] > float("-inf"))
    return s[keep], eids[order[keep]]


def _sample(seeds: torch.Tensor, indptr: Store, indices: Store, fanout: int, replace: bool,
            probs: Store | None, gen: torch.Generator | None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(neighbor ids, seed positions, edge ids) of the sampled in-edges, ordered by seed."""
    seeds = seeds.reshape(-1).to(torch.int64)
    bounds = _gather(indptr, torch.cat([seeds, seeds + 1])).to(torch.int64).reshape(-1)
    start, deg = bounds[: len(seeds)], bounds[len(seeds):] - bounds[: len(seeds)]
    if probs is None:
        seg, eids = _uniform(start, deg, fanout, replace, gen)
    else:
        seg, eids = _weighted(start, deg, fanout, replace, probs, gen, indices)
    order = torch.argsort(seg, stable=True)
    seg, eids = seg[order], eids[order]
    nbr = _gather(indices, eids).to(torch.int64).reshape(-1)
    return nbr, seg, eids


def _check(seeds: torch.Tensor, fanout: int, num_nodes: int) -> torch.Tensor:
    if not isinstance(seeds, torch.Tensor):
        seeds = torch.as_tensor(seeds)  # keep the dtype: float ids are refused below, not truncated
        seeds = seeds.to(torch.int64) if seeds.numel() == 0 else seeds
    if seeds.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"seeds must be an int32 or int64 tensor, got {seeds.dtype}")
    seeds = seeds.reshape(-1).cpu()
    if seeds.numel() and (int(seeds.min()) < 0 or int(seeds.max()) >= num_nodes):
        lo, hi = int(seeds.min()), int(seeds.max())
        raise IndexError(f"seed ids must lie in [0, {num_nodes}), got ids in [{lo}, {hi}]")
    if not isinstance(fanout, int) or fanout < -1:
        raise ValueError(f"fanout must be an int >= 0, or -1 for all neighbors, got {fanout!r}")
    return seeds


def _checked(seeds: torch.Tensor, fanout: int, num_nodes: int, first_store: Store) -> torch.Tensor:
    """:func:`_check`, telling the peers when it fails (they are about to gather from ``first_store``)."""
    try:
        return _check(seeds, fanout, num_nodes)
    except Exception as e:
        _refuse(first_store, e)
        raise


def _generator(seed: int | None) -> torch.Generator | None:
    return None if seed is None else torch.Generator().manual_seed(int(seed))


def sample_neighbors(seeds: torch.Tensor, indptr: Store, indices: Store, fanout: int, replace: bool = False,
                     probs: Store | None = None, seed: int | None = None,
                     generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample up to ``fanout`` in-neighbors of each seed; return edges ``(row, col)`` = (neighbor, seed).

    ``fanout=-1`` takes every neighbor.  Without replacement a seed gives ``min(fanout, deg)``
    edges (only positive-weight edges when weighted); with replacement exactly ``fanout`` (none
    if it has no neighbor).  ``seed`` (or ``generator``) makes the result deterministic.
    """
    seeds = _checked(seeds, fanout, len(indptr) - 1, indptr)
    nbr, seg, _ = _sample(seeds, indptr, indices, fanout, replace, probs, generator or _generator(seed))
    return nbr, seeds[seg]


@dataclass
class Block:
    """One layer of a minibatch: edges from ``num_src`` source nodes to the first ``num_dst`` of them.

    ``edge_index`` is PyG style ``[src; dst]`` in local ids (destination nodes are the prefix
    of the source nodes, so ``x[:num_dst]`` are the targets' own features); ``e_id`` are the
    edges' positions in ``indices``.  Edges are grouped by destination.
    """

    edge_index: torch.Tensor
    e_id: torch.Tensor
    num_src: int
    num_dst: int

    @property
    def row(self) -> torch.Tensor:
        return self.edge_index[0]

    @property
    def col(self) -> torch.Tensor:
        return self.edge_index[1]

    @property
    def size(self) -> tuple[int, int]:
        return self.num_src, self.num_dst

    def csc(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The block as CSC tensors ``(indptr over num_dst, source indices)``."""
        counts = torch.bincount(self.col, minlength=self.num_dst)
        return torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(counts, 0)]), self.row


@dataclass
class MiniBatch:
    """Sampled computation graph: ``n_id`` are the global ids of every node (seeds first).

    ``blocks[0]`` is the input layer (its sources are all of ``n_id``); ``blocks[-1]`` ends at
    the ``batch_size`` seeds.
    """

    n_id: torch.Tensor
    batch_size: int
    blocks: list[Block]


def _relabel(nodes: torch.Tensor, nbr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Append unseen ``nbr`` to ``nodes`` in first-appearance order; return (new nodes, local ids of nbr)."""
    cat = torch.cat([nodes, nbr])
    uniq, inv = torch.unique(cat, return_inverse=True)
    first = torch.full((len(uniq),), len(cat), dtype=torch.int64).scatter_reduce_(
        0, inv, torch.arange(len(cat)), reduce="amin")
    order = torch.argsort(first)
    local = torch.empty_like(order)
    local[order] = torch.arange(len(order))
    return uniq[order], local[inv[len(nodes):]]


class NeighborSampler:
    """Multi-layer neighbor sampler: ``sampler(seeds)`` returns a :class:`MiniBatch` for GraphSAGE.

    ``fanouts`` lists neighbors per layer from the seeds outwards (e.g. ``[15, 10, 5]``); each hop
    samples in-neighbors of every node reached so far.  A fixed ``seed`` gives the same sequence
    of minibatches on every run.
    """

    def __init__(self, indptr: Store, indices: Store, fanouts: Sequence[int], replace: bool = False,
                 probs: Store | None = None, seed: int | None = None):
        if not fanouts:
            raise ValueError("fanouts must list at least one layer")
        for f in fanouts:
            _check(torch.empty(0, dtype=torch.int64), f, 1)
        if probs is not None and len(probs) != len(indices):
            raise ValueError(f"probs has {len(probs)} entries but the graph has {len(indices)} edges")
        self.indptr, self.indices, self.probs = indptr, indices, probs
        self.fanouts, self.replace = list(fanouts), replace
        self.num_nodes = len(indptr) - 1
        self.generator = _generator(seed)

    def sample(self, seeds: torch.Tensor) -> MiniBatch:
        """Sample the blocks of ``seeds`` (duplicates are dropped, first occurrence kept)."""
        seeds = _checked(seeds, self.fanouts[0], self.num_nodes, self.indptr).to(torch.int64)
        nodes, _ = _relabel(torch.empty(0, dtype=torch.int64), seeds)
        batch_size = len(nodes)
        blocks = []
        for k in self.fanouts:
            nbr, dst, eids = _sample(nodes, self.indptr, self.indices, k, self.replace, self.probs,
                                     self.generator)
            new_nodes, src = _relabel(nodes, nbr)
            blocks.append(Block(torch.stack([src, dst]), eids, len(new_nodes), len(nodes)))
            nodes = new_nodes
        return MiniBatch(nodes, batch_size, blocks[::-1])

    __call__ = sample
