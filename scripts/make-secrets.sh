#!/usr/bin/env bash
# Random secrets for docker-compose.yml in ./secrets/ (one file each, mode 0600;
# existing files are kept). Compose mounts each one at /run/secrets/NAME in the
# containers that use it and no other.
set -euo pipefail
cd "$(dirname "$0")/.."
umask 077
mkdir -p secrets
for name in pg_password cdc_password redis_lookup_password redis_writer_password \
            exporter_token metrics_token model_token grafana_admin_password; do
  if [ ! -s "secrets/$name" ]; then
    openssl rand -hex 24 > "secrets/$name"
    echo "made secrets/$name"
  fi
done
