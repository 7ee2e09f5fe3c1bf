"""torchhpc: distributed PyTorch on HPC systems.

Subpackages, one per capability (imported on demand, so ``import torchhpc`` stays cheap):

- :mod:`torchhpc.launcher`   -- who am I in this job; ``init_distributed`` for any launcher
- :mod:`torchhpc.accl`       -- the ``"accl"`` torch.distributed backend over MPI / ACCL
- :mod:`torchhpc.rehearsal`  -- distributed asynchronous rehearsal buffers for continual learning
- :mod:`torchhpc.braid`      -- layer-parallel (MGRIT) training of ResNets and GRUs
- :mod:`torchhpc.chunkstore` -- ChunkTensor over device / node-shared host / remote memory, GNN sampling
"""

__version__ = "0.1.0"
