"""Neighbor sampling: only true neighbors, fan-outs and replacement respected, weighted distributions."""

import pytest
import torch

from torchhpc.chunkstore import ChunkTensor, NeighborSampler, sample_neighbors


def _graph(n=300, max_deg=30, seed=0):
    g = torch.Generator().manual_seed(seed)
    deg = torch.randint(0, max_deg, (n,), generator=g)
    indptr = torch.cat([torch.zeros(1, dtype=torch.int64), deg.cumsum(0)])
    indices = torch.randint(0, n, (int(indptr[-1]),), generator=g)
    return indptr, indices


def _edges(indptr, indices):
    col = torch.repeat_interleave(torch.arange(len(indptr) - 1), indptr[1:] - indptr[:-1])
    return col, indices


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("replace", [False, True])
def test_samples_are_true_edges_and_respect_fanout(replace, weighted):
    indptr, indices = _graph()
    probs = torch.rand(len(indices), generator=torch.Generator().manual_seed(1)) if weighted else None
    deg = indptr[1:] - indptr[:-1]
    seeds = torch.arange(300)
    k = 7
    row, col = sample_neighbors(seeds, indptr, indices, k, replace=replace, probs=probs, seed=3)
    # every (neighbor, seed) pair is an edge of the graph, with multiplicity when without replacement
    dst, src = _edges(indptr, indices)
    key = src * 1000 + dst
    got = row * 1000 + col
    assert torch.isin(got, key).all()
    counts = torch.bincount(col, minlength=300)
    if replace:
        assert torch.equal(counts, torch.where(deg > 0, k, 0))
    else:
        assert torch.equal(counts, torch.minimum(deg, torch.tensor(k)))
        # without replacement no edge repeats: edge multiplicities in the sample never exceed the graph's
        edge_mult = torch.bincount(key, minlength=300 * 1000)
        assert (torch.bincount(got, minlength=300 * 1000) <= edge_mult).all()
    # ordered by seed, deterministic with a seed, different with another seed
    assert torch.equal(col, torch.sort(col, stable=True).values)
    again = sample_neighbors(seeds, indptr, indices, k, replace=replace, probs=probs, seed=3)
    assert torch.equal(again[0], row) and torch.equal(again[1], col)
    other = sample_neighbors(seeds, indptr, indices, k, replace=replace, probs=probs, seed=4)
    assert not torch.equal(other[0], row)


def test_int32_seeds_all_neighbors_and_empty_input():
    indptr, indices = _graph()
    seeds = torch.tensor([5, 9, 5], dtype=torch.int32)
    row, col = sample_neighbors(seeds, indptr, indices, -1)
    want = torch.cat([indices[indptr[s]:indptr[s + 1]] for s in seeds.tolist()])
    assert torch.equal(row, want)
    row, col = sample_neighbors(torch.empty(0, dtype=torch.int64), indptr, indices, 5)
    assert row.numel() == 0 and col.numel() == 0


def _star(weights):
    """Node 0 with one in-edge from each of nodes 1..len(weights)."""
    d = len(weights)
    return torch.tensor([0, d] + [d] * d), torch.arange(1, d + 1), torch.tensor(weights, dtype=torch.float64)


def _chi2(observed, expected):
    return float(((observed - expected) ** 2 / expected).sum())


def test_weighted_with_replacement_matches_distribution():
    w = [1.0, 2.0, 3.0, 4.0, 0.0, 10.0]
    indptr, indices, probs = _star(w)
    row, _ = sample_neighbors(torch.zeros(20000, dtype=torch.int64), indptr, indices, 1, replace=True,
                              probs=probs, seed=0)
    obs = torch.bincount(row - 1, minlength=6).double()
    assert obs[4] == 0  # zero-weight edges are never drawn
    p = torch.tensor(w) / sum(w)
    keep = p > 0
    # chi-square with 4 degrees of freedom: 18.5 is its 0.999 quantile
    assert _chi2(obs[keep], 20000 * p[keep]) < 18.5


def test_weighted_without_replacement_inclusion_probabilities():
    w = [1.0, 2.0, 3.0, 4.0]
    indptr, indices, probs = _star(w)
    n = 4000
    row, col = sample_neighbors(torch.zeros(n, dtype=torch.int64), indptr, indices, 2, probs=probs, seed=1)
    assert len(row) == 2 * n
    pairs = row.view(n, 2)
    assert (pairs[:, 0] != pairs[:, 1]).all()
    # successive sampling proportional to weight: P(i in S) = p_i + sum_{j != i} p_j p_i / (1 - p_j)
    p = torch.tensor(w) / sum(w)
    incl = torch.tensor([p[i] + sum(p[j] * p[i] / (1 - p[j]) for j in range(4) if j != i) for i in range(4)])
    obs = torch.bincount(row - 1, minlength=4).double()
    assert _chi2(obs, n * incl) < 16.3  # 3 dof, 0.999 quantile
    # and not uniform: the heaviest edge is included clearly more often than the lightest
    assert obs[3] > 2 * obs[0]


def test_uniform_without_replacement_is_uniform():
    indptr, indices, _ = _star([1.0] * 10)
    n = 3000
    row, _ = sample_neighbors(torch.zeros(n, dtype=torch.int64), indptr, indices, 3, seed=2)
    pairs = row.view(n, 3)
    assert (pairs.sort(1).values.diff(dim=1) > 0).all()  # distinct within each draw
    obs = torch.bincount(row - 1, minlength=10).double()
    assert _chi2(obs, torch.full((10,), 3 * n / 10)) < 27.9  # 9 dof, 0.999 quantile


def test_bad_inputs():
    indptr, indices = _graph()
    with pytest.raises(IndexError, match="seed ids"):
        sample_neighbors(torch.tensor([300]), indptr, indices, 3)
    with pytest.raises(TypeError, match="int32 or int64"):
        sample_neighbors(torch.tensor([1.0]), indptr, indices, 3)
    with pytest.raises(ValueError, match="fanout"):
        sample_neighbors(torch.tensor([1]), indptr, indices, -2)
    with pytest.raises(ValueError, match="finite and >= 0"):
        sample_neighbors(torch.tensor([1]), indptr, indices, 3, probs=-torch.ones(len(indices)))
    with pytest.raises(ValueError, match="fanouts"):
        NeighborSampler(indptr, indices, [])


@pytest.mark.parametrize("replace", [False, True])
def test_neighbor_sampler_blocks(replace):
    indptr, indices = _graph(n=500, max_deg=25, seed=3)
    sampler = NeighborSampler(indptr, indices, [15, 10, 5], replace=replace, seed=7)
    seeds = torch.tensor([3, 17, 3, 400, 250])
    mb = sampler(seeds)
    assert mb.batch_size == 4 and torch.equal(mb.n_id[:4], torch.tensor([3, 17, 400, 250]))
    assert len(mb.blocks) == 3
    assert mb.blocks[0].num_src == len(mb.n_id) and mb.blocks[-1].num_dst == 4
    assert len(torch.unique(mb.n_id)) == len(mb.n_id)
    for inner, outer in zip(mb.blocks[1:], mb.blocks[:-1], strict=True):
        assert outer.num_dst == inner.num_src  # each layer's targets are the next layer's sources
    dst_all, src_all = _edges(indptr, indices)
    key = src_all * 1000 + dst_all
    deg = indptr[1:] - indptr[:-1]
    for b, k in zip(mb.blocks[::-1], [15, 10, 5], strict=True):
        src_g, dst_g = mb.n_id[b.row], mb.n_id[b.col]
        assert b.row.max() < b.num_src and b.col.max() < b.num_dst
        assert torch.isin(src_g * 1000 + dst_g, key).all()
        assert torch.equal(indices[b.e_id], src_g)  # e_id points at the sampled edges
        counts = torch.bincount(b.col, minlength=b.num_dst)
        d = deg[mb.n_id[: b.num_dst]]
        assert torch.equal(counts, torch.where(d > 0, k, 0) if replace else torch.minimum(d, torch.tensor(k)))
        ptr, ind = b.csc()
        assert ptr[-1] == b.edge_index.shape[1] and torch.equal(ind, b.row)
    # deterministic: a new sampler with the same seed gives the same minibatches
    again = NeighborSampler(indptr, indices, [15, 10, 5], replace=replace, seed=7)(seeds)
    assert torch.equal(again.n_id, mb.n_id)
    assert all(torch.equal(a.edge_index, b.edge_index) for a, b in zip(again.blocks, mb.blocks, strict=True))


def test_sampling_on_chunk_tensors_equals_plain_tensors():
    indptr, indices = _graph(n=400, max_deg=20, seed=5)
    probs = torch.rand(len(indices), generator=torch.Generator().manual_seed(2))
    with ChunkTensor(len(indptr), torch.int64, 50 * 8) as cp, \
            ChunkTensor(len(indices), torch.int32, 500 * 4) as ci, \
            ChunkTensor(len(probs), torch.float32, 0) as cw:
        cp.load_from_tensor(indptr)
        ci.load_from_tensor(indices.int())
        cw.load_from_tensor(probs)
        for pr_plain, pr_chunk in ((None, None), (probs, cw)):
            a = NeighborSampler(indptr, indices, [6, 4], probs=pr_plain, seed=11)(torch.arange(0, 400, 7))
            b = NeighborSampler(cp, ci, [6, 4], probs=pr_chunk, seed=11)(torch.arange(0, 400, 7))
            assert torch.equal(a.n_id, b.n_id)
            for x, y in zip(a.blocks, b.blocks, strict=True):
                assert torch.equal(x.edge_index, y.edge_index)
