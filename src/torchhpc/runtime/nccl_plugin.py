"""Which NCCL network plugin NCCL would load here, and whether it fits the NCCL in use (no GPU needed).

Mirrors NCCL's own rules (NVIDIA/nccl ``src/plugin/net.cc`` and ``src/plugin/plugin_open.cc``):

* ``NCCL_NET_PLUGIN`` unset: NCCL dlopens ``libnccl-net.so`` (the loader's search: LD_LIBRARY_PATH, ...).
  Set: a comma-separated list, each NAME dlopened as given, then as ``libnccl-net-NAME.so`` (unless NAME has a
  ``/`` or is already ``lib*.so``); ``none`` means no external plugin.  A file that is not there is skipped
  quietly; one that fails to load (a missing dependency) is reported.
* From the library it opened, NCCL takes the newest ``ncclNetPlugin_vN`` symbol of the versions it knows
  (found here by reading the NCCL library itself), and the plugin's ``name`` field from that struct.
* ``NCCL_NET`` then picks a network by that name, case-insensitively, among the plugin, ``IB`` and ``Socket``;
  no match is NCCL's "Failed to initialize any NET plugin".  Unset: the plugin first, then IB, then Socket.

The dlopen happens in a child process (``python -m torchhpc.runtime.nccl_plugin NAME...``): a plugin's constructors
and its libfabric stay out of the caller, whose own MPI may bundle a different libfabric of the same soname.
"""

from __future__ import annotations

import ctypes
import glob
import importlib.util
import json
import mmap
import os
import re
import subprocess
import sys
from collections.abc import Mapping, Sequence

__all__ = ["nccl_library", "nccl_plugin_versions", "probe", "diagnose"]

NET_PLUGIN_SYMBOL = re.compile(rb"ncclNetPlugin_v(\d+)\x00")
NCCL_VERSION = re.compile(rb"NCCL version (\d+\.\d+\.\d+)")
INTERNAL_NETS = ("IB", "Socket")
RTLD_DI_LINKMAP = 2


def nccl_library(environ: Mapping[str, str] | None = None) -> str | None:
    """The libnccl NCCL would be: TORCHHPC_NCCL_LIB, torch's nvidia-nccl wheel, the site build, LD_LIBRARY_PATH."""
    env = os.environ if environ is None else environ
    candidates = [env.get("TORCHHPC_NCCL_LIB", "")]
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except (ImportError, ValueError):
        spec = None
    for base in (spec.submodule_search_locations or []) if spec else []:
        candidates.append(os.path.join(base, "lib", "libnccl.so.2"))
    if env.get("NCCL_OFI_PREFIX"):
        candidates.append(os.path.join(env["NCCL_OFI_PREFIX"], "lib", "libnccl.so.2"))
    for d in env.get("LD_LIBRARY_PATH", "").split(":"):
        if d:
            candidates += sorted(glob.glob(os.path.join(d, "libnccl.so*")))
    return next((c for c in candidates if c and os.path.isfile(c)), None)


def nccl_plugin_versions(library: str) -> tuple[str, list[int]]:
    """NCCL's version and the ncclNetPlugin_vN versions it asks a plugin for, newest (tried first) first."""
    with open(library, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped, \
            memoryview(mapped) as data:
        wanted = sorted({int(m.group(1)) for m in NET_PLUGIN_SYMBOL.finditer(data)}, reverse=True)
        version = NCCL_VERSION.search(data)
        found = version.group(1).decode() if version else "?"
    return found, wanted


class _LinkMap(ctypes.Structure):
    _fields_ = [("l_addr", ctypes.c_void_p), ("l_name", ctypes.c_char_p)]


def _loaded_path(lib: ctypes.CDLL, name: str) -> str:
    """The file the dynamic loader opened (dlinfo RTLD_DI_LINKMAP, as NCCL reports it), else ``name``."""
    try:
        link = ctypes.POINTER(_LinkMap)()
        if ctypes.CDLL(None).dlinfo(ctypes.c_void_p(lib._handle), RTLD_DI_LINKMAP, ctypes.byref(link)) == 0:
            return (link.contents.l_name or name.encode()).decode()
    except (AttributeError, OSError, ValueError):
        pass
    return name


def probe(names: Sequence[str], wanted: Sequence[int] = ()) -> dict[str, object]:
    """In this process, dlopen ``names`` as NCCL would; report the first that opens, its symbols and name."""
    tried: list[str] = []
    for name in names:
        candidates = [name]
        if "/" not in name and not (name.startswith("lib") and name.endswith(".so")):
            candidates.append(f"libnccl-net-{name}.so")
        for candidate in candidates:
            tried.append(candidate)
            try:
                lib = ctypes.CDLL(candidate, mode=os.RTLD_NOW | os.RTLD_LOCAL)
            except OSError as exc:
                if str(exc).startswith(f"{candidate}: cannot open shared object file"):
                    continue  # not there: NCCL moves on quietly
                return {"tried": tried, "error": str(exc)}
            exported = [v for v in range(2, 64) if _has_symbol(lib, f"ncclNetPlugin_v{v}")]
            usable = [v for v in (wanted or sorted(exported, reverse=True)) if v in exported]
            result: dict[str, object] = {"tried": tried, "path": _loaded_path(lib, candidate),
                                         "exported": exported, "version": usable[0] if usable else None}
            if usable:
                struct = ctypes.c_void_p.in_dll(lib, f"ncclNetPlugin_v{usable[0]}")
                result["name"] = (ctypes.c_char_p.from_address(ctypes.addressof(struct)).value or b"?").decode()
            return result
    return {"tried": tried}


def _has_symbol(lib: ctypes.CDLL, name: str) -> bool:
    try:
        ctypes.c_void_p.in_dll(lib, name)
    except ValueError:
        return False
    return True


Verdict = tuple[str, str, str]


def _probe_child(names: list[str], wanted: list[int], env: dict[str, str], timeout: float) -> dict | Verdict:
    """:func:`probe` run in a child process with ``env``: its report, or the verdict when the child failed."""
    if not names:
        return {"tried": []}
    cmd = [sys.executable, "-m", "torchhpc.runtime.nccl_plugin", "--wanted", ",".join(map(str, wanted)), *names]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, check=False)
    except subprocess.TimeoutExpired:
        return "fail", f"loading {', '.join(names)} did not finish in {timeout:.0f} s", "check the plugin"
    if proc.returncode != 0:
        return ("fail", f"loading {', '.join(names)} crashed the process (status {proc.returncode}): "
                f"{proc.stderr.strip()[-300:]}", "rebuild the plugin against this system (`make nccl-ofi`)")
    return json.loads(proc.stdout)


def _selection(net: str, name: str, value: str) -> Verdict:
    """What ``NCCL_NET`` makes of a loaded plugin called ``name``."""
    if not net:
        return "ok", value + f"; NCCL tries '{name}' first, then IB, then Socket", ""
    if net.lower() == name.lower():
        return "ok", value + f"; NCCL_NET={net} selects it", ""
    if net.lower() in (n.lower() for n in INTERNAL_NETS):
        return ("warn", value + f"; NCCL_NET={net} selects NCCL's internal transport instead",
                f"unset NCCL_NET or set NCCL_NET='{name}' to use the plugin")
    return ("fail", value + f"; NCCL_NET={net} matches no network (plugin '{name}', IB, Socket)",
            f"NCCL would fail with 'Failed to initialize any NET plugin': set NCCL_NET='{name}'")


def _verdict(found: dict, net: str, nccl_text: str) -> Verdict:
    """The verdict on a probe report ``found``, given ``NCCL_NET`` and the NCCL in use."""
    tried = ", ".join(found["tried"]) or "NCCL_NET_PLUGIN=none"
    if "error" in found:
        return ("fail", f"{found['tried'][-1]}: dlopen failed: {found['error']}",
                "NCCL would skip this plugin: fix its missing libraries (ldd) or rebuild it (`make nccl-ofi`)")
    if "path" not in found:
        if net and net.lower() not in (n.lower() for n in INTERNAL_NETS):
            return ("fail", f"NCCL_NET={net} but no plugin loads (tried {tried}); {nccl_text}",
                    "put the plugin's lib/ on LD_LIBRARY_PATH (`source config_env.sh`) or set NCCL_NET_PLUGIN")
        return "ok", f"none loadable (tried {tried}): NCCL uses its own IB/Socket transports; {nccl_text}", ""
    if found["version"] is None:
        exported = ", ".join(f"v{v}" for v in found["exported"]) or "none"
        return ("fail", f"{found['path']} exports ncclNetPlugin {exported}; {nccl_text}",
                "this plugin does not fit this NCCL: build an aws-ofi-nccl release that does (`make nccl-ofi`)")
    name = str(found["name"])
    value = f"{found['path']}: symbol ncclNetPlugin_v{found['version']}, name '{name}'; {nccl_text}"
    return _selection(net, name, value)


def diagnose(environ: Mapping[str, str] | None = None, timeout: float = 60.0) -> Verdict:
    """(status ok|warn|fail, what NCCL would do, what to change): the plugin probed in a child process."""
    env = dict(os.environ if environ is None else environ)
    setting = env.get("NCCL_NET_PLUGIN")
    names = ["libnccl-net.so"] if setting is None else [n for n in setting.split(",") if n and n.lower() != "none"]
    library = nccl_library(env)
    nccl_version, wanted = nccl_plugin_versions(library) if library else ("?", [])
    nccl_text = (f"NCCL {nccl_version} ({library}) asks for {', '.join(f'v{v}' for v in wanted)}" if library
                 else "no libnccl found (TORCHHPC_NCCL_LIB=<path> names one)")
    found = _probe_child(names, wanted, env, timeout)
    if isinstance(found, tuple):
        return found
    return _verdict(found, env.get("NCCL_NET", ""), nccl_text)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m torchhpc.runtime.nccl_plugin [--wanted 8,7,6] NAME...``: print :func:`probe` as JSON."""
    args = list(sys.argv[1:] if argv is None else argv)
    wanted: list[int] = []
    if args[:1] == ["--wanted"]:
        wanted = [int(v) for v in args[1].split(",") if v]
        args = args[2:]
    print(json.dumps(probe(args or ["libnccl-net.so"], wanted)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
