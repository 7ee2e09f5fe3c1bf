"""torchhpc: distributed PyTorch on HPC systems.

Three layers, each importing only the ones before it (``import torchhpc`` stays cheap: nothing below is imported
until asked for):

- :mod:`torchhpc.runtime`    -- the shared runtime: errors, settings, the job's world and rendezvous, waiting on
  peers, threads, MPI facts and command lines, huge pages, native libraries
- capabilities, one subpackage each:
  :mod:`torchhpc.accl` (the ``"accl"`` torch.distributed backend over MPI / ACCL),
  :mod:`torchhpc.rehearsal` (distributed asynchronous rehearsal buffers),
  :mod:`torchhpc.braid` (layer-parallel MGRIT training),
  :mod:`torchhpc.chunkstore` (tiered ChunkTensor, GNN sampling),
  :mod:`torchhpc.checkpoint` (sharded checkpoints that survive a crash)
- the entry points users call and the tools they type: :mod:`torchhpc.launcher` (``init_distributed`` for any
  launcher), :mod:`torchhpc.cli` (``torchhpc``: ``doctor``, ``jobscript``, ``frtrace``, ``bench``),
  :mod:`torchhpc.mpi_upstream` (PyTorch's own MPI backend built against the wheel)

Importing it sets ``THP_MEM_ALLOC_ENABLE=1`` when unset (:mod:`torchhpc.runtime.hugepages`): huge pages for
torch's CPU tensors; ``THP_MEM_ALLOC_ENABLE=0`` opts out.  Under a launcher that leaves a node's ranks sharing its
CPUs (``srun`` without binding), it gives each rank its share of them as torch's threads
(:mod:`torchhpc.runtime.threads`); ``OMP_NUM_THREADS`` opts out.
"""

from .runtime.hugepages import set_default as _huge_pages_default
from .runtime.threads import set_default as _threads_default

__version__ = "0.1.0"

# Huge pages for torch's CPU tensors >= 2 MiB (THP_MEM_ALLOC_ENABLE=1) unless the user set the variable or the
# kernel has THP off; effective here when no tensor was allocated yet (torch reads it once, at its first
# allocation), and in every process started from here.  Measured and explained in docs/accl.md.
_huge_pages_default()
# One thread budget per rank whatever the launcher: without it, N unbound ranks on a node each run one busy
# OpenMP thread per core (docs/launcher.md).
_threads_default()
