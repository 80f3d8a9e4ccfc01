#!/usr/bin/env bash
# Installs everything the project needs on a fresh Debian machine (idempotent, offline-friendly):
# system tools (apt), the Python venv (.venv, pinned), and the pinned CDK CLI (npm ci).
set -euo pipefail
cd "$(dirname "$0")/.."

# trans-de-en: the Ding dictionary (GPL-2+), read by `prepare.py ding`; dataset-fashion-mnist: Zalando's
# Fashion-MNIST images (MIT), read by `prepare.py fashion-mnist`. Neither's data enters the repository.
APT_PACKAGES=(openssh-server openssh-client openmpi-bin iproute2 util-linux procps psmisc shellcheck unzip iperf3
  trans-de-en dataset-fashion-mnist)
missing=()
for package in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "ok installed" || missing+=("$package")
done
if ((${#missing[@]})); then
  echo "setup: apt-get install ${missing[*]}"
  SUDO=""; [[ $(id -u) == 0 ]] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# Python: exactly the lock (every transitive package pinned with hashes), installed by uv.
# `make lock` regenerates it from the requirements files. torch is the CPU wheel on this disk.
# Then the project itself, editable and offline (setuptools comes from the lock): after the sync, which
# removes every package the lock does not name, this one included.
UV_VERSION=0.13.9
stamp=.venv/.requirements.sha
want=$(cat requirements.lock pyproject.toml | sha256sum | cut -d' ' -f1)
if [[ ! -f $stamp || $(cat "$stamp") != "$want" ]]; then
  echo "setup: python venv (.venv) from requirements.lock, the project editable"
  [[ -x .venv/bin/python ]] || python3 -m venv .venv
  [[ $(.venv/bin/uv --version 2>/dev/null) == "uv $UV_VERSION"* ]] \
    || .venv/bin/pip install -q --disable-pip-version-check "uv==$UV_VERSION"
  find_links=(); [[ -d /opt/wheels ]] && find_links=(--find-links /opt/wheels)
  # --compile-bytecode: once here, not in every test worker of a fresh checkout's first run (torch, aws_cdk)
  .venv/bin/uv pip sync -q --compile-bytecode --python .venv/bin/python "${find_links[@]}" requirements.lock
  .venv/bin/uv pip install -q --python .venv/bin/python --offline --no-deps --no-build-isolation -e .
  echo "$want" > "$stamp"
fi

if [[ ! -x node_modules/.bin/cdk || package-lock.json -nt node_modules/.package-lock.json ]]; then
  echo "setup: CDK CLI (npm ci)"
  npm ci --no-audit --no-fund --loglevel=error >/dev/null
fi
echo "setup: done ($(.venv/bin/python --version), cdk $(node_modules/.bin/cdk --version 2>/dev/null | cut -d' ' -f1))"
