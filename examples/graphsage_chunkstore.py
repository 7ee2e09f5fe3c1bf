"""GraphSAGE node classification with features and graph in ChunkTensors shared by the ranks of a node.

The graph is generated: a degree-corrected stochastic block model (power-law node weights,
most edges inside a node's community), labels are the communities and the features are a weak,
noisy hint of them, so accuracy well above the features-only level means the model uses the
graph.  Training is data-parallel (DDP over gloo); every rank samples its own minibatches with
:class:`~torchhpc.chunkstore.NeighborSampler` and gathers feature rows from the shared tiers.

    mpiexec -n 2 python examples/graphsage_chunkstore.py                 # 1M nodes, ~20M edges
    mpiexec -n 2 python examples/graphsage_chunkstore.py --nodes 20000   # small and quick
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from torchhpc.chunkstore import Block, ChunkTensor, NeighborSampler, hot_order_by_degree
from torchhpc.launcher import init_distributed


def generate_graph(n: int, avg_degree: int, classes: int, dim: int, seed: int):
    """Power-law community graph in CSC form, community labels, features weakly tied to the labels."""
    g = torch.Generator().manual_seed(seed)
    label = torch.randint(0, classes, (n,), generator=g)
    theta = (1.0 - torch.rand(n, generator=g, dtype=torch.float64)) ** (-1 / 1.5)  # Pareto(1.5) weights
    e = n * avg_degree
    dst = torch.multinomial(theta.float(), e, replacement=True, generator=g)
    # sources: 80% from the destination's community, else anywhere, both proportional to theta
    by_comm = torch.argsort(label, stable=True)
    cum = torch.cumsum(theta[by_comm], 0)
    comm_end = torch.cumsum(torch.bincount(label, minlength=classes), 0)
    comm_hi = cum[comm_end - 1]
    comm_lo = torch.cat([torch.zeros(1, dtype=torch.float64), comm_hi[:-1]])
    inside = torch.rand(e, generator=g) < 0.8
    c = label[dst]
    lo = torch.where(inside, comm_lo[c], torch.zeros((), dtype=torch.float64))
    hi = torch.where(inside, comm_hi[c], cum[-1])
    u = lo + torch.rand(e, generator=g, dtype=torch.float64) * (hi - lo)
    src = by_comm[torch.searchsorted(cum, u).clamp_max(n - 1)]
    order = torch.argsort(dst)
    src, dst = src[order], dst[order]
    indptr = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(torch.bincount(dst, minlength=n), 0)])
    centroids = torch.randn(classes, dim, generator=g) * 0.12
    x = centroids[label] + torch.randn(n, dim, generator=g)
    return indptr, src, x, label


class SAGEConv(nn.Module):
    """GraphSAGE layer with mean aggregation: W_self x_dst + W_nbr mean(x_src over in-edges)."""

    def __init__(self, dim_in: int, dim_out: int):
        super().__init__()
        self.lin_self = nn.Linear(dim_in, dim_out)
        self.lin_nbr = nn.Linear(dim_in, dim_out, bias=False)

    def forward(self, x: torch.Tensor, block: Block) -> torch.Tensor:
        src, dst = block.edge_index
        agg = torch.zeros(block.num_dst, x.shape[1], dtype=x.dtype).index_add_(0, dst, x[src])
        cnt = torch.bincount(dst, minlength=block.num_dst).clamp_min(1).unsqueeze(1)
        return self.lin_self(x[: block.num_dst]) + self.lin_nbr(agg / cnt)


class GraphSAGE(nn.Module):
    def __init__(self, dim_in: int, hidden: int, classes: int, layers: int):
        super().__init__()
        dims = [dim_in] + [hidden] * (layers - 1) + [classes]
        self.convs = nn.ModuleList(SAGEConv(a, b) for a, b in zip(dims[:-1], dims[1:], strict=True))

    def forward(self, x: torch.Tensor, blocks: list[Block]) -> torch.Tensor:
        for i, (conv, block) in enumerate(zip(self.convs, blocks, strict=True)):
            x = conv(x, block)
            if i < len(self.convs) - 1:
                x = F.relu(x)
        return x


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=1_000_000)
    p.add_argument("--avg-degree", type=int, default=20)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--classes", type=int, default=8)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--fanouts", default="15,10,5")
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batches-per-epoch", type=int, default=30, help="cap per rank (0: a full pass)")
    p.add_argument("--eval-nodes", type=int, default=4000)
    p.add_argument("--device-fraction", type=float, default=0.25,
                   help="share of the feature rows held in the ranks' device tiers (hottest first)")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    fanouts = [int(f) for f in args.fanouts.split(",")]

    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size
    own_group = not dist.is_initialized()
    if own_group:
        init_distributed(backend="gloo", timeout=300)
    t0 = time.perf_counter()
    graph = None
    if rank == 0:  # one rank builds the graph; the others receive their rows through the shared tiers
        graph = generate_graph(args.nodes, args.avg_degree, args.classes, args.dim, args.seed)
    indptr, indices, x, label = graph if graph is not None else (None,) * 4
    hot = hot_order_by_degree(indptr) if rank == 0 else None
    n, e = comm.bcast((args.nodes, len(indices)) if rank == 0 else None, root=0)
    local = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED).size
    cap = int(args.device_fraction * n * args.dim * 4 / local)
    feats = ChunkTensor((n, args.dim), torch.float32, cap, hot_order=hot)
    c_indptr = ChunkTensor(n + 1, torch.int64, 0)
    c_indices = ChunkTensor(e, torch.int64, 0)
    c_label = ChunkTensor(n, torch.int64, 0)
    for ct, t in ((feats, x), (c_indptr, indptr), (c_indices, indices), (c_label, label)):
        ct.load_from_tensor(t, src=0)
    del graph, indptr, indices, x, label
    report = feats.memory_report()  # collective
    if rank == 0:
        print(f"graph: {n} nodes, {e} edges, {args.dim}-dim features, built and loaded in "
              f"{time.perf_counter() - t0:.1f}s on {size} rank(s)\nfeature tiers (bytes):\n{report}",
              flush=True)

    perm = torch.randperm(n, generator=torch.Generator().manual_seed(args.seed + 1))
    test_ids, train_ids = perm[: args.eval_nodes], perm[args.eval_nodes:]
    model = DistributedDataParallel(GraphSAGE(args.dim, args.hidden, args.classes, len(fanouts)))
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    sampler = NeighborSampler(c_indptr, c_indices, fanouts, seed=args.seed * 1000 + rank)
    per_rank = len(train_ids) // size
    batches = per_rank // args.batch_size
    if args.batches_per_epoch:
        batches = min(batches, args.batches_per_epoch)
    history = []
    for epoch in range(args.epochs):
        order = train_ids[torch.randperm(len(train_ids), generator=torch.Generator().manual_seed(epoch))]
        mine = order[rank * per_rank:(rank + 1) * per_rank]
        t_start, edges, rows, loss_sum = time.perf_counter(), 0, 0, 0.0
        t_sample = t_gather = 0.0
        model.train()
        for b in range(batches):
            seeds = mine[b * args.batch_size:(b + 1) * args.batch_size]
            t1 = time.perf_counter()
            mb = sampler(seeds)
            t2 = time.perf_counter()
            xb = feats[mb.n_id]
            y = c_label[mb.n_id[: mb.batch_size]]
            t3 = time.perf_counter()
            t_sample, t_gather = t_sample + t2 - t1, t_gather + t3 - t2
            loss = F.cross_entropy(model(xb, mb.blocks), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            edges += sum(blk.edge_index.shape[1] for blk in mb.blocks)
            rows += len(mb.n_id)
            loss_sum += float(loss.detach())
        elapsed = time.perf_counter() - t_start
        # evaluation: every rank takes a share of the held-out nodes
        model.eval()
        correct = torch.zeros(2, dtype=torch.int64)
        per_eval = len(test_ids) // size  # equal shares: every batch's gathers are collective across nodes
        share = test_ids[rank * per_eval:(rank + 1) * per_eval]
        with torch.no_grad():
            for s in range(0, len(share), args.batch_size):
                mb = sampler(share[s:s + args.batch_size])
                pred = model.module(feats[mb.n_id], mb.blocks).argmax(1)
                hits = int((pred == c_label[mb.n_id[: mb.batch_size]]).sum())
                correct += torch.tensor([hits, mb.batch_size])
        stats = torch.tensor([edges, rows, batches * args.batch_size], dtype=torch.float64)
        dist.all_reduce(correct)
        dist.all_reduce(stats)
        acc = float(correct[0]) / max(1, int(correct[1]))
        rec = {"epoch": epoch, "loss": loss_sum / max(1, batches), "test_acc": acc,
               "seeds_per_s": float(stats[2]) / elapsed, "sampled_edges_per_s": float(stats[0]) / elapsed,
               "gather_GBps": float(stats[1]) * args.dim * 4 / max(t_gather, 1e-9) / 1e9 / size}
        history.append(rec)
        if rank == 0:
            print(f"epoch {epoch}: loss {rec['loss']:.3f}  test acc {acc:.3f}  "
                  f"{rec['seeds_per_s']:.0f} seeds/s  {rec['sampled_edges_per_s']:.3g} sampled edges/s  "
                  f"(per rank: sampling {t_sample:.1f}s, feature gathers {t_gather:.1f}s of {elapsed:.1f}s)",
                  flush=True)
    # features-only reference: the same held-out nodes classified by nearest class mean of raw features (the
    # gathers are collective when the tensors span nodes: every rank joins them, rank 0 reports)
    xs, ys = feats[train_ids[:20000]], c_label[train_ids[:20000]]
    xt, yt = feats[test_ids], c_label[test_ids]
    if rank == 0:
        means = torch.stack([xs[ys == c].mean(0) for c in range(args.classes)])
        ref = float((torch.cdist(xt, means).argmin(1) == yt).float().mean())
        print(f"features-only nearest-class-mean accuracy: {ref:.3f} (GraphSAGE uses the graph to beat it)")
        history.append({"features_only_acc": ref})
    for ct in (feats, c_indptr, c_indices, c_label):
        ct.close()
    del model, opt  # DDP holds the group: freed first, destroying it joins gloo's workers before exit
    if own_group:
        dist.destroy_process_group()
    return {"history": history}


if __name__ == "__main__":
    main()
