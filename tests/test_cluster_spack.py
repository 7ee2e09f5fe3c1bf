"""spack.yaml, the per-site Spack files, repo.yaml, the recipes in packages/, and the pinned Spack itself.

Static checks read the YAML with a small parser for the block-style subset these files use, and import the
recipes against a minimal stand-in for `spack.package` that records directive calls. The real check runs the
pinned Spack (utils/spack_pins.tsv) from the archives in ../shared/vendor/: it concretizes the environment for
the generic site and for Derecho's site file (its Cray externals), checks the concretized graph (versions from
the tables, variants, our patch in py-torch's patches, one MPI for every package), and walks the install graph
with `spack install --fake`. One concretization per site per session, cached in build/ keyed by its inputs.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import types
from pathlib import Path
from typing import Any

import _background as background
import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
SITES = sorted(p.stem for p in (ROOT / "utils" / "sites").glob("*.sh"))


def parse_block_yaml(text: str) -> Any:
    """Parse block-style YAML (mappings, `- ` sequences, plain scalars, comments); no flow style."""
    lines = []
    for raw in text.splitlines():
        stripped = raw.split(" #")[0].rstrip() if not raw.lstrip().startswith("#") else ""
        if stripped.strip():
            assert "\t" not in raw[: len(raw) - len(raw.lstrip())], "tabs in indentation"
            lines.append((len(stripped) - len(stripped.lstrip()), stripped.strip()))

    def block(i: int, indent: int) -> tuple[Any, int]:
        if lines[i][1].startswith("- "):
            seq = []
            while i < len(lines) and lines[i][0] == indent and lines[i][1].startswith("- "):
                item = lines[i][1][2:]
                if ":" in item and not item.endswith(":") and ": " in item:
                    # "- key: value" opens a mapping whose other keys sit at indent + 2
                    lines[i] = (indent + 2, item)
                    value, i = block(i, indent + 2)
                    seq.append(value)
                else:
                    seq.append(item)
                    i += 1
            return seq, i
        mapping: dict[str, Any] = {}
        while i < len(lines) and lines[i][0] == indent:
            key, sep, rest = lines[i][1].partition(":")
            assert sep, f"not a mapping line: {lines[i][1]!r}"
            assert key not in mapping, f"duplicate key {key}"
            if rest.strip():
                mapping[key] = rest.strip()
                i += 1
            elif i + 1 < len(lines) and lines[i + 1][0] >= indent:
                nxt = lines[i + 1][0]
                if nxt == indent and lines[i + 1][1].startswith("- "):
                    mapping[key], i = block(i + 1, indent)
                else:
                    assert nxt > indent, f"empty value for {key}"
                    mapping[key], i = block(i + 1, nxt)
            else:
                mapping[key] = None
                i += 1
        return mapping, i

    value, end = block(0, lines[0][0])
    assert end == len(lines), f"could not parse line {lines[end][1]!r}"
    return value


def read_yaml(path: Path) -> Any:
    return parse_block_yaml(path.read_text())


def test_block_yaml_parser_on_a_known_document() -> None:
    doc = "a:\n  b: 1\n  c:\n  - x\n  - k: v\n    m: n\n# note\nd: e  # trailing\n"
    assert parse_block_yaml(doc) == {"a": {"b": "1", "c": ["x", {"k": "v", "m": "n"}]}, "d": "e"}


def table_row(version: str) -> dict[str, str]:
    """The row of utils/pytorch_versions.tsv for `version`."""
    lines = [ln.split("\t") for ln in (ROOT / "utils/pytorch_versions.tsv").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    rows = {r[0]: dict(zip(lines[0], r, strict=True)) for r in lines[1:]}
    assert version in rows, f"spack.yaml's py-torch@{version} is not a row of utils/pytorch_versions.tsv"
    return rows[version]


def native_versions() -> dict[str, str]:
    """spack package name -> version, from utils/native_versions.tsv."""
    out = {}
    for line in (ROOT / "utils/native_versions.tsv").read_text().splitlines():
        cols = line.split("\t")
        if line.strip() and not line.startswith("#"):
            out[cols[2]] = cols[1]
    return out


def spack_yaml_specs() -> dict[str, str]:
    env = read_yaml(ROOT / "spack.yaml")["spack"]
    return {spec.split("@")[0].split()[0]: spec for spec in env["specs"]}


def pinned(spec: str) -> str:
    """The version a root spec pins (`name@X ...` -> X)."""
    return spec.split()[0].split("@")[1]


def test_spack_yaml_describes_the_whole_stack() -> None:
    env = read_yaml(ROOT / "spack.yaml")["spack"]
    assert env["include"] == ["build/spack-site.yaml"]
    assert env["repos"] == ["."]
    names = spack_yaml_specs()
    for needed in ("python", "py-torch", "nccl", "aws-ofi-nccl", "mochi-thallium", "mochi-margo", "mercury",
                   "argobots", "xbraid", "py-mpi4py", "py-pybind11", "py-torchhpc"):
        assert needed in names, f"{needed} missing from spack.yaml specs"
    torch = names["py-torch"].split()
    assert {"+cuda", "+cudnn", "+mpi", "+nccl", "+gloo", "+distributed"} <= set(torch)
    assert env["packages"]["py-torch"]["require"] == ["+mpi +nccl +gloo +distributed"]
    assert env["develop"]["py-torchhpc"]["path"] == "."
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert env["develop"]["py-torchhpc"]["spec"] == f"py-torchhpc@={pyproject['project']['version']}"
    assert env["packages"]["mercury"]["require"] == ["+ofi"]
    assert env["view"]["default"]["root"] == "build/spack-view"


def test_versions_in_one_place() -> None:
    """spack.yaml pins what the tables say: the py-torch row (NCCL, aws-ofi-nccl, CUDA, cuDNN, Python) and
    utils/native_versions.tsv (XBraid, Mochi); docs/cluster.md shows the same table."""
    env = read_yaml(ROOT / "spack.yaml")["spack"]
    names = spack_yaml_specs()
    row = table_row(pinned(names["py-torch"]))
    assert pinned(names["nccl"]) == row["nccl"]
    assert pinned(names["aws-ofi-nccl"]) == row["aws_ofi_nccl"]
    assert pinned(names["python"]) == row["python"]
    assert env["packages"]["cuda"]["require"] == [f"'@{row['cuda']}'"]
    assert env["packages"]["cudnn"]["require"] == [f"'@{row['cudnn']}'"]
    natives = native_versions()
    assert set(natives) <= set(names), "every native library of utils/native_versions.tsv is a root spec"
    for name, version in natives.items():
        assert pinned(names[name]) == version, f"spack.yaml pins {names[name]}, native_versions.tsv {version}"
    # The Makefile route builds the same aws-ofi-nccl by default.
    script = (ROOT / "utils/build_nccl-ofi-plugin.sh").read_text()
    assert f"AWS_OFI_NCCL_VERSION=${{AWS_OFI_NCCL_VERSION:-{row['aws_ofi_nccl']}}}" in script
    # docs/cluster.md carries the table: every release with its companions, as in the TSV.
    docs = (ROOT / "docs/cluster.md").read_text()
    lines = [ln.split("\t") for ln in (ROOT / "utils/pytorch_versions.tsv").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    for cols in lines[1:]:
        r = dict(zip(lines[0], cols, strict=True))
        cells = [r[k] for k in ("torch", "torchvision", "cuda", "cudnn", "nccl", "aws_ofi_nccl", "python_range",
                                "cxx")]
        assert "| " + " | ".join(cells) + " |" in docs, f"docs/cluster.md lacks or disagrees on {r['torch']}"
    pins = (ROOT / "utils/spack_pins.tsv").read_text()
    for line in pins.splitlines():
        cols = line.split("\t")
        if not line.startswith("#") and cols[0] in ("spack", "spack-packages"):
            assert cols[2] in docs, f"docs/cluster.md must name the pinned {cols[0]} commit"


def test_version_sources_cover_every_cell() -> None:
    """utils/pytorch_versions.sources.tsv has one line, with the same value, for every cell of the table."""
    lines = [ln.split("\t") for ln in (ROOT / "utils/pytorch_versions.tsv").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    cells = {(r[0], k, v) for r in lines[1:] for k, v in zip(lines[0], r, strict=True) if k != "torch"}
    src = [ln.split("\t") for ln in (ROOT / "utils/pytorch_versions.sources.tsv").read_text().splitlines()
           if ln.strip() and not ln.startswith("#")][1:]
    assert all(len(s) == 4 and s[3].strip() for s in src), "every source line names its source"
    assert {(s[0], s[1], s[2]) for s in src} == cells and len(src) == len(cells)
    unread = [s for s in src if s[2] == "-"]
    assert all(s[3].startswith("not read") for s in unread), "a `-` must say why it could not be read"


@pytest.mark.parametrize("site", SITES)
def test_every_site_has_a_spack_file(site: str) -> None:
    packages = read_yaml(ROOT / f"utils/sites/{site}.spack.yaml")["packages"]
    assert any(v.startswith("cuda_arch=") for v in packages["all"]["variants"])
    assert "require" in packages["mpi"]


def test_derecho_spack_file_uses_the_cray_stack_as_externals() -> None:
    packages = read_yaml(ROOT / "utils/sites/derecho.spack.yaml")["packages"]
    assert packages["mpi"]["require"] == ["cray-mpich"] and packages["mpi"]["buildable"] == "false"
    for name in ("cray-mpich", "libfabric", "cuda", "openpbs"):
        assert name == "cuda" or packages[name]["buildable"] == "false"
        ext = packages[name]["externals"][0]
        assert ext["spec"].startswith(f"{name}@") and ext["prefix"].startswith("/")
    assert "fabrics=cxi" in packages["libfabric"]["externals"][0]["spec"]
    # Same GPU architecture as the Makefile route (TORCH_CUDA_ARCH_LIST in utils/sites/derecho.sh).
    profile = (ROOT / "utils/sites/derecho.sh").read_text()
    arch = profile.split('SITE_TORCH_CUDA_ARCH_LIST="')[1].split('"')[0]
    assert packages["all"]["variants"] == [f"cuda_arch={arch.replace('.', '')}"]
    # Derecho's cuda/12.2.1 module stays listed, but it is below spack.yaml's CUDA, so it must be buildable.
    assert "buildable" not in packages["cuda"]
    assert "cray-mpich/8.1.27" in profile
    assert packages["cray-mpich"]["externals"][0]["spec"] == "cray-mpich@8.1.27"


def test_repo_yaml_makes_the_root_a_spack_repo() -> None:
    assert read_yaml(ROOT / "repo.yaml") == {"repo": {"namespace": "torchhpc"}}
    recipes = sorted(p.parent.name for p in (ROOT / "packages").glob("*/package.py"))
    assert recipes == ["mochi-margo", "py-torch", "py-torchhpc"]


# --- recipes against a stand-in spack.package ----------------------------------------------------------

DIRECTIVES = ("version", "variant", "depends_on", "patch", "conflicts", "license", "maintainers", "requires",
              "extends", "provides", "resource")


def _directive(name: str):
    def record(*args: Any, **kwargs: Any) -> None:
        sys._getframe(1).f_locals.setdefault("_directives", []).append((name, args, kwargs))

    return record


def builtin_torch_versions() -> list[str]:
    """The releases the pinned builtin repository's py-torch recipe declares (its ``version("X.Y.Z", ...)``
    lines), read from the archive utils/spack_pins.tsv names; skips where the archive is absent."""
    archive = VENDOR / pins()["spack-packages"]["archive"]
    if not archive.is_file():
        pytest.skip(f"vendor archive {archive} absent: the builtin py-torch recipe is read from it")
    with tarfile.open(archive) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("/builtin/packages/py_torch/package.py"))
        text = tar.extractfile(member).read().decode()
    return re.findall(r'^\s*version\(\s*"(\d+\.\d+\.\d+)"', text, re.MULTILINE)


@pytest.fixture()
def spack_standin(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """`spack.package` with recording directives and empty build-system bases; a builtin py-torch."""
    spack = types.ModuleType("spack")
    package = types.ModuleType("spack.package")

    class PackageBase:
        pass

    class PythonPackage(PackageBase):
        pass

    class CudaPackage(PackageBase):
        pass

    def run_after(phase: str):  # Spack's phase callback decorator: records the phase on the method
        def mark(fn):
            fn.run_after = phase
            return fn
        return mark

    package.PythonPackage, package.CudaPackage, package.run_after = PythonPackage, CudaPackage, run_after
    for name in DIRECTIVES:
        setattr(package, name, _directive(name))
    package.__all__ = ["PythonPackage", "CudaPackage", "run_after", *DIRECTIVES]
    builtin_torch = types.ModuleType("spack.pkg.builtin.py_torch")

    class PyTorch(PythonPackage, CudaPackage):
        """Stand-in for Spack's builtin recipe: the releases the pinned builtin declares, read from it."""

        versions = {v: {} for v in builtin_torch_versions()}

    builtin_torch.PyTorch = PyTorch
    for name, module in (("spack", spack), ("spack.package", package), ("spack.pkg", types.ModuleType("x")),
                         ("spack.pkg.builtin", types.ModuleType("y")),
                         ("spack.pkg.builtin.py_torch", builtin_torch)):
        monkeypatch.setitem(sys.modules, name, module)
    return builtin_torch


def load_recipe(name: str) -> types.ModuleType:
    path = ROOT / "packages" / name / "package.py"
    spec = importlib.util.spec_from_file_location(f"torchhpc_recipe_{name.replace('-', '_')}", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def directives(cls: type, kind: str) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    return [(a, k) for n, a, k in cls.__dict__.get("_directives", []) if n == kind]


def test_py_torch_recipe_extends_builtin_and_patches_every_supported_version(
    spack_standin: types.ModuleType,
) -> None:
    recipe = load_recipe("py-torch").PyTorch
    assert issubclass(recipe, spack_standin.PyTorch) and recipe is not spack_standin.PyTorch
    declared = [(k["when"], (ROOT / "packages/py-torch" / a[0]).resolve())
                for a, k in directives(recipe, "patch")]
    expected = []
    for line in (ROOT / "utils/pytorch_versions.tsv").read_text().splitlines():
        cols = line.split("\t")
        if line.startswith("#") or cols[0] == "torch" or not line.strip():
            continue
        for patch in sorted((ROOT / "patches/pytorch" / cols[6]).glob("*.patch")):
            expected.append((f"@{cols[0]}", patch.resolve()))
    assert declared == expected and expected
    assert all(path.is_file() for _, path in declared)
    conflicts = [a[0] for a, _ in directives(recipe, "conflicts")]
    assert "~distributed" in conflicts and "~mpi" in conflicts
    assert not hasattr(recipe, "_version") and not hasattr(recipe, "_patch")
    # Only the release the builtin lacks is added, at the tag commit of the table.
    added = directives(recipe, "version")
    assert added == [(("2.13.0",), {"tag": "v2.13.0", "commit": table_row("2.13.0")["commit"], "submodules": True})]


def test_py_torchhpc_recipe_declares_what_pyproject_needs(spack_standin: types.ModuleType) -> None:
    recipe = load_recipe("py-torchhpc").PyTorchhpc
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert [a[0] for a, _ in directives(recipe, "version")] == [pyproject["version"]]
    assert [a[0] for a, _ in directives(recipe, "variant")] == ["cuda"]
    deps = {a[0].split("@")[0].split("+")[0].split("~")[0]: (a[0], k)
            for a, k in directives(recipe, "depends_on")}
    for requirement in pyproject["dependencies"]:
        name = "py-" + requirement.split(">")[0].split("=")[0].split("<")[0].strip().lower()
        low = requirement.split(">=")[1] if ">=" in requirement else None
        assert name in deps, f"{name} (from pyproject) missing from the recipe"
        assert "run" in deps[name][1]["type"]
        if low:
            assert deps[name][0] == f"{name}@{low}:"
    python_low = pyproject["requires-python"].removeprefix(">=")
    assert deps["python"][0] == f"python@{python_low}:"
    torch_specs = [a[0] for a, _ in directives(recipe, "depends_on") if a[0].startswith("py-torch")]
    assert "py-torch+distributed+mpi" in torch_specs and "py-torch+cuda+nccl" in torch_specs
    assert recipe.import_modules == ["torchhpc"]
    # accl's C++ backend is built against the environment's MPI once the package is installed
    assert "mpi" in deps and "link" in deps["mpi"][1]["type"]
    assert recipe.build_accl_core.run_after == "install"


# --- the pinned Spack, for real --------------------------------------------------------------------------------

SPACK = pytest.mark.full("the pinned Spack, concretizing and installing")

VENDOR = ROOT.parent / "shared" / "vendor"
SPACK_INPUTS = ["spack.yaml", "repo.yaml", "utils/pytorch_versions.tsv", "utils/native_versions.tsv",
                "utils/spack_pins.tsv"]


def pins() -> dict[str, dict[str, str]]:
    lines = [ln.split("\t") for ln in (ROOT / "utils/spack_pins.tsv").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    return {r[0]: dict(zip(lines[0], r, strict=True)) for r in lines[1:]}


def spack_env(tmp: Path) -> dict[str, str]:
    """A clean environment: the venv and the system tools only (no `spack` on PATH), the vendor archives."""
    return {"PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin", "HOME": str(tmp), "LANG": "C",
            "SPACK_ARCHIVES": str(VENDOR)}


def need_spack_inputs() -> None:
    missing = [p["archive"] for p in pins().values() if not (VENDOR / p["archive"]).is_file()]
    if missing:
        pytest.skip(f"vendor archives absent ({', '.join(missing)} in {VENDOR}): real Spack checks skipped")
    if shutil.which("gfortran") is None:
        pytest.skip("no gfortran (Debian package gfortran, listed in .ci/debian-packages): Spack needs it")


def inputs_key(site: str) -> str:
    digest = hashlib.sha256()
    files = [ROOT / p for p in SPACK_INPUTS] + [ROOT / f"utils/sites/{site}.spack.yaml"]
    files += sorted((ROOT / "packages").rglob("*.py")) + sorted((ROOT / "patches").rglob("*"))
    for path in files:
        if path.is_file():
            digest.update(path.relative_to(ROOT).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


SITES_CONCRETIZED = ("generic", "derecho")


def _lock_and_key(site: str) -> tuple[Path, Path]:
    build = ROOT / "build"
    return build / f"spack-{site}.lock", build / f"spack-{site}.key"


def start_in_background(items: list[pytest.Item]) -> None:
    """Where the real Spack tests are selected and their inputs are here, both sites are concretized beside the
    tests before them (tests/_background.py), one after the other (both use the repository's environment), each
    graph's key written once it is saved; `concretize` waits for them."""
    if not any(item.get_closest_marker("full") == SPACK.mark for item in items):
        return
    try:
        need_spack_inputs()
    except pytest.skip.Exception:
        return  # the tests say why
    steps = []
    for site in SITES_CONCRETIZED:
        lock, key_file = _lock_and_key(site)
        steps.append(f"SITE={site} bash utils/spack_env.sh concretize && echo {inputs_key(site)} > {key_file} && "
                     f"echo $SECONDS > {lock.with_suffix('.seconds')}")
    home = Path(tempfile.mkdtemp(prefix="torchhpc-spack-home-"))
    background.start("spack", ["bash", "-c", "set -e; " + "; SECONDS=0; ".join(steps)], ROOT / "build" / "spack-bg.log",
                     cwd=ROOT, env=spack_env(home))


def concretize(site: str, tmp: Path) -> dict[str, Any]:
    """The concretized graph of spack.yaml for `site` (spack.lock as JSON), from build/ when its inputs are
    unchanged (as the background concretization leaves them), else by running `utils/spack_env.sh concretize` with
    the pinned Spack."""
    need_spack_inputs()
    background.wait("spack", timeout=2400)
    lock, key_file = _lock_and_key(site)
    key = inputs_key(site)
    if not (lock.is_file() and key_file.is_file() and key_file.read_text().strip() == key):
        start = time.monotonic()
        proc = subprocess.run(["bash", "utils/spack_env.sh", "concretize"], cwd=ROOT, capture_output=True,
                              text=True, timeout=2400, env={**spack_env(tmp), "SITE": site})
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
        lock.with_suffix(".seconds").write_text(f"{time.monotonic() - start:.0f}\n")
        key_file.write_text(key + "\n")
    return json.loads(lock.read_text())


@pytest.fixture(scope="session")
def generic_graph(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return concretize("generic", tmp_path_factory.mktemp("spack-generic"))


@pytest.fixture(scope="session")
def derecho_graph(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return concretize("derecho", tmp_path_factory.mktemp("spack-derecho"))


def nodes(graph: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return graph["concrete_specs"]


def only(graph: dict[str, Any], name: str) -> dict[str, Any]:
    found = [n for n in nodes(graph).values() if n["name"] == name]
    assert len(found) == 1, f"{len(found)} nodes named {name} in the graph"
    return found[0]


def check_graph(graph: dict[str, Any], mpi_provider: str) -> None:
    """Versions from the tables, the variants we need, our patch applied, one MPI for everything."""
    names = spack_yaml_specs()
    row = table_row(pinned(names["py-torch"]))
    torch = only(graph, "py-torch")
    assert torch["version"] == row["torch"] and torch["namespace"] == "torchhpc"
    params = torch["parameters"]
    for variant in ("cuda", "cudnn", "mpi", "nccl", "gloo", "distributed"):
        assert params[variant] is True, f"py-torch concretized with ~{variant}"
    (patch_dir,) = {row["patches"]}
    ours = [hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted((ROOT / "patches/pytorch" / patch_dir)
                                                                        .glob("*.patch"))]
    assert ours and set(ours) <= set(params.get("patches", [])), "our patch is not among py-torch's patches"
    assert only(graph, "nccl")["version"].split("-")[0] == row["nccl"]
    assert only(graph, "aws-ofi-nccl")["version"] == row["aws_ofi_nccl"]
    assert only(graph, "cuda")["version"].startswith(row["cuda"] + ".")
    assert only(graph, "cudnn")["version"].startswith(row["cudnn"] + ".")
    assert only(graph, "python")["version"].startswith(row["python"] + ".")
    assert only(graph, "gloo")
    for name, version in native_versions().items():
        assert only(graph, name)["version"] == version, name
    assert only(graph, "py-torchhpc")["parameters"]["cuda"] is True
    # One MPI: every edge that satisfies `mpi` points at the same node, the site's provider.
    targets = {dep["hash"] for node in nodes(graph).values() for dep in node.get("dependencies", [])
               if "mpi" in dep.get("parameters", {}).get("virtuals", [])}
    assert len(targets) == 1, f"{len(targets)} MPI providers in the graph"
    assert nodes(graph)[targets.pop()]["name"] == mpi_provider
    users = {n["name"] for n in nodes(graph).values() for d in n.get("dependencies", [])
             if "mpi" in d.get("parameters", {}).get("virtuals", [])}
    assert {"py-torch", "py-mpi4py", "xbraid", "aws-ofi-nccl"} <= users


@SPACK
def test_pinned_spack_concretizes_the_generic_site(generic_graph: dict[str, Any]) -> None:
    check_graph(generic_graph, "openmpi")


@SPACK
def test_pinned_spack_concretizes_derecho_with_its_cray_externals(derecho_graph: dict[str, Any]) -> None:
    check_graph(derecho_graph, "cray-mpich")
    mpich = only(derecho_graph, "cray-mpich")
    assert mpich["version"] == "8.1.27" and mpich.get("external", {}).get("path", "").startswith("/opt/cray")
    fabric = only(derecho_graph, "libfabric")
    assert fabric.get("external") and "cxi" in fabric["parameters"]["fabrics"]


@SPACK
def test_fake_install_walks_the_whole_generic_graph(generic_graph: dict[str, Any], tmp_path: Path) -> None:
    """`spack install --fake` of the concretized generic graph: every package's install step runs (faked,
    nothing is downloaded or built), so the graph is installable as a whole."""
    build = ROOT / "build"
    shutil.copy(build / "spack-generic.lock", ROOT / "spack.lock")
    proc = subprocess.run(["bash", "utils/spack_env.sh", "fake-install"], cwd=ROOT, capture_output=True, text=True,
                          timeout=2400, env={**spack_env(tmp_path), "SITE": "generic"})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    spack = build / "spack/spack/bin/spack"
    env = {**spack_env(tmp_path), "SPACK_DISABLE_LOCAL_CONFIG": "1",
           "SPACK_USER_CACHE_PATH": str(build / "spack-cache"), "SPACK_PYTHON": sys.executable}
    found = subprocess.run([str(spack), "-e", str(ROOT), "find", "--format", "{name}@{version}"], cwd=ROOT,
                           capture_output=True, text=True, timeout=600, env=env)
    assert found.returncode == 0, found.stderr
    installed = set(found.stdout.split())
    # Every node of the graph is in the store (externals registered, the rest fake-installed).
    assert installed == {f"{n['name']}@{n['version']}" for n in nodes(generic_graph).values()}
    assert "py-torch@2.13.0" in installed and "py-torchhpc@0.1.0" in installed
