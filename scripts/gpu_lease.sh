#!/usr/bin/env bash
# The calls of a lease on the device tool's lent GPU machine (docs/gpu.md, "On a lent GPU machine"): it reaches
# no package registry and takes at most 64 MiB per call, so the wheels travel in .whl/ and the 98 MB SmolLM2
# GGUF in two halves in .gg/ (both git-ignored, named in each call's `carry`).
#
#   here, once:  bash scripts/gpu_lease.sh prepare
#   call 1 (timeout_s 120, carry .whl .gg/part_00):
#                bash scripts/gpu_lease.sh first
#   call 2, at once, while the machine is warm (timeout_s 600, carry .whl .gg/part_01 .gg/sha):
#                bash scripts/gpu_lease.sh check 570 --out $OUT/a --files /tmp/a --sections sd_lossless grpo memory
#   any call without the checkpoint (carry .whl):
#                bash scripts/gpu_lease.sh check 570 --out $OUT/check --files /tmp/gc
#
# `check T ARGS` runs scripts/gpu_check.py ARGS under `timeout -k 5 T` (counted from the call's start) with
# --budget-s 75 s short of it: the section in flight is stopped 15 s past the budget, but only in Python code,
# and a compile in flight (up to ~60 s for an unrolled 7B engine) ends first, so 60 s remain for it before the
# timeout's SIGTERM. T 570 fits a 600 s call: the kill comes 5 s after, and the transfers need the rest.
set -uo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
site=/tmp/site fc=/tmp/fc
gguf=SmolLM2-135M-Instruct.Q4_1.gguf  # fastrl_jax.models.hub.SMOLLM2_FILE
# Not in the GPU image (docs/gpu.md); pure Python but for grain and array_record (Python 3.12, manylinux x86_64)
wheels=(gguf==0.19.0 grain==0.2.18 array-record==0.8.6 tensorboardx==2.6.5 jax-triton==0.3.1 portpicker==1.6.0
        pytest-xdist==3.8.0 execnet==2.1.2)

prepare() {
  # Here, with a registry: the wheels, and the cached GGUF split in two equal halves .gg/part_00 .gg/part_01
  cd "$repo" || exit 1
  python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "${wheels[@]}" || exit 1
  local src="${FASTRL_JAX_CACHE:-$HOME/.cache/fastrl_jax}/$gguf"
  [ -f "$src" ] || { echo "no $src: run any fastrl-jax command on smollm2 once to download it" >&2; exit 1; }
  mkdir -p .gg && rm -f .gg/part_* && split -d -n 2 "$src" .gg/part_ && sha256sum "$src" | cut -c1-64 > .gg/sha
  ls -la .whl .gg && du -sh .whl .gg/part_00
}

install() {
  # A fresh machine has neither; a warm one keeps /tmp, wheels and all. The project goes in at every call: this
  # call's checkout may hold a fix the last one did not. kernels/ becomes fastrl_jax.kernels only when installed.
  cd "$repo" || exit 1
  if [ ! -d $site/grain ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $site .whl/*.whl || exit 1
  fi
  rm -rf $site/fastrl_jax $site/fastrl_jax-*.dist-info
  python3 -m pip install -q --no-deps --no-build-isolation --target $site . || exit 1
}

first() {
  install
  mkdir -p $fc && cp "$repo/.gg/part_00" $fc/part_00 || exit 1
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  echo "== call 1 done at ${SECONDS}s"
}

join() {
  # The second half joined to the first, kept only when its sha256 is the one `prepare` wrote
  [ -f $fc/$gguf ] && return
  if [ -f $fc/part_00 ] && [ -f "$repo/.gg/part_01" ]; then
    cat $fc/part_00 "$repo/.gg/part_01" > $fc/$gguf.tmp
    if [ "$(sha256sum $fc/$gguf.tmp | cut -c1-64)" = "$(cat "$repo/.gg/sha")" ]; then
      mv $fc/$gguf.tmp $fc/$gguf && echo "GGUF joined"
    else
      echo "GGUF halves do not match .gg/sha: running without the checkpoint" >&2
    fi
  elif [ -f "$repo/.gg/part_01" ]; then
    echo "no $fc/part_00 (a fresh machine: call 1 ran on another): running without the checkpoint" >&2
  fi
}

check() {
  local t=$1
  shift
  install
  join
  export PYTHONPATH=$site XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
  [ -f $fc/$gguf ] && export FASTRL_JAX_CACHE=$fc
  cd /tmp || exit 1  # outside the checkout, with -P: the installed fastrl_jax, not the checkout's
  echo "== gpu_check at ${SECONDS}s"
  timeout -k 5 $((t - SECONDS)) python3 -P "$repo/scripts/gpu_check.py" --compile-cache /tmp/xla \
    --budget-s $((t - SECONDS - 75)) "$@"
  local code=$?
  echo "== done at ${SECONDS}s (exit $code)"
  return $code
}

case "${1:-}" in
  prepare) prepare ;;
  first) first ;;
  check) shift; check "$@" ;;
  *) echo "usage: $0 prepare | first | check TIMEOUT_S GPU_CHECK_ARGS..." >&2; exit 2 ;;
esac
