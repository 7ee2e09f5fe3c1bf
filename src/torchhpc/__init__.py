"""torchhpc: distributed PyTorch on HPC systems.

Subpackages, one per capability (imported on demand, so ``import torchhpc`` stays cheap):

- :mod:`torchhpc.launcher`   -- who am I in this job; ``init_distributed`` for any launcher
- :mod:`torchhpc.accl`       -- the ``"accl"`` torch.distributed backend over MPI / ACCL
- :mod:`torchhpc.rehearsal`  -- distributed asynchronous rehearsal buffers for continual learning
- :mod:`torchhpc.braid`      -- layer-parallel (MGRIT) training of ResNets and GRUs
- :mod:`torchhpc.chunkstore` -- ChunkTensor over device / node-shared host / remote memory, GNN sampling

Importing it sets ``THP_MEM_ALLOC_ENABLE=1`` when unset (:mod:`torchhpc.hugepages`): huge pages for torch's
CPU tensors; ``THP_MEM_ALLOC_ENABLE=0`` opts out.  Under a launcher that leaves a node's ranks sharing its CPUs
(``srun`` without binding), it gives each rank its share of them as torch's threads (:mod:`torchhpc.threads`);
``OMP_NUM_THREADS`` opts out.
"""

from .hugepages import set_default as _huge_pages_default
from .threads import set_default as _threads_default

__version__ = "0.1.0"

# Huge pages for torch's CPU tensors >= 2 MiB (THP_MEM_ALLOC_ENABLE=1) unless the user set the variable or the
# kernel has THP off; effective here when no tensor was allocated yet (torch reads it once, at its first
# allocation), and in every process started from here.  Measured and explained in docs/accl.md.
_huge_pages_default()
# One thread budget per rank whatever the launcher: without it, N unbound ranks on a node each run one busy
# OpenMP thread per core (docs/launcher.md).
_threads_default()
