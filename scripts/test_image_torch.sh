#!/usr/bin/env bash
# The training program's tests (tests/trainer_tests.txt), in an environment matching the
# training image: its Python, torch and numpy (stacks/images.py), pinned with hashes in
# requirements-image.lock. The environment (~3 GB: PyPI's torch is a CUDA build, which runs on CPU) is
# built outside the checkout, once per lock: ~/.cache/gpu-cluster/image-env-<lock hash>, reused while the
# lock is unchanged; older ones are removed once a new one is complete.
set -euo pipefail
cd "$(dirname "$0")/.."

lock=requirements-image.lock
cache=${GPU_CLUSTER_CACHE:-$HOME/.cache/gpu-cluster}
env_dir="$cache/image-env-$(sha256sum "$lock" | cut -c1-16)"
read -r tag want_python want_torch want_numpy < <(.venv/bin/python -c \
  'from stacks import images; r = images.default(); print(r.tag, r.python, r.torch_pypi, r.numpy)')

find_python() {  # the image's Python: pyenv's build on this kind of machine, else one on PATH
  local candidate
  for candidate in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$want_python".*/bin/python"$want_python" \
    "$(command -v "python$want_python" || true)"; do
    [[ -x $candidate ]] && "$candidate" -c 'import venv' 2>/dev/null && { echo "$candidate"; return; }
  done
  echo "error: no Python $want_python (the $tag image's) found: pyenv install $want_python, or put python$want_python on PATH" >&2
  return 1
}

if [[ ! -f $env_dir/.complete ]]; then
  python=$(find_python)
  echo "image-torch: building $env_dir from $lock with $python (downloads ~3 GB once)"
  start=$SECONDS
  rm -rf "$env_dir"
  mkdir -p "$cache"
  "$python" -m venv "$env_dir"
  .venv/bin/uv pip sync -q --compile-bytecode --python "$env_dir/bin/python" "$lock"
  touch "$env_dir/.bytecode" "$env_dir/.complete"  # last: an interrupted build is started over, never reused
  echo "image-torch: built in $((SECONDS - start)) s ($(du -sh "$env_dir" | cut -f1))"
  find "$cache" -maxdepth 1 -name 'image-env-*' ! -path "$env_dir" -exec rm -rf {} +
fi

if [[ ! -f $env_dir/.bytecode ]]; then
  # An environment built before --compile-bytecode: its modules compiled once here, not in every test process
  # (with PYTHONDONTWRITEBYTECODE set, each one compiled torch's ~2,000 modules again: ~4 s of CPU a process).
  # A file compileall cannot compile (a package's deliberately broken test data) is left to the import.
  "$env_dir/bin/python" -m compileall -q -j 0 "$env_dir/lib" >/dev/null 2>&1 || true
  touch "$env_dir/.bytecode"
fi

got=$("$env_dir/bin/python" -c 'import platform, torch, numpy
print(".".join(platform.python_version_tuple()[:2]), torch.__version__.split("+")[0], numpy.__version__)')
if [[ $got != "$want_python $want_torch $want_numpy" ]]; then
  echo "error: $env_dir has Python/torch/numpy $got, the $tag row wants $want_python $want_torch $want_numpy: delete it and rerun" >&2
  exit 1
fi
echo "image-torch: the training program's tests on Python/torch/numpy $got (as $tag)"
# The modules and deselections of tests/trainer_tests.txt, read by the parser `make test`'s first phase uses
# (conftest.trainer_tests): a test the first phase leaves out is one this phase runs.
mapfile -t selection < <(cd tests && ../.venv/bin/python -c 'from conftest import trainer_tests
listed, left_out = trainer_tests()
print("\n".join([*sorted(listed), *(f"--deselect={node}" for node in left_out)]))')
[[ ${#selection[@]} -gt 0 ]] || { echo "error: no test selected from tests/trainer_tests.txt (see the error above)" >&2; exit 1; }
# The repository is not installed there: the packages come from the checkout, as the image puts /workspace
# on PYTHONPATH. A worker that crashes ends the run, failed, naming its test: xdist's loadgroup scheduler
# waits for good on a replaced worker (a crashed worker hung this phase for 27 minutes, session 24).
PYTHONPATH="$PWD:$PWD/assets" GPU_CLUSTER_IMAGE_ENV=$tag "$env_dir/bin/python" -m pytest -q -p no:cacheprovider -n 2 --dist loadgroup --max-worker-restart 0 -m "not cluster" "${selection[@]}" "$@"
