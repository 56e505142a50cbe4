#!/usr/bin/env bash
# Creates the Quix Streams virtual environment for benchmarks/peers/quix_pipeline.py.
#
# Quix Streams brings its own confluent-kafka (librdkafka) and rocksdict pins, so it
# lives apart from the project's venv. Besides quixstreams, the venv gets the few
# libraries that edge_cache (the Redis key layout and writer) and the settings
# loader import: the Quix app imports those modules from the repository
# (PYTHONPATH), never edgefeed's pipeline runtime.
#
#     bash benchmarks/peers/quix_venv.sh [VENV]    # default benchmarks/peers/.venv-quix
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${1:-$HERE/.venv-quix}"
PYTHON="${PYTHON:-python3}"
QUIXSTREAMS_VERSION=3.28.1

if [[ -x "$VENV/bin/python" ]] && "$VENV/bin/python" -c "
import importlib.metadata as m, sys
sys.exit(m.version('quixstreams') != '$QUIXSTREAMS_VERSION')" 2>/dev/null; then
    exit 0
fi
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install --quiet --disable-pip-version-check \
    "quixstreams==$QUIXSTREAMS_VERSION" \
    "redis[hiredis]==8.1.0" \
    "numpy==2.4.6" \
    "orjson==3.13.0" \
    "PyYAML==6.0.4" \
    "pydantic-settings<2.16" \
    "prometheus-client==0.26.0"
"$VENV/bin/python" -c "import quixstreams; print('quixstreams', quixstreams.__version__)"
