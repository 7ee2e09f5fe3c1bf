"""Options of the ``"accl"`` backend: engine choice, segmentation, ACCL fall-backs, checks.

Values come from, in order of precedence: an :class:`AcclOptions` passed as
``pg_options`` to ``init_process_group``/``new_group``, then ``TORCHHPC_ACCL_*``
environment variables, then the defaults below.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

from ..runtime import settings

__all__ = ["AcclOptions", "collectives", "default_spin_us", "plan"]


def collectives() -> tuple[str, ...]:
    """The collective names of ``sidestep`` (and of the backend's errors), as the C++ backend defines them."""
    from . import core  # the built module; options can be made before it is asked for

    return tuple(core.load_backend().COLLECTIVES)


def default_spin_us(ranks_on_node: int | None = None) -> int:
    """accl's choice of ``spin_us``, made as MPI libraries make theirs: spin while this node has a core for every
    rank of the job on it (``ranks_on_node``, by default the launcher's local size, against the node's cores:
    ranks bound to one core each see only their own), yield soon where ranks outnumber them. Measured: 2 ranks
    beside DDP's backward pass, the step 0.98-0.99x PyTorch's MPI backend with 100 µs, 1.00x with 1000; 4 ranks
    on 2 cores, a 1 MiB all_reduce 20-35% slower with 1000."""
    if ranks_on_node is None:
        from ..runtime.world import LauncherError, world_info

        try:
            ranks_on_node = world_info(dict(os.environ), use_mpi=False).local_size  # a copy: never asks MPI
        except LauncherError:
            ranks_on_node = 1
    return 1000 if 0 < ranks_on_node <= (os.cpu_count() or 1) else 100


def _env(name: str):  # noqa: ANN202 (the setting's own type)
    """``TORCHHPC_ACCL_<NAME>`` as :mod:`torchhpc.runtime.settings` parses and checks it (the one parser)."""
    return settings.get(name)


def _env_sidestep() -> frozenset[str]:
    raw = os.environ.get("TORCHHPC_ACCL_SIDESTEP")
    if raw is None:
        return frozenset(collectives())
    raw = raw.strip().lower()
    if raw in ("", "none", "0", "off"):
        return frozenset()
    if raw in ("all", "1", "on"):
        return frozenset(collectives())
    return frozenset(x.strip() for x in raw.split(",") if x.strip())


@dataclass
class AcclOptions:
    """Per-group settings of the ``"accl"`` backend (pass as ``pg_options``).

    - ``engine``: ``"mpi"`` (mpi4py, default) or ``"accl"`` (pyaccl: Alveo card or emulator).
    - ``max_segment_bytes``: no single engine call touches more than this many bytes of any one buffer.
      None (the default): accl's choice, 4 MiB segments for the reductions on MPI (faster than Open MPI's one
      call from 16 MiB), one call for data movement.
    - ``sidestep``: collectives that may fall back to MPI when the ACCL engine lacks them
      (for the dtype/op at hand); the others raise instead.
    - ``ring_min_bytes``: all_reduce and reduce_scatter moving at least this many bytes run accl's own
      pipelined ring over point-to-point instead of MPI's algorithm. None (the default): accl's choice,
      reduce_scatter always (Open MPI's faults in a buffer of the whole input on every call), all_reduce
      whenever the group spans nodes (across a link the ring moves the least data: 2(p-1)/p of the buffer
      per rank, where recursive doubling moves all of it log2(p) times), MPI's calls on one node.
    - ``flight_stacks``: each call's flight record (see :func:`torchhpc.accl.dump_flight_record`) also
      carries the caller's Python stack, as NCCL's does. Off by default: gathering it takes back the GIL the
      call released and costs 0.3-0.7 µs per call here (3 to 40 frames deep);
      without it a record still names the group, sequence number, op, sizes, dtypes, state and thread.
    - ``spin_us``: a wait on peers polls MPI back to back this long before it yields the core (then sleeps
      after 20 ms). None (the default): accl's choice, as MPI libraries make theirs: 1000 where this node has
      a core for every rank of the job on it (a waiter that yields sooner falls out of step with its peer when
      compute threads hold the cores: DDP's step 1-2% slower), 100 where ranks outnumber the cores (spinning
      then takes the core from the peer being waited for).
    - ``accl_sim_sock``/``accl_start_port``/``accl_xclbin``/``accl_bufsize``/``accl_protocol``:
      how the ACCL engine reaches its device (see :mod:`torchhpc.accl.accl_engine`).
    """

    engine: str = field(default_factory=lambda: _env("TORCHHPC_ACCL_ENGINE"))
    max_segment_bytes: int | None = field(default_factory=lambda: _env("TORCHHPC_ACCL_MAX_SEGMENT_BYTES"))
    sidestep: frozenset[str] = field(default_factory=_env_sidestep)
    ring_min_bytes: int | None = field(default_factory=lambda: _env("TORCHHPC_ACCL_RING_MIN_BYTES"))
    spin_us: int | None = field(default_factory=lambda: _env("TORCHHPC_ACCL_SPIN_US"))
    flight_stacks: bool = field(default_factory=lambda: _env("TORCHHPC_ACCL_FLIGHT_STACKS"))
    accl_sim_sock: str | None = field(default_factory=lambda: os.environ.get("TORCHHPC_ACCL_SIM_SOCK"))
    accl_start_port: int = field(default_factory=lambda: _env("TORCHHPC_ACCL_START_PORT"))
    accl_xclbin: str | None = field(default_factory=lambda: os.environ.get("TORCHHPC_ACCL_XCLBIN"))
    accl_bufsize: int = field(default_factory=lambda: _env("TORCHHPC_ACCL_BUFSIZE"))
    accl_protocol: str = field(default_factory=lambda: _env("TORCHHPC_ACCL_PROTOCOL").upper())

    def __post_init__(self) -> None:
        self.engine = str(self.engine).lower()
        if self.engine not in ("mpi", "accl"):
            raise ValueError(f"AcclOptions.engine must be 'mpi' or 'accl', got {self.engine!r}")
        for name in ("max_segment_bytes", "ring_min_bytes", "spin_us", "accl_start_port", "accl_bufsize"):
            # the same ranges as their variables
            setting = settings.SETTINGS["TORCHHPC_ACCL_" + name.upper().removeprefix("ACCL_")]
            value = getattr(self, name)
            if (value is None and setting.default is None) or (isinstance(value, int) and setting.in_range(value)):
                continue
            raise ValueError(f"AcclOptions.{name} must be {'None or ' if setting.default is None else ''}"
                             f"{setting.takes()}, got {value!r}")
        self.sidestep = frozenset(self.sidestep)
        known = collectives()
        unknown = self.sidestep - set(known)
        if unknown:
            raise ValueError(f"AcclOptions.sidestep names unknown collectives {sorted(unknown)}; "
                             f"known: {', '.join(known)}")

    def backend_options(self, timeout: timedelta, group_name: str):  # noqa: ANN201 (the built module's class)
        """These options as the C++ backend's one struct (``Options``), with the group's timeout and name; accl's
        choices (None) stay unset there, except ``spin_us``, chosen here for this node."""
        from . import core

        o = core.load_backend().Options()
        o.max_segment_bytes, o.ring_min_bytes = self.max_segment_bytes, self.ring_min_bytes
        o.timeout, o.group_name = timeout, group_name
        o.sidestep, o.flight_stacks = sorted(self.sidestep), self.flight_stacks
        o.spin = timedelta(microseconds=default_spin_us() if self.spin_us is None else self.spin_us)
        return o


def plan(collective: str, nbytes: int, ranks: int, spans_nodes: bool, options: AcclOptions | None = None) -> str:
    """The path accl takes for one call (``carried``: whole in the header exchange; ``mpi``: the header, then
    MPI's algorithm; ``ring``: the header, then accl's ring),
    from the C++ backend's one choice point.  ``collective`` by the flight recorder's names (``all_reduce``,
    ``_all_gather_base``, ``all_to_all_single``...); ``nbytes`` what the call moves in all (all_gather's output,
    reduce_scatter's input)."""
    import torch.distributed as dist

    from . import core

    opts = (options if options is not None else AcclOptions()).backend_options(dist.default_pg_timeout, "")
    return core.load_backend().plan(collective, nbytes, ranks, spans_nodes, opts)
