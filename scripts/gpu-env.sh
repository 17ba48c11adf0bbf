#!/usr/bin/env bash
# A second environment whose llama-cpp-python carries a GPU backend of ggml.
#
#   scripts/gpu-env.sh [vulkan|cuda|rpc] [VENV_DIR]      (defaults: vulkan, .venv-gpu in the repo root)
#
# It makes VENV_DIR (left alone if it already holds a Python), builds a llama-cpp-python wheel of
# the version pyproject.toml pins with that backend switched on (or reuses the one it built before,
# kept in .cache/gpu-wheels/<backend>/), installs it, then installs this project editable with its
# test extras around it, so that pip never swaps the backend wheel for a plain one. Safe to re-run.
#
#   vulkan  -DGGML_VULKAN=on. Needs the Vulkan headers and loader, glslc and a driver; on Debian/Ubuntu
#           as root the script apt-installs them. Mesa's lavapipe (a Vulkan driver on the CPU) works,
#           but ggml-vulkan skips CPU-type devices unless told: GGML_VK_VISIBLE_DEVICES=0.
#   cuda    -DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=${GPU_ENV_CUDA_ARCHS:-90} (90 = H100/H200).
#           nvcc is taken from $CUDACXX, /usr/local/cuda/bin, /usr/local/cuda-*/bin or PATH.
#   rpc     -DGGML_RPC=on (ggml's RPC client backend; a C/C++ compiler is all it needs).
#
# Environment: GPU_ENV_REBUILD=1 rebuilds the wheel even if one is cached; GPU_ENV_VERBOSE=1 shows
# the build's output instead of only writing it to the log; CMAKE_BUILD_PARALLEL_LEVEL (default
# nproc); PYTHON (default python3, 3.11 or newer) makes the venv.
set -euo pipefail

say() { printf 'gpu-env: %s\n' "$*"; }
die() { printf 'gpu-env: error: %s\n' "$*" >&2; exit 1; }

usage="usage: scripts/gpu-env.sh [vulkan|cuda|rpc] [VENV_DIR]"
case "${1:-}" in -h|--help) echo "$usage"; exit 0 ;; esac
[ $# -le 2 ] || die "too many arguments; $usage"
backend=${1:-vulkan}
case "$backend" in
  vulkan|cuda|rpc) ;;
  *) die "unknown backend '$backend'; $usage" ;;
esac

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${2:-$root/.venv-gpu}
case "$venv" in /*) ;; *) venv=$PWD/$venv ;; esac
cache=$root/.cache/gpu-wheels/$backend
log=$cache/last-run.log
python=${PYTHON:-python3}
t_start=$SECONDS

command -v "$python" >/dev/null || die "$python not found (set PYTHON to a Python 3.11+)"
"$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || die "$python is older than 3.11 (pyproject needs 3.11+; set PYTHON)"
[ -f "$root/pyproject.toml" ] || die "no pyproject.toml in $root"
mkdir -p "$cache" || die "cannot create $cache"

# Quiet steps: output goes to the log; a failure names the step and the log in one line.
run() {
  local what=$1; shift
  local rc=0
  if [ "${GPU_ENV_VERBOSE:-0}" = 1 ]; then
    "$@" 2>&1 | tee -a "$log" || rc=${PIPESTATUS[0]}
  else
    "$@" >>"$log" 2>&1 || rc=$?
  fi
  [ "$rc" -eq 0 ] || die "$what failed (exit $rc); its output is in $log"
}

# One run at a time per backend: a second one waits instead of building the same wheel twice.
if command -v flock >/dev/null; then
  exec 9>"$cache/.lock"
  flock -n 9 || { say "another gpu-env.sh run holds $cache; waiting for it"; flock 9; }
fi
: >"$log"

# Everything pyproject.toml asks for, read with tomllib: the pinned llama-cpp-python version and the
# other requirements (dependencies plus the test extra), one per line.
read_project() {
  "$python" - "$root/pyproject.toml" "$1" <<'PY'
import re, sys, tomllib
with open(sys.argv[1], "rb") as f:
    project = tomllib.load(f)["project"]
reqs = project.get("dependencies", []) + project.get("optional-dependencies", {}).get("test", [])
def name(req):
    return re.split(r"[\s<>=!~;\[(@]", req, maxsplit=1)[0].lower().replace("_", "-")
if sys.argv[2] == "version":
    pins = [r for r in reqs if name(r) == "llama-cpp-python"]
    m = re.fullmatch(r"llama[-_]cpp[-_]python\s*==\s*([0-9][0-9A-Za-z.+-]*)", pins[0].strip()) if pins else None
    print(m.group(1) if m else "")
else:
    print("\n".join(r for r in reqs if name(r) != "llama-cpp-python"))
PY
}
version=$(read_project version) || die "cannot read $root/pyproject.toml"
[ -n "$version" ] || die "pyproject.toml does not pin llama-cpp-python exactly (want llama-cpp-python==X.Y.Z)"
mapfile -t other_reqs < <(read_project others)

# ---- what each backend needs on the system, and its CMake switches ------------------------------
need_debs() {  # install missing Debian packages when we can; otherwise say which are missing
  local missing=() p
  command -v dpkg >/dev/null || return 0
  for p in "$@"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    die "missing system packages: ${missing[*]} (install them as root: apt-get install ${missing[*]})"
  fi
  say "installing system packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq "${missing[@]}" >>"$log" 2>&1 \
    || { apt-get update -qq >>"$log" 2>&1 && apt-get install -y -qq "${missing[@]}" >>"$log" 2>&1; } \
    || die "apt-get could not install ${missing[*]}; see $log"
}

# Debian 12's Mesa (22.3) lavapipe crashes in its queue thread when two slices on one Vulkan device
# take turns (seen: a segfault inside libvulkan_lvp.so, any buffer policy); bookworm-backports' Mesa
# 25.0 runs the same sequence cleanly. As root on bookworm, take lavapipe from backports.
newer_lavapipe() {
  local have
  have=$(dpkg-query -W -f='${Version}' mesa-vulkan-drivers 2>/dev/null) || return 0
  dpkg --compare-versions "$have" ge 25 && return 0
  grep -qs 'VERSION_CODENAME=bookworm' /etc/os-release || { say "Mesa $have: lavapipe older than 25.0 may crash (see README)"; return 0; }
  if [ "$(id -u)" != 0 ]; then
    say "warning: Mesa $have's lavapipe crashes on multi-slice runs; as root: apt-get install -t bookworm-backports mesa-vulkan-drivers"
    return 0
  fi
  if ! grep -rqs 'bookworm-backports' /etc/apt/sources.list /etc/apt/sources.list.d/; then
    say "adding bookworm-backports to apt's sources (for Mesa 25's lavapipe)"
    printf 'Types: deb\nURIs: http://deb.debian.org/debian\nSuites: bookworm-backports\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
      >/etc/apt/sources.list.d/swarmctl-bookworm-backports.sources
  fi
  say "installing mesa-vulkan-drivers from bookworm-backports (Mesa $have's lavapipe crashes)"
  export DEBIAN_FRONTEND=noninteractive
  { apt-get update -qq && apt-get install -y -qq -t bookworm-backports mesa-vulkan-drivers; } >>"$log" 2>&1 \
    || die "could not install mesa-vulkan-drivers from bookworm-backports; see $log"
}

find_nvcc() {
  local c
  for c in "${CUDACXX:-}" /usr/local/cuda/bin/nvcc $(ls -d /usr/local/cuda-*/bin/nvcc 2>/dev/null | sort -rV) \
           "$(command -v nvcc 2>/dev/null || true)"; do
    [ -n "$c" ] && [ -x "$c" ] || continue
    # A wrapper script (such as /usr/local/bin/nvcc calling the real one) would point CMake at the
    # wrong toolkit root; the real binary sits next to the toolkit's include/ and lib64/.
    c=$(readlink -f "$c")
    [ -f "$(dirname "$c")/../include/cuda_runtime.h" ] && { echo "$c"; return 0; }
  done
  return 1
}

command -v c++ >/dev/null || command -v g++ >/dev/null || command -v clang++ >/dev/null \
  || need_debs build-essential
case "$backend" in
  vulkan)
    need_debs mesa-vulkan-drivers libvulkan-dev glslc glslang-tools spirv-headers
    newer_lavapipe
    command -v glslc >/dev/null || die "glslc (the GLSL to SPIR-V compiler) is not on PATH"
    [ -f /usr/include/vulkan/vulkan.hpp ] || [ -n "${VULKAN_SDK:-}" ] \
      || die "Vulkan headers not found (install libvulkan-dev or set VULKAN_SDK)"
    cmake_args="-DGGML_VULKAN=on"
    lib=libggml-vulkan.so
    ;;
  cuda)
    nvcc=$(find_nvcc) || die "nvcc not found (set CUDACXX, or install the CUDA toolkit in /usr/local/cuda)"
    export CUDACXX=$nvcc CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$nvcc")")}
    export PATH=$(dirname "$nvcc"):$PATH
    say "using nvcc $nvcc ($("$nvcc" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p'))"
    cuda_root=$(dirname "$(dirname "$nvcc")")
    cuda_major=$("$nvcc" --version | sed -n 's/.*release \([0-9]*\)\..*/\1/p')
    cmake_args="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=${GPU_ENV_CUDA_ARCHS:-90}"
    # ggml-cuda links the driver library (libcuda) for its virtual-memory pool. A build machine
    # without a driver may also lack the toolkit's link stubs; then build without that pool
    # (GGML_CUDA_NO_VMM: plain cudaMalloc, which works on every GPU) rather than not at all.
    if ! ls "$cuda_root"/lib64/stubs/libcuda.so "$cuda_root"/targets/*/lib/stubs/libcuda.so \
            "$cuda_root"/lib64/libcuda.so >/dev/null 2>&1 \
       && ! { command -v ldconfig >/dev/null && ldconfig -p | grep -q 'libcuda\.so '; }; then
      say "no libcuda.so (driver or toolkit stub) to link: building with -DGGML_CUDA_NO_VMM=on"
      cmake_args="$cmake_args -DGGML_CUDA_NO_VMM=on"
    fi
    lib=libggml-cuda.so
    ;;
  rpc)
    cmake_args="-DGGML_RPC=on"
    lib=libggml-rpc.so
    ;;
esac

# ---- the venv -----------------------------------------------------------------------------------
if [ -x "$venv/bin/python" ]; then
  say "reusing venv $venv"
else
  say "creating venv $venv"
  run "creating the venv" "$python" -m venv "$venv"
  run "upgrading pip in the venv" "$venv/bin/python" -m pip install -q --upgrade pip
fi
vpip=("$venv/bin/python" -m pip)

# ---- cuBLAS: ggml-cuda needs it; a toolkit installed without its math libraries lacks it ----------
# NVIDIA publishes cuBLAS on PyPI (nvidia-cublas for CUDA 13, nvidia-cublas-cu12 before); install it
# into the venv and point CMake at it. At run time its directory must then be on LD_LIBRARY_PATH
# (the script prints the line); a toolkit with cuBLAS needs none of this.
cuda_libpath=
if [ "$backend" = cuda ] && [ ! -f "$cuda_root/include/cublas_v2.h" ]; then
  if [ "$cuda_major" -ge 13 ]; then cublas_pkg="nvidia-cublas>=$cuda_major,<$((cuda_major + 1))"
  else cublas_pkg="nvidia-cublas-cu$cuda_major"; fi
  say "the CUDA toolkit in $cuda_root has no cuBLAS; installing $cublas_pkg from PyPI into the venv"
  run "installing $cublas_pkg" "${vpip[@]}" install -q "$cublas_pkg"
  cublas_dir=$("$venv/bin/python" - <<'PY' 2>>"$log"
import glob, importlib.util, os
spec = importlib.util.find_spec("nvidia")
roots = list(spec.submodule_search_locations) if spec else []
hits = [h for r in roots for h in glob.glob(os.path.join(r, "*", "include", "cublas_v2.h"))]
print(os.path.dirname(os.path.dirname(hits[0])) if hits else "")
PY
  ) || true
  [ -n "$cublas_dir" ] || die "$cublas_pkg installed no cublas_v2.h; see $log"
  # CMake looks for libcublas.so; the wheel ships only the versioned names.
  mkdir -p "$cache/cublas-link"
  for l in cublas cublasLt; do
    so=$(ls "$cublas_dir"/lib/lib$l.so.* 2>/dev/null | head -n1) || true
    [ -n "$so" ] || die "no lib$l.so.* in $cublas_dir/lib"
    ln -sf "$so" "$cache/cublas-link/lib$l.so"
  done
  cmake_args="$cmake_args -DCUDA_cublas_LIBRARY=$cache/cublas-link/libcublas.so"
  cmake_args="$cmake_args -DCUDA_cublasLt_LIBRARY=$cache/cublas-link/libcublasLt.so"
  cmake_args="$cmake_args -DCMAKE_CUDA_FLAGS=-I$cublas_dir/include -DCMAKE_CXX_FLAGS=-I$cublas_dir/include"
  cuda_libpath=$cublas_dir/lib:$cuda_root/lib64
  export LD_LIBRARY_PATH=$cuda_libpath${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi

# ---- the wheel: cached per backend, keyed by version and CMake switches --------------------------
key="llama-cpp-python==$version $cmake_args"
wheel=
if [ "${GPU_ENV_REBUILD:-0}" != 1 ] && [ -f "$cache/wheel.key" ] && [ "$(cat "$cache/wheel.key")" = "$key" ]; then
  wheel=$(ls "$cache"/llama_cpp_python-"$version"-*.whl 2>/dev/null | head -n1 || true)
fi
build_s=
if [ -n "$wheel" ]; then
  say "reusing cached wheel $wheel"
else
  say "building llama-cpp-python $version with $cmake_args (log: $log); this takes a while"
  work=$(mktemp -d "$cache/build.XXXXXX")
  trap 'rm -rf "$work"' EXIT
  t_build=$SECONDS
  run "downloading the llama-cpp-python $version sdist" \
    "${vpip[@]}" download -q --no-deps --no-binary :all: --no-cache-dir -d "$work" "llama-cpp-python==$version"
  sdist=$(ls "$work"/llama_cpp_python-"$version".tar.gz 2>/dev/null) || die "pip fetched no sdist of llama-cpp-python $version"
  run "unpacking the sdist" tar -xzf "$sdist" -C "$work"
  src=$work/llama_cpp_python-$version
  if [ "$backend" = vulkan ]; then
    # The vendored ggml-vulkan.cpp hands VK_EXT_layer_settings structs (validation-layer options)
    # to vkCreateInstance; Vulkan headers older than 1.3.268 (Debian 12 has 1.3.239) do not define
    # them. Fence that block with the extension's own macro, so older headers compile the plain
    # instance creation and newer ones keep the original.
    "$venv/bin/python" - "$src/vendor/llama.cpp/ggml/src/ggml-vulkan/ggml-vulkan.cpp" <<'PY' >>"$log" 2>&1 \
      || die "patching ggml-vulkan.cpp failed; see $log"
import sys
path = sys.argv[1]
with open(path) as f:
    lines = f.read().split("\n")
first = next((i for i, l in enumerate(lines) if l.strip().startswith("VkBool32 enable_best_practice")), None)
last = next((i for i, l in enumerate(lines) if first is not None and i > first
             and "vk::InstanceCreateInfo instance_create_info(" in l and "&layer_setting_info" in l), None)
if first is None or last is None:
    print("gpu-env: no layer-settings block in ggml-vulkan.cpp; building it as it is")
    sys.exit(0)
indent = lines[last][: len(lines[last]) - len(lines[last].lstrip())]
plain = indent + "vk::InstanceCreateInfo instance_create_info(vk::InstanceCreateFlags{}, &app_info, layers, extensions);"
lines[first:last + 1] = ["#ifdef VK_EXT_layer_settings", *lines[first:last + 1], "#else", plain, "#endif"]
with open(path, "w") as f:
    f.write("\n".join(lines))
print(f"gpu-env: fenced ggml-vulkan.cpp lines {first + 1}-{last + 1} with #ifdef VK_EXT_layer_settings")
PY
  fi
  export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
  export CMAKE_ARGS=$cmake_args
  run "building the $backend wheel" \
    "${vpip[@]}" wheel --no-deps --no-cache-dir -w "$work/out" "$src"
  built=$(ls "$work"/out/llama_cpp_python-"$version"-*.whl 2>/dev/null | head -n1) || true
  [ -n "$built" ] || die "the build ended without a wheel; see $log"
  rm -f "$cache"/llama_cpp_python-*.whl "$cache/wheel.key"
  mv "$built" "$cache/"
  echo "$key" >"$cache/wheel.key"
  wheel=$cache/$(basename "$built")
  build_s=$((SECONDS - t_build))
  rm -rf "$work"; trap - EXIT
  say "built $wheel"
fi

# ---- install: the backend wheel first, then the project around it --------------------------------
# --force-reinstall --no-deps replaces any llama-cpp-python of the same version already there (a
# CPU build would otherwise count as "already satisfied"); the second call adds the wheel's own
# dependencies; the project goes in last with --no-deps so its pin cannot pull another build.
run "installing the $backend wheel" "${vpip[@]}" install -q --force-reinstall --no-deps "$wheel"
run "installing the wheel's dependencies" "${vpip[@]}" install -q "$wheel"
[ ${#other_reqs[@]} -eq 0 ] || run "installing the project's other requirements" "${vpip[@]}" install -q "${other_reqs[@]}"
run "installing the project (editable)" "${vpip[@]}" install -q --no-deps -e "$root"

libdir=$("$venv/bin/python" -c 'import importlib.util, os; s = importlib.util.find_spec("llama_cpp"); print(os.path.join(list(s.submodule_search_locations)[0], "lib"))' 2>>"$log") \
  || die "llama_cpp is not importable from $venv; see $log"
[ -e "$libdir/$lib" ] || die "$lib is missing from $libdir: the installed llama-cpp-python is not the $backend build"
if ! "$venv/bin/python" -c 'import llama_cpp' >>"$log" 2>&1; then
  # libggml-cuda needs the NVIDIA driver's libcuda at load time; a build machine may have none.
  if [ "$backend" = cuda ]; then
    say "warning: llama_cpp does not load here (no NVIDIA driver?); see $log"
  else
    die "llama_cpp fails to load in $venv; see $log"
  fi
fi

say "ok: $venv has llama-cpp-python $version with $lib"
[ -z "$cuda_libpath" ] || say "cuBLAS came from PyPI: run with LD_LIBRARY_PATH=$cuda_libpath"
# swarmctl's own view of the build: the devices ggml offers (a CUDA build on a machine without a GPU
# or driver lists only the CPU, and must still load).
if devices=$("$venv/bin/swarmctl" devices 2>>"$log"); then
  say "swarmctl devices:"; printf '%s\n' "$devices" | sed 's/^/  /'
else
  die "swarmctl devices failed in $venv; see $log"
fi
[ "$backend" != vulkan ] || say "on a CPU Vulkan driver (lavapipe) set GGML_VK_VISIBLE_DEVICES=0, or ggml-vulkan skips it"
if [ -n "$build_s" ]; then
  say "$(printf 'timing: wheel build %dm%02ds, total %dm%02ds' $((build_s / 60)) $((build_s % 60)) \
        $(((SECONDS - t_start) / 60)) $(((SECONDS - t_start) % 60)))"
else
  say "$(printf 'timing: no build (cached wheel), total %dm%02ds' $(((SECONDS - t_start) / 60)) $(((SECONDS - t_start) % 60)))"
fi
