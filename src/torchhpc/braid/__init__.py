"""Layer-parallel training with MGRIT: a general time-parallel solver and parallel-in-layer networks.

- :func:`torchhpc.braid.mgrit.solve` -- MGRIT over MPI ranks for any ``step(u, t_start, t_stop)``
- :class:`LayerParallel` -- an ``nn.Module`` whose forward and backward (adjoint) passes run MGRIT over layers
- :class:`GRUParallel` / :class:`GRUSerial` -- a GRU solved in parallel over the sequence, and its serial twin
"""

from . import mgrit
from .gru import GRUParallel, GRUSerial
from .layer_parallel import LayerParallel
from .layers import ODEBlock
from .mgrit import MGRITResult, solve
from .options import MGRITOptions

__all__ = ["mgrit", "solve", "MGRITResult", "MGRITOptions", "LayerParallel", "ODEBlock", "GRUParallel",
           "GRUSerial"]
