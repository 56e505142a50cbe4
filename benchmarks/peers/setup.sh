#!/usr/bin/env bash
# Creates the peer servers' own virtual environments (their pins clash with the
# project's and with each other's), each with the same CPU torch as the project.
#   bash benchmarks/peers/setup.sh            # both, when missing
#   bash benchmarks/peers/setup.sh litserve   # one
# The venvs live next to this script (.venv-litserve, .venv-pytriton; gitignored).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-python3}"
TORCH_PIN="torch==2.13.0"

declare -A PINS=(
  [litserve]="litserve==0.2.19 numpy==2.4.6"
  [pytriton]="nvidia-pytriton==0.7.0"
)

make_venv() {
  local name="$1" venv="$HERE/.venv-$1"
  local stamp="$venv/.installed-$(echo "${PINS[$name]} $TORCH_PIN" | md5sum | cut -c1-12)"
  if [[ -f "$stamp" ]]; then
    return 0
  fi
  echo "== creating $venv (${PINS[$name]}, $TORCH_PIN)"
  rm -rf "$venv"
  "$PYTHON" -m venv "$venv"
  "$venv/bin/pip" install --quiet --upgrade pip
  # torch first, pinned, so the peer's own requirements cannot pull another build.
  "$venv/bin/pip" install --quiet "$TORCH_PIN"
  "$venv/bin/pip" install --quiet ${PINS[$name]} "$TORCH_PIN"
  "$venv/bin/pip" freeze > "$venv/freeze.txt"
  touch "$stamp"
}

if [[ $# -eq 0 ]]; then
  set -- litserve pytriton
fi
for name in "$@"; do
  if [[ -z "${PINS[$name]:-}" ]]; then
    echo "unknown peer '$name' (known: ${!PINS[*]})" >&2
    exit 2
  fi
  make_venv "$name"
done
