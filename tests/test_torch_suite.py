"""A CI-sized subset of PyTorch's own distributed test suite (``DistributedTest._DistTestBase``) on accl and gloo.

The full suite is ``make test-torch-suite`` (tests/torch_suite/driver.py; counts in docs/accl.md).  This subset,
run the same way at 3 ranks under plain mpiexec, covers each area the suite tests on CPU: every test here passes
on gloo and must pass on accl too; those torch marks gloo-only or MPI-only run on accl with the skip markers ignored.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "torch_suite"))
import driver  # noqa: E402

pytestmark = pytest.mark.full("PyTorch's own distributed suite at 3 ranks")

SUBSET = [
    # collectives: ops, async, complex, groups, point-to-point, objects, group teardown
    "test_all_reduce_sum", "test_all_reduce_max", "test_all_reduce_sum_async", "test_all_reduce_sum_complex",
    "test_broadcast", "test_reduce_sum", "test_all_gather", "test_all_gather_coalesced_simple", "test_gather",
    "test_scatter", "test_barrier", "test_all_reduce_full_group_product", "test_send_recv_any_source",
    "test_send_recv_with_tag", "test_isend", "test_irecv", "test_destroy_group",
    # DDP on CPU
    "test_DistributedDataParallelCPU", "test_ddp_logging_data_cpu", "test_static_graph_api_cpu",
]
# torch marks these gloo-only (skip markers naming the backend); accl runs them with the markers ignored
GLOO_MARKED = [
    "test_all_reduce_coalesced_sum", "test_batch_isend_irecv_gloo_tags", "test_all_gather_object_subgroup",
    "test_scatter_object_list", "test_get_future", "test_grads_same_across_ranks_with_no_sync",
    "test_monitored_barrier_gloo_rank_0_timeout", "test_sparse_all_reduce_sum",
]
# torch marks these MPI-backend-only; gloo skips them, accl (an MPI backend) runs them with the markers ignored
MPI_MARKED = ["test_all_to_all_single_unequal_split", "test_all_to_all"]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict[str, dict]]:
    out = tmp_path_factory.mktemp("torch-suite")

    def run(backend: str, names: list[str], **kw) -> dict[str, dict]:
        records = driver.run_backend(backend, names, out, np=3, per_test_timeout=120, log=lambda m: None, **kw)
        return {r["test"]: r for r in records}

    return {"gloo": run("gloo", SUBSET + GLOO_MARKED), "accl": run("accl", SUBSET),
            "accl, markers ignored": run("accl", GLOO_MARKED + MPI_MARKED, ignore_skip_markers=True, tag="-forced")}


@pytest.mark.parametrize("run", ["gloo", "accl", "accl, markers ignored"])
def test_subset_passes(results, run: str) -> None:
    want = {"gloo": SUBSET + GLOO_MARKED, "accl": SUBSET}.get(run, GLOO_MARKED + MPI_MARKED)
    assert sorted(results[run]) == sorted(want)
    bad = {t: (r["outcome"], r["detail"][-1500:]) for t, r in results[run].items() if r["outcome"] != "pass"}
    assert not bad, f"{run}: tests of torch's suite that did not pass: {bad}"
