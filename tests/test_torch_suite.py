"""A CI-sized subset of PyTorch's own distributed test suite (``DistributedTest._DistTestBase``) on accl and gloo.

The full suite is ``make test-torch-suite`` (tests/torch_suite/driver.py; counts in docs/accl.md).  This subset,
run the same way at 3 ranks under plain mpiexec, covers each area the suite tests on CPU: every test here passes
on gloo, and must pass on accl too.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "torch_suite"))
import driver  # noqa: E402

SUBSET = [
    # collectives: ops, async, complex, coalesced, groups, point-to-point, objects, futures, group teardown
    "test_all_reduce_sum", "test_all_reduce_max", "test_all_reduce_sum_async", "test_all_reduce_sum_complex",
    "test_all_reduce_coalesced_sum", "test_broadcast", "test_reduce_sum", "test_all_gather",
    "test_all_gather_coalesced_simple", "test_gather", "test_scatter", "test_all_to_all_single_unequal_split",
    "test_barrier_timeout_global", "test_send_recv_any_source", "test_send_recv_with_tag", "test_isend",
    "test_irecv", "test_batch_isend_irecv_gloo_tags", "test_all_gather_object_subgroup", "test_scatter_object_list",
    "test_get_future", "test_destroy_group",
    # DDP on CPU
    "test_DistributedDataParallelCPU", "test_ddp_logging_data_cpu", "test_static_graph_api_cpu",
    "test_grads_same_across_ranks_with_no_sync",
]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict[str, dict]]:
    out = tmp_path_factory.mktemp("torch-suite")
    return {b: {r["test"]: r
                for r in driver.run_backend(b, SUBSET, out, np=3, per_test_timeout=120, log=lambda m: None)}
            for b in ("gloo", "accl")}


@pytest.mark.parametrize("backend", ["gloo", "accl"])
def test_subset_passes(results, backend: str) -> None:
    bad = {t: (r["outcome"], r["detail"][-1500:]) for t, r in results[backend].items() if r["outcome"] != "pass"}
    assert len(results[backend]) == len(SUBSET)
    assert not bad, f"{backend}: tests of torch's suite that did not pass: {bad}"
