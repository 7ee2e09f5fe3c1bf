# Spack recipes import their directives with `from spack.package import *` (Spack's convention).
# ruff: noqa: F403, F405
# torchhpc as a Spack package.  spack.yaml builds it from this checkout (its `develop:` entry), so the
# recipe declares the version of pyproject.toml and no download source.
import contextlib

from spack.package import *

# Spack >= 1.0 keeps the build-system classes in the builtin repository; Spack <= 0.23 exports PythonPackage
# from spack.package (imported above).
with contextlib.suppress(ImportError):
    from spack_repo.builtin.build_systems.python import PythonPackage


class PyTorchhpc(PythonPackage):
    """Distributed PyTorch on HPC systems: a torch.distributed backend over MPI, distributed rehearsal
    buffers, layer-parallel (MGRIT) training and tiered GNN feature stores."""

    license("BSD-3-Clause")

    version("0.1.0")

    variant("cuda", default=True, description="Use a CUDA build of PyTorch (NCCL alongside MPI)")

    depends_on("python@3.10:", type=("build", "run"))
    depends_on("py-setuptools@68:", type="build")
    depends_on("py-numpy@1.23:", type=("build", "run"))
    depends_on("py-mpi4py@4.0:", type=("build", "run"))
    depends_on("mpi", type=("build", "link", "run"))  # accl's C++ backend links the MPI mpi4py uses
    depends_on("c", type="build")  # the MPI's mpicc, which names its family for the backend build
    depends_on("cxx", type="build")  # accl's C++ backend, against py-torch's headers
    depends_on("py-psutil@5.9:", type=("build", "run"))
    depends_on("py-tabulate@0.9:", type="run")  # torch's flight-recorder analyzer (torchhpc frtrace)
    depends_on("py-cloudpickle@3.0:", type="run")  # torchhpc.submit: calls from notebooks and __main__ by value
    depends_on("nlohmann-json", type=("build", "link"))  # torch's flight-recorder header, for accl's recorder
    # torch is left out of pyproject.toml on purpose (the environment provides it); here it is explicit.
    depends_on("py-torch+distributed+mpi", type=("build", "run"))
    depends_on("py-torch+cuda+nccl", when="+cuda", type=("build", "run"))
    depends_on("py-torch~cuda", when="~cuda", type=("build", "run"))
    depends_on("py-pytest@7:", type="test")

    import_modules = ["torchhpc"]

    @run_after("install")
    def build_accl_core(self):
        """accl's C++ backend (src/torchhpc/accl/csrc/) built with this MPI's mpicxx against py-torch, into the
        installed package (an install's build: no test hooks); the build module runs from the source tree."""
        self.spec["python"].command("-m", "torchhpc.accl.corebuild", "--mpicc", self.spec["mpi"].mpicc,
                                    "--mpicxx", self.spec["mpi"].mpicxx,
                                    "--dest", join_path(self.prefix, python_platlib, "torchhpc", "accl"),
                                    extra_env={"PYTHONPATH": join_path(self.stage.source_path, "src")})
