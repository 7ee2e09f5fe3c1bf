"""``torchhpc doctor``: one screen that says whether this environment is fit for distributed training.

Every line is OK / WARN / FAIL and, when not OK, says what to do.  ``--json`` prints the same as JSON;
the exit status is 1 when something FAILed (``--strict``: also when something WARNed), else 0.  Run it
under ``mpiexec -n 2`` on GPU nodes to also prove CUDA-aware MPI with a real device-buffer transfer.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

__all__ = ["Check", "run_checks", "main"]

OK, WARN, FAIL = "OK", "WARN", "FAIL"
RUNTIME_PREFIXES = ("NCCL_", "FI_", "MPICH_", "OMPI_MCA_", "UCX_", "CUDA_VISIBLE_DEVICES", "TORCHHPC_")
AWS_OFI_LIBS = ("libnccl-net.so", "libnccl-net-ofi.so", "libnccl-net-aws-ofi.so")


@dataclass
class Check:
    """One line of the report."""

    name: str
    status: str
    value: str
    hint: str = ""


def _python() -> Check:
    return Check("python", OK, f"{platform.python_version()} ({sys.executable})")


def _torch() -> Check:
    try:
        import torch
    except ImportError as exc:
        return Check("torch", FAIL, f"not importable ({exc})", "run `make env`, or activate the built environment")
    cuda = torch.version.cuda or "none (CPU build)"
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return Check("torch", OK, f"{torch.__version__}, CUDA {cuda}" + (f", cuDNN {cudnn}" if cudnn else ""))


def _gpus() -> Check:
    import torch

    if not torch.cuda.is_available():
        hint = ("this torch is a CPU build; install a CUDA build (`make build-pytorch-*` on a cluster)"
                if torch.version.cuda is None else "no GPU visible: check CUDA_VISIBLE_DEVICES and the node type")
        return Check("gpus", WARN, "none", hint)
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return Check("gpus", OK, f"{len(names)}: " + ", ".join(sorted(set(names))))


def _find_libs(names: Sequence[str]) -> list[str]:
    dirs = [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d]
    dirs += ["/usr/lib64", "/usr/lib", "/usr/local/lib", "/usr/lib/x86_64-linux-gnu"]
    found = []
    for d in dirs:
        for name in names:
            found += glob.glob(os.path.join(d, name))
    plugin = os.environ.get("NCCL_NET_PLUGIN")
    if plugin and os.path.isabs(plugin) and os.path.exists(plugin):
        found.insert(0, plugin)
    return list(dict.fromkeys(found))


def _on_slingshot() -> bool:
    return os.path.isdir("/sys/class/cxi") or bool(glob.glob("/dev/cxi*"))


def _nccl() -> list[Check]:
    import torch
    import torch.distributed as dist

    if not (torch.cuda.is_available() and dist.is_nccl_available()):
        return [Check("nccl", WARN, "not available (no CUDA)", "GPU training needs a CUDA build of torch with NCCL")]
    version = ".".join(str(v) for v in torch.cuda.nccl.version())
    checks = [Check("nccl", OK, version)]
    net = os.environ.get("NCCL_NET", "")
    plugins = _find_libs(AWS_OFI_LIBS)
    value = f"NCCL_NET={net or '(unset)'}; plugin: {plugins[0] if plugins else 'not found'}"
    if net.lower().replace(" ", "") in ("awslibfabric", "ofi") and not plugins:
        checks.append(Check("nccl net", FAIL, value, "NCCL_NET asks for the AWS OFI plugin but no libnccl-net*.so "
                            "is on LD_LIBRARY_PATH: run `make nccl-ofi` and source config_env.sh"))
    elif _on_slingshot() and not plugins:
        checks.append(Check("nccl net", WARN, value, "Slingshot NICs found but no aws-ofi-nccl plugin: NCCL falls "
                            "back to TCP sockets and runs far slower; run `make nccl-ofi`"))
    else:
        checks.append(Check("nccl net", OK, value))
    return checks


def _nccl_net_plugin() -> Check:
    """Which NCCL net plugin NCCL would load here and whether it fits this NCCL (torchhpc.runtime.nccl_plugin)."""
    from torchhpc.runtime import nccl_plugin

    status, value, hint = nccl_plugin.diagnose()
    return Check("nccl plugin", {"ok": OK, "warn": WARN, "fail": FAIL}[status], value, hint)


def _mpi(probe: bool) -> list[Check]:
    try:
        from mpi4py import MPI
    except ImportError as exc:
        return [Check("mpi", FAIL, f"mpi4py not importable ({exc})", "run `make env` (or MPI=system MPICC=...)")]
    from torchhpc.runtime import mpi_info

    library = mpi_info.library_version().split(", package:")[0]
    checks = [Check("mpi", OK, f"{library} (mpi4py {sys.modules['mpi4py'].__version__})")]
    level = mpi_info.thread_level()
    checks.append(Check("mpi threads", OK if level == "multiple" else WARN, level,
                        "" if level == "multiple" else "accl's asynchronous ops and rehearsal's background worker "
                        "need MPI_THREAD_MULTIPLE; use an MPI built with thread support"))
    checks.append(_fault_tolerance())
    import torch

    query = mpi_info.cuda_aware_query()
    if not torch.cuda.is_available():
        checks.append(Check("cuda-aware mpi", OK, f"not needed (no GPU); query: {query.supported} via {query.source}"))
        return checks
    text = f"query says {query.supported} via {query.source}"
    if probe and MPI.COMM_WORLD.Get_size() >= 2:
        result = mpi_info.cuda_aware_probe()
        text += f"; probe: {'passed' if result.supported else 'FAILED'} ({result.source})"
        aware = result.supported
    else:
        text += "; not probed (run under `mpiexec -n 2 torchhpc doctor` to test a real device transfer)"
        aware = query.supported
    if aware:
        checks.append(Check("cuda-aware mpi", OK, text + "; PyTorch's MPI backend passes CUDA tensors to MPI "
                            "directly (accl stages them through pinned host memory either way)"))
    else:
        checks.append(Check("cuda-aware mpi", WARN, text + "; PyTorch's MPI backend refuses CUDA tensors (accl "
                            "stages them through pinned host memory either way)",
                            "for GPU-direct MPI use a CUDA-aware MPI (Cray: MPICH_GPU_SUPPORT_ENABLED=1)"))
    return checks


def _fault_tolerance() -> Check:
    from torchhpc.runtime import mpi_info
    from torchhpc.runtime.mpirun import fault_tolerant_args, mpi_flavor

    capable, enabled = mpi_info.fault_tolerance()
    if enabled:
        return Check("fault tolerance", OK, "ULFM on: survivors of a dead rank raise PeerFailedError")
    if not capable:
        return Check("fault tolerance", OK, "no ULFM in this MPI: a dead rank ends the job")
    flavor = mpi_flavor()
    how = " ".join(fault_tolerant_args(flavor)) if flavor in ("openmpi", "mpich") else "your MPI's ULFM option"
    return Check("fault tolerance", OK, "ULFM available, off for this job: a dead rank ends the job",
                 f"to let survivors raise PeerFailedError instead: mpiexec {how} ...")


def _backends() -> Check:
    import torch.distributed as dist

    have = {"gloo": dist.is_gloo_available(), "nccl": dist.is_nccl_available(), "mpi": dist.is_mpi_available()}
    try:
        import torchhpc.accl  # noqa: F401

        have["accl"] = "accl" in dist.Backend.backend_list or hasattr(dist.Backend, "ACCL")
    except Exception:  # noqa: BLE001 -- any import failure means "not available"
        have["accl"] = False
    text = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in have.items())
    if not (have["gloo"] or have["nccl"] or have["mpi"] or have["accl"]):
        return Check("backends", FAIL, text, "this torch has no distributed backend at all")
    if not (have["mpi"] or have["accl"]):
        return Check("backends", WARN, text, "no MPI backend: `import torchhpc.accl` provides one")
    return Check("backends", OK, text)


def _libfabric() -> Check:
    fi_info = shutil.which("fi_info")
    if fi_info is None:
        return Check("libfabric", OK if not _on_slingshot() else WARN, "fi_info not on PATH",
                     "" if not _on_slingshot() else "load the libfabric module to use Slingshot")
    try:
        out = subprocess.run([fi_info, "-l"], capture_output=True, text=True, timeout=20, check=False).stdout
    except subprocess.TimeoutExpired:
        return Check("libfabric", WARN, "fi_info -l timed out", "check the libfabric installation")
    # `fi_info -l` prints "provider:" flush left, then indented "version: x.y" lines.
    providers = sorted({line.rstrip()[:-1] for line in out.splitlines() if line.rstrip().endswith(":")
                        and not line[:1].isspace()})
    return Check("libfabric", OK, "providers: " + (", ".join(providers) or "none"))


def _site() -> Check:
    site = os.environ.get("TORCHHPC_SITE")
    if not site:
        return Check("site profile", OK, "none (local environment; on a cluster, `source config_env.sh`)")
    return Check("site profile", OK, f"{site} ({os.environ.get('TORCHHPC_SITE_PROFILE', '?')})")


def _launcher() -> Check:
    from torchhpc.runtime.errors import LauncherError
    from torchhpc.runtime.world import world_info

    try:
        info = world_info()
    except LauncherError as exc:
        return Check("launcher", FAIL, str(exc), "fix the launch environment before training")
    return Check("launcher", OK, f"{info.launcher}: rank {info.rank}/{info.world_size}, "
                 f"local {info.local_rank}/{info.local_size}")


def _threads() -> Check:
    """torch's intra-op threads against this rank's budget (torchhpc.runtime.threads): more threads than the
    budget means the node's ranks run more busy threads than it has CPUs."""
    import torch

    from torchhpc.runtime.threads import thread_budget

    budget, now = thread_budget(), torch.get_num_threads()
    text = f"torch uses {now}; budget {budget.describe()}"
    if now > budget.threads:
        return Check("threads", WARN, text, f"{now} threads x {budget.local_size} ranks on {budget.cpus} cores: unset "
                     f"OMP_NUM_THREADS (torchhpc then sets {budget.threads}), or set it to {budget.threads}")
    return Check("threads", OK, text)


def _shared_pages() -> Check:
    """The page size chunkstore's node-shared host tier gets: 2 MiB where the shared-memory tmpfs gives advised
    memory huge pages, else 4 KiB (gathers from it then run at a 4 KiB-page tensor's rate)."""
    from torchhpc.chunkstore.shm import shared_page_setting

    huge, why = shared_page_setting()
    if huge:
        return Check("shared pages", OK, f"2 MiB pages for chunkstore's host tier ({why})")
    return Check("shared pages", OK, f"4 KiB pages for chunkstore's host tier ({why})",
                 "2 MiB pages: a tmpfs mounted huge=advise (root: `mount -o remount,huge=advise /dev/shm`, or "
                 "TORCHHPC_SHM_DIR on such a mount); docs/chunkstore.md")


def _runtime_vars() -> Check:
    """The runtime variables set, each TORCHHPC_* one checked by the parser every read goes through."""
    from torchhpc.runtime import settings

    names = sorted(k for k in os.environ if k.startswith(RUNTIME_PREFIXES))
    value = " ".join(f"{k}={os.environ[k]}" for k in names) if names else "none set"
    bad = settings.problems()
    return Check("runtime vars", FAIL if bad else OK, value, "; ".join(bad))


def _native() -> Check:
    from torchhpc.runtime.native import ENGINES, probe

    found = probe()
    parts = [f"{name} {where}" if ok else f"{name} not built" for name, (ok, where) in found.items()]
    missing = [ENGINES[name].make_target for name, (ok, _) in found.items() if not ok]
    hint = ("optional; build with " + ", ".join(missing) + " (or `make env NATIVE=1`)") if missing else ""
    return Check("native engines", OK, "; ".join(parts) or "none known", hint)


# What 4 KiB pages cost, as measured in the docs (not on this machine): keep in step with docs/accl.md.
HUGE_PAGES_COST = ("where measured, 4 KiB pages made a 16 MiB all-reduce on torch memory take 1.45-1.5x as long over "
                   "MPI and 1.4-1.7x through accl, and the first write of a 64 MiB tensor 3.5x ({doc})")


def _huge_pages(root: str | None = None) -> Check:
    """Huge pages for torch's CPU tensors: THP_MEM_ALLOC_ENABLE, the kernel's THP mode and defrag, and what a
    4 MiB tensor allocated here gets (torchhpc.runtime.hugepages)."""
    from torchhpc.runtime import hugepages

    root = root or hugepages.SYSFS
    enabled, defrag = hugepages.kernel_setting("enabled", root), hugepages.kernel_setting("defrag", root)
    cost = HUGE_PAGES_COST.format(doc=hugepages.DOC)
    value = os.environ.get(hugepages.VAR)
    shown = f"{hugepages.VAR}={value if value is not None else '(unset)'}"
    if enabled is None:
        return Check("huge pages", OK, f"{shown}; this kernel has no transparent huge pages ({root} missing)")
    kernel = f"kernel THP enabled={enabled}, defrag={defrag}"
    if enabled == "never":
        return Check("huge pages", WARN, f"{shown}; {kernel}: no process gets huge pages, the variable does nothing",
                     f"{cost}; only the site can change it (transparent_hugepage=madvise)")
    if enabled == "always":
        return Check("huge pages", OK, f"{shown}; {kernel}: large tensors get huge pages with or without the "
                     f"variable (with it, page faults in them also compact memory when defrag={defrag})")
    if value != "1":  # "0" is a user's choice (OK, with its cost); unset or a value torch ignores is not
        what = "opted out" if value == "0" else ("not set" if value is None else "not 0 or 1, torch ignores it")
        return Check("huge pages", OK if value == "0" else WARN,
                     f"{shown} ({what}); {kernel}: torch's CPU tensors get 4 KiB pages",
                     f"{cost}; to get them, unset it (`import torchhpc` and the activation hook set 1) or export "
                     f"{hugepages.VAR}=1 before Python starts")
    origin = "from the environment" if hugepages.INHERITED == "1" else "set by `import torchhpc`"
    asked = hugepages.torch_thp_alloc()
    if asked is False:
        return Check("huge pages", WARN, f"{shown} ({origin}) but torch here read it before it was set; {kernel}",
                     f"torch reads it at its first tensor: {cost}; export it before Python starts")
    kib = _probe_huge_kib()
    text = f"{shown} ({origin}); {kernel}; a 4 MiB torch tensor here: {kib} KiB in huge pages"
    hint = ""
    if hugepages.INHERITED != "1":
        hint = (f"processes that do not import torchhpc before their first tensor get 4 KiB pages: export "
                f"{hugepages.VAR}=1 in job scripts (the activation hook does)")
    if kib == 0:
        hint = (f"none observed: most likely no free 2 MiB block at that moment (defrag={defrag}); later faults "
                "and khugepaged may still give huge pages. " + hint).strip()
    return Check("huge pages", OK, text, hint)


def _probe_huge_kib(nbytes: int = 4 << 20) -> int:
    """KiB in huge pages of a fresh ``nbytes`` torch tensor written once (it spans at least one aligned 2 MiB)."""
    import torch

    from torchhpc.runtime.hugepages import huge_kib

    t = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    return huge_kib(t.data_ptr(), nbytes)


def _flight_recorder() -> Check:
    """Whether accl records its calls for ``torchhpc frtrace``, and where the records of a failed call go."""
    from .accl import core

    try:
        built = core.load_backend().flight_recorder_built()
    except Exception as exc:  # noqa: BLE001 -- an unbuilt backend is a finding, said once under "backends" too
        return Check("flight record", WARN, f"accl's backend not loadable: {exc}")
    if not built:
        return Check("flight record", WARN, "accl built without torch's flight recorder (nlohmann/json.hpp was not "
                     "found)", "install nlohmann-json3-dev (or put nlohmann/json.hpp on the include path) and run "
                     "`make env` again: torchhpc frtrace then shows which rank hung in which call")
    return Check("flight record", OK, f"built in; a failed call's records go to {core.flight_prefix()}<rank> "
                 "(TORCH_FR_DUMP_TEMP_FILE)")


def _guard(name: str, fn: Callable[[], Check | list[Check]]) -> list[Check]:
    try:
        result = fn()
    except Exception as exc:  # noqa: BLE001 -- a broken check is a finding, not a crash
        return [Check(name, FAIL, f"check crashed: {type(exc).__name__}: {exc}", "report this as a bug")]
    return result if isinstance(result, list) else [result]


def run_checks(probe: bool = True) -> list[Check]:
    """Run every check; ``probe`` allows the CUDA-aware MPI transfer test when under mpiexec with GPUs."""
    checks = _guard("python", _python) + _guard("torch", _torch)
    if checks[-1].status == FAIL:
        return checks
    checks += _guard("launcher", _launcher) + _guard("threads", _threads)
    for name, fn in (("gpus", _gpus), ("nccl", _nccl), ("nccl plugin", _nccl_net_plugin),
                     ("mpi", lambda: _mpi(probe)), ("backends", _backends),
                     ("flight record", _flight_recorder),
                     ("huge pages", _huge_pages), ("shared pages", _shared_pages), ("libfabric", _libfabric),
                     ("site profile", _site),
                     ("native engines", _native),
                     ("runtime vars", _runtime_vars)):
        checks += _guard(name, fn)
    return checks


def format_report(checks: Sequence[Check]) -> str:
    """The human-readable screen."""
    lines = ["torchhpc doctor"]
    for c in checks:
        lines.append(f"[{c.status:^4}] {c.name:<15} {c.value}")
        if c.hint:
            lines.append(f"{'':7}{'':15} -> {c.hint}")
    counts = {s: sum(c.status == s for c in checks) for s in (OK, WARN, FAIL)}
    lines.append(f"{counts[OK]} OK, {counts[WARN]} WARN, {counts[FAIL]} FAIL")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point; returns the exit status scripts can test."""
    parser = argparse.ArgumentParser(prog="torchhpc doctor", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the checks as JSON")
    parser.add_argument("--strict", action="store_true", help="exit 1 on WARN as well as on FAIL")
    parser.add_argument("--no-probe", action="store_true", help="skip the CUDA-aware device-transfer probe")
    parser.add_argument("--bindings", action="store_true",
                        help="run as the job's ranks are (mpiexec/srun ... torchhpc doctor --bindings): one line per "
                             "rank (host, cores, NUMA node, GPU, NIC), flagging shared cores and a GPU on another "
                             "NUMA node; with --strict, exit 1 on any")
    args = parser.parse_args(argv)
    if args.bindings:
        from . import bindings

        ranks = bindings.gathered()
        if ranks:  # rank 0
            print(bindings.report(ranks))
        return 1 if args.strict and any(bindings.problems(ranks).values()) else 0

    checks = run_checks(probe=not args.no_probe)
    rank = 0
    if "mpi4py.MPI" in sys.modules:
        rank = sys.modules["mpi4py.MPI"].COMM_WORLD.Get_rank()
    if rank == 0:
        print(json.dumps([asdict(c) for c in checks], indent=2) if args.json else format_report(checks))
    bad = {FAIL, WARN} if args.strict else {FAIL}
    return 1 if any(c.status in bad for c in checks) else 0


if __name__ == "__main__":
    raise SystemExit(main())
