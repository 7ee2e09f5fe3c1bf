# shellcheck shell=bash
# Helpers shared by the native build scripts (utils/native/build_<part>.sh, run by `make native-<part>`).
#
# Inputs (environment, set by the Makefile):
#   NATIVE_PREFIX   install prefix of the native libraries and extension modules   ($VENV/native)
#   NATIVE_SOURCES  directory of source archives named as in utils/native_versions.tsv; empty: download
#                   each from its upstream GitHub tag (the Makefile fills in ../shared/vendor when present)
#   NATIVE_JOBS     parallel build jobs                                            (nproc)
#   PYTHON          the environment's interpreter, for extension modules          ($VENV/bin/python)
#
# Every archive is verified before use: its files must hash to the table's tree_sha256 (utils/tree_sha256.py),
# whether it came from NATIVE_SOURCES or from GitHub.  Each finished step writes
# a stamp under $NATIVE_PREFIX/stamps holding what it was built from; a re-run whose stamp matches skips it.
#
# Layout under NATIVE_PREFIX: include/ lib/ (libraries), src/<name>-<version>/ (unpacked sources, build
# trees), stamps/, python/ (extension modules; the environment finds them through a .pth file).

# shellcheck source=utils/lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib/common.sh"

NATIVE_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
NATIVE_TABLE="$NATIVE_ROOT/utils/native_versions.tsv"
VENV=${VENV:-.venv}
NATIVE_PREFIX=${NATIVE_PREFIX:-$VENV/native}
mkdir -p "$NATIVE_PREFIX"
NATIVE_PREFIX=$(cd "$NATIVE_PREFIX" && pwd)
NATIVE_SOURCES=${NATIVE_SOURCES:-}
NATIVE_JOBS=${NATIVE_JOBS:-$(nproc 2>/dev/null || echo 2)}
PYTHON=${PYTHON:-$VENV/bin/python}
export PKG_CONFIG_PATH="$NATIVE_PREFIX/lib/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
export CMAKE_PREFIX_PATH="$NATIVE_PREFIX${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"

native_die() { printf '%s: error: %s\n' "${0##*/}" "$*" >&2; exit 1; }

# native_row NAME: set ROW_VERSION ROW_UPSTREAM ROW_TAG ROW_COMMIT ROW_ARCHIVE ROW_SHA256 from the versions table.
native_row() {
  local line
  line=$(awk -F'\t' -v n="$1" '!/^#/ && $1 == n' "$NATIVE_TABLE")
  [[ -n "$line" ]] || native_die "'$1' has no row in $NATIVE_TABLE"
  IFS=$'\t' read -r _ ROW_VERSION _ ROW_UPSTREAM ROW_TAG ROW_COMMIT ROW_ARCHIVE ROW_SHA256 <<<"$line"
  [[ "$ROW_COMMIT" =~ ^[0-9a-f]{40}$ ]] || native_die "row '$1' of $NATIVE_TABLE has no 40-digit commit"
  [[ "$ROW_SHA256" =~ ^[0-9a-f]{64}$ ]] || native_die "row '$1' of $NATIVE_TABLE has no tree_sha256"
}

# native_require LABEL:CHECK:DEBIAN ...: fail listing every missing build dependency at once.
# CHECK is `cmd=<program>`, `pc=<pkg-config module>` or `h=<header under /usr/include or the prefix>`.
native_require() {
  local spec label check deb missing=() debs=()
  for spec in "$@"; do
    IFS=: read -r label check deb <<<"$spec"
    case "$check" in
      cmd=*) command -v "${check#cmd=}" >/dev/null && continue ;;
      pc=*) command -v pkg-config >/dev/null && pkg-config --exists "${check#pc=}" && continue ;;
      h=*) [[ -e "/usr/include/${check#h=}" || -e "/usr/local/include/${check#h=}" \
              || -e "$NATIVE_PREFIX/include/${check#h=}" ]] && continue ;;
    esac
    missing+=("$label")
    debs+=("$deb")
  done
  if ((${#missing[@]})); then
    native_die "missing build dependencies: ${missing[*]}.  On Debian/Ubuntu: apt-get install ${debs[*]}" \
      "(the list CI installs is .ci/debian-packages); elsewhere load the equivalent modules."
  fi
}

# native_fetch NAME: print the path of NAME's verified source archive (from NATIVE_SOURCES, else downloaded
# from GitHub into $NATIVE_PREFIX/src/archives).
native_fetch() {
  native_row "$1"
  local archive="" url got
  if [[ -n "$NATIVE_SOURCES" ]]; then
    [[ -d "$NATIVE_SOURCES" ]] || native_die "NATIVE_SOURCES=$NATIVE_SOURCES is not a directory"
    archive="$NATIVE_SOURCES/$ROW_ARCHIVE"
    [[ -f "$archive" ]] || archive=""
  fi
  if [[ -z "$archive" ]]; then
    archive="$NATIVE_PREFIX/src/archives/$ROW_ARCHIVE"
    if [[ ! -f "$archive" ]]; then
      url="https://github.com/$ROW_UPSTREAM/archive/$ROW_COMMIT.tar.gz"
      command -v curl >/dev/null || native_die "curl is needed to download $url (or set NATIVE_SOURCES)"
      mkdir -p "${archive%/*}"
      step "downloading $1 $ROW_VERSION ($ROW_TAG) from $url" >&2
      curl -fsSL --retry 3 -o "$archive.part" "$url" \
        || native_die "download of $url failed; put $ROW_ARCHIVE into a directory and pass NATIVE_SOURCES=<dir>"
      mv "$archive.part" "$archive"
    fi
  fi
  got=$("$PYTHON" "$NATIVE_ROOT/utils/tree_sha256.py" "$archive") || native_die "cannot read $archive"
  [[ "$got" == "$ROW_SHA256" ]] \
    || native_die "$archive is not $1 $ROW_TAG ($ROW_COMMIT): its files hash to $got, the table pins $ROW_SHA256"
  printf '%s\n' "$archive"
}

# native_unpack NAME: fetch, verify and unpack NAME into a fresh $NATIVE_PREFIX/src/<name>-<version>;
# sets NATIVE_SRC to that directory.
native_unpack() {
  local archive
  archive=$(native_fetch "$1")
  native_row "$1"
  NATIVE_SRC="$NATIVE_PREFIX/src/$1-$ROW_VERSION"
  rm -rf "$NATIVE_SRC"
  mkdir -p "$NATIVE_SRC"
  tar xzf "$archive" -C "$NATIVE_SRC" --strip-components=1
}

# native_stamp_ok NAME CONTENT / native_stamp_write NAME CONTENT: skip a step already built from CONTENT.
native_stamp_ok() { [[ -f "$NATIVE_PREFIX/stamps/$1" && "$(cat "$NATIVE_PREFIX/stamps/$1")" == "$2" ]]; }
native_stamp_write() { mkdir -p "$NATIVE_PREFIX/stamps"; printf '%s\n' "$2" >"$NATIVE_PREFIX/stamps/$1"; }

# native_build NAME STAMP_EXTRA BUILD_FUNCTION: unpack NAME and run BUILD_FUNCTION inside its sources,
# unless its stamp (version, commit, prefix, STAMP_EXTRA) says it is already installed.
native_build() {
  local name=$1 extra=$2 fn=$3 want t0
  native_row "$name"
  want="$name $ROW_VERSION $ROW_COMMIT prefix=$NATIVE_PREFIX $extra"
  if native_stamp_ok "$name" "$want"; then
    step "$name $ROW_VERSION is installed in $NATIVE_PREFIX (stamp matches)"
    return 0
  fi
  step "building $name $ROW_VERSION ($ROW_UPSTREAM $ROW_TAG) into $NATIVE_PREFIX"
  t0=$SECONDS
  native_unpack "$name"
  (cd "$NATIVE_SRC" && "$fn")
  native_stamp_write "$name" "$want"
  step "$name $ROW_VERSION done in $((SECONDS - t0)) s"
}

# native_cmake [cmake options...]: configure, build and install the CMake project in the current directory.
native_cmake() {
  run cmake -S . -B build -DCMAKE_INSTALL_PREFIX="$NATIVE_PREFIX" -DCMAKE_PREFIX_PATH="$NATIVE_PREFIX" \
    -DCMAKE_INSTALL_LIBDIR=lib -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_RPATH="$NATIVE_PREFIX/lib" "$@"
  run cmake --build build --parallel "$NATIVE_JOBS"
  run cmake --install build
}

# native_python_dir: where extension modules go; a .pth file in the environment's site-packages points
# there, so `import <module>` finds them with no PYTHONPATH.
native_python_dir() {
  local dir="$NATIVE_PREFIX/python" site
  mkdir -p "$dir"
  site=$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  printf '%s\n' "$dir" >"$site/torchhpc-native.pth"
  printf '%s\n' "$dir"
}

# native_extension MODULE "SOURCES..." "COMPILE+LINK FLAGS..." [STAMP_EXTRA]: build a pybind11 extension
# module MODULE into native_python_dir, unless its stamp (sources' contents, flags, compiler, extra) matches.
native_extension() {
  local module=$1 sources=$2 flags=$3 extra=${4:-} dir out want includes suffix cxx=${CXX:-c++} t0
  "$PYTHON" -c 'import pybind11' 2>/dev/null \
    || native_die "pybind11 is not installed in $PYTHON's environment (it is pinned in requirements.lock: run make env)"
  dir=$(native_python_dir)
  suffix=$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
  out="$dir/$module$suffix"
  # shellcheck disable=SC2086  # sources and flags are word lists
  want="$(cd "$NATIVE_ROOT" && cat $sources | sha256sum | cut -c1-16) $cxx $flags $extra"
  if [[ -f "$out" ]] && native_stamp_ok "ext-$module" "$want"; then
    step "extension $module is up to date ($out)"
    return 0
  fi
  includes=$("$PYTHON" -m pybind11 --includes)
  step "building extension $module"
  t0=$SECONDS
  # shellcheck disable=SC2086
  (cd "$NATIVE_ROOT" && run "$cxx" -O2 -std=c++17 -shared -fPIC -fvisibility=hidden $includes $sources \
    -o "$out.tmp" $flags -Wl,-rpath,"$NATIVE_PREFIX/lib")
  mv "$out.tmp" "$out"
  native_stamp_write "ext-$module" "$want"
  step "extension $module done in $((SECONDS - t0)) s: $out"
}
