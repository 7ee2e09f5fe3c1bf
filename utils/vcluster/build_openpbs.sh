#!/usr/bin/env bash
# Build OpenPBS (the open-source PBS Professional: server, scheduler, comm, mom and the q* commands) for the
# virtual cluster's PBS (vcluster.sh up N pbs).  Source: the pinned upstream commit below, from
# OPENPBS_SOURCES/openpbs-<short>.tar.gz when that archive exists (CI: ../shared/vendor), else GitHub's
# archive of that commit.  Installs into OPENPBS_PREFIX (default $TORCHHPC_PREFIX/openpbs, i.e.
# build/openpbs); a stamp there makes a re-run a no-op.  About 100 s on 2 cores.
#
# Debian packages (the lines below are read by tests/test_ci_packages.py against .ci/debian-packages):
# build: gcc make libtool autoconf automake libhwloc-dev libedit-dev libical-dev libncurses-dev libssl-dev
# build: libcjson-dev libexpat1-dev tcl-dev tk-dev swig python3-dev postgresql-server-dev-all libx11-dev
# build: libxt-dev libxext-dev libxft-dev
# run: postgresql sendmail-bin
# (postgresql is the server's datastore.)  A missing tool exits 3 ("cannot build here") for the tests to skip.
set -euo pipefail

# openpbs/openpbs master of 2026-04-10; it reports 23.06.06.  The v23.06.06 tag itself does not build with
# Python 3.11 (eval.h); see ../shared/vendor/README.md.
OPENPBS_COMMIT=cd7ab5edaf03dcac2f1cb9e2f42d75eb117d468a
# utils/tree_sha256.py of that commit's archive (its files, whatever the packing): a download must match it
OPENPBS_TREE_SHA256=dbe2a181316d14945f35fbc35c81d2906da8c1b9ddffbf6273640d8cc60b7433
short=${OPENPBS_COMMIT:0:9}

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
prefix=${TORCHHPC_PREFIX:-$repo/build}
dest=${OPENPBS_PREFIX:-$prefix/openpbs}
sources=${OPENPBS_SOURCES:-$(cd "$repo/.." && pwd)/shared/vendor}
src="$prefix/src/openpbs-$short"
stamp="$dest/.torchhpc-openpbs-$short"

unfit() { printf 'openpbs: cannot build here: %s\n' "$*" >&2; exit 3; }
say() { printf 'openpbs: %s\n' "$*" >&2; }

if [[ -f "$stamp" && -x "$dest/sbin/pbs_server" ]]; then
  say "already built: $dest (commit $short)"
  exit 0
fi
for tool in gcc make autoconf automake libtoolize pkg-config swig; do
  command -v "$tool" >/dev/null || unfit "'$tool' not found (apt-get install the packages in the header of $0)"
done
for header in /usr/include/libical/ical.h /usr/include/cjson/cJSON.h /usr/include/tcl/tcl.h \
  /usr/include/hwloc.h /usr/include/expat.h; do
  [[ -f "$header" ]] || unfit "$header not found (apt-get install the packages in the header of $0)"
done
command -v pg_config >/dev/null || unfit "pg_config not found (apt-get install postgresql-server-dev-all)"
# The system's Python and its python3-config, named: configure otherwise takes the first `python` on PATH, and
# an active venv's has no python3-config beside it (no include flags: "Python.h: No such file").
[[ -x /usr/bin/python3-config ]] || unfit "/usr/bin/python3-config not found (apt-get install python3-dev)"

archive="$sources/openpbs-$short.tar.gz"
rm -rf "$src" "$src.tmp"
mkdir -p "$src.tmp"
if [[ -f "$archive" ]]; then
  say "source: $archive"
else
  url="https://github.com/openpbs/openpbs/archive/$OPENPBS_COMMIT.tar.gz"
  say "source: $url (no $archive)"
  command -v curl >/dev/null || unfit "no $archive and no curl to fetch $url"
  archive="$prefix/src/openpbs-$short.download.tar.gz"
  curl -fsSL -o "$archive" "$url" || unfit "could not fetch $url"
fi
# a wrong archive is an error, not "cannot build here": a test must not skip past it
got=$(python3 "$repo/utils/tree_sha256.py" "$archive") || { say "cannot read $archive"; exit 1; }
[[ "$got" == "$OPENPBS_TREE_SHA256" ]] \
  || { say "$archive is not OpenPBS $OPENPBS_COMMIT: its files hash to $got, expected $OPENPBS_TREE_SHA256"; exit 1; }
tar xzf "$archive" -C "$src.tmp"
top=$(find "$src.tmp" -mindepth 1 -maxdepth 1 -type d)
[[ -f "$top/configure.ac" && -f "$top/src/server/pbsd_main.c" ]] || { say "$archive does not hold an OpenPBS tree"; exit 1; }
mv "$top" "$src"
rm -rf "$src.tmp"

cd "$src"
log="$src/torchhpc-build.log"
say "building in $src (log: $log) into $dest"
{
  ./autogen.sh
  ./configure --prefix="$dest" --with-python=/usr
  make -j"$(nproc)"
  rm -rf "$dest"
  make install
} >"$log" 2>&1 || { tail -n 30 "$log" >&2; say "build failed (whole log: $log)"; exit 1; }
printf 'openpbs %s\nsource %s\n' "$OPENPBS_COMMIT" "${archive}" >"$stamp"
say "built $("$dest/bin/qstat" --version 2>/dev/null || echo "OpenPBS $short") into $dest"
