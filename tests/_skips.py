"""Which skips CI accepts.  CI installs everything the suite waits for (root, the Debian packages of
.ci/debian-packages, `make env NATIVE=1`, the recorder's header, ../shared/vendor, the NCCL stand-in wheels), so
with ``TORCHHPC_TEST_STRICT=1`` (set by .ci/run) a skip is a failure unless its reason is one CI cannot meet: no
GPU, the kernel's huge-page mode, fewer than 2 CPUs, or a test written for another rank count or node layout
than the run at hand (its other runs execute it).  Without the switch a skip stays a skip, with its reason."""

from __future__ import annotations

import os
import re

import pytest

STRICT = os.environ.get("TORCHHPC_TEST_STRICT") == "1"
# the reasons the suite's GPU tests give ("no CUDA device", "needs a CUDA GPU", "a GPU is present", ...): the
# device itself, never a missing package that mentions CUDA (the NCCL stand-in wheels are CI's to install)
ACCEPTED = re.compile(r"no CUDA device|CUDA GPU|GPU is present|accelerator is present|kernel THP mode|"
                      r"needs 2 CPUs|^not at this (rank count|layout)")


def accepted(reason: str) -> bool:
    """Whether a skip with ``reason`` is one CI cannot avoid."""
    return bool(ACCEPTED.search(reason.removeprefix("Skipped: ")))


def reason_of(report: pytest.TestReport) -> str:
    """The reason a skipped report gives (pytest keeps it as (path, line, "Skipped: reason"))."""
    longrepr = report.longrepr
    return longrepr[2].removeprefix("Skipped: ") if isinstance(longrepr, tuple) else str(longrepr)


def make_strict(report: pytest.TestReport) -> None:
    """Under the switch, turn ``report``'s skip into a failure unless CI cannot avoid it (both conftests call it)."""
    if STRICT and report.skipped and not hasattr(report, "wasxfail"):
        reason = reason_of(report)
        if not accepted(reason):
            report.outcome = "failed"
            report.longrepr = (f"skipped where CI provides what it needs (TORCHHPC_TEST_STRICT=1): {reason}")
