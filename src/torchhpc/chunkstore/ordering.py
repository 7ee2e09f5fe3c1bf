"""Hot-row orders: which rows to place in the fastest tiers."""

from __future__ import annotations

import torch

__all__ = ["hot_order_by_degree", "hot_order_from_scores"]


def hot_order_from_scores(scores: torch.Tensor) -> torch.Tensor:
    """Row ids sorted by descending score (ties by id), e.g. access counts from a profiling epoch."""
    if scores.dim() != 1:
        raise ValueError(f"scores must be 1-D (one per row), got shape {tuple(scores.shape)}")
    return torch.sort(scores, descending=True, stable=True).indices


def hot_order_by_degree(indptr: torch.Tensor) -> torch.Tensor:
    """Node ids by descending degree from a CSR/CSC ``indptr``: high-degree nodes are sampled most."""
    indptr = torch.as_tensor(indptr)
    if indptr.dim() != 1 or indptr.numel() < 1:
        raise ValueError("indptr must be a 1-D tensor of length num_nodes + 1")
    return hot_order_from_scores(indptr[1:] - indptr[:-1])
