"""The shared runtime every capability and tool stands on; it imports none of them (a test holds the direction).

- :mod:`.errors`      -- the package's one error family
- :mod:`.settings`    -- every ``TORCHHPC_*`` variable: kind, range, default, one parser
- :mod:`.private`     -- directories only this user can write (build caches, flight records, job files)
- :mod:`.world`       -- who am I in this job under every launcher; the job's rendezvous store
- :mod:`.waiting`     -- the one way to wait on peers: deadlines, one back-off, errors agreed across ranks
- :mod:`.threads`     -- one thread budget per rank under every launcher
- :mod:`.mpirun`      -- ``mpiexec`` command lines for Open MPI and MPICH
- :mod:`.mpi_info`    -- facts about the MPI library: family, thread level, CUDA-awareness
- :mod:`.hugepages`   -- transparent huge pages for torch's CPU tensors
- :mod:`.native`      -- loading the native engines (Mochi, XBraid) built by ``make native``
- :mod:`.nccl_plugin` -- NCCL's network plugin (AWS OFI libfabric) settings
"""
