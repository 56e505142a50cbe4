"""docker-compose.yml's hardening, checked as a policy (checkov has no Compose framework).

Every container drops all capabilities (adding back only what its entrypoint
needs), cannot gain privileges, has a memory limit and a read-only root unless
waived in docs/security.md; the data plane has no route out; each container
mounts only the secrets it uses; Redis runs edge_cache.acl's users, bounded.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from edge_cache.acl import COMMANDS

ROOT = Path(__file__).resolve().parents[3]

# Which secrets each container gets, and nothing more.
SECRETS = {
    "kafka": set(),
    "postgres": {"pg_password"},
    "connect": {"cdc_password"},
    "connectors-apply": {"pg_password", "cdc_password"},
    "redis-eu-west": {"redis_lookup_password", "redis_writer_password"},
    "redis-us-east": {"redis_lookup_password", "redis_writer_password"},
    "redis-ap-southeast": {"redis_lookup_password", "redis_writer_password"},
    "router": {"pg_password", "metrics_token"},
    "worker-eu-west": {"redis_writer_password", "metrics_token"},
    "worker-us-east": {"redis_writer_password", "metrics_token"},
    "worker-ap-southeast": {"redis_writer_password", "metrics_token"},
    "model-worker": {"redis_lookup_password", "model_token"},
    "exporter": {"pg_password", "redis_lookup_password", "exporter_token"},
    "prometheus": {"exporter_token", "metrics_token", "model_token"},
    "alertmanager": set(),
    "grafana": {"grafana_admin_password"},
}
# Images that write their own config at start (waived in docs/security.md).
WRITABLE_ROOT = {"kafka", "connect"}
# Entrypoints that prepare their data folder as root, then drop to their user.
CAP_ADD = {
    "postgres": {"CHOWN", "DAC_OVERRIDE", "FOWNER", "SETGID", "SETUID"},
    "redis-eu-west": {"CHOWN", "SETGID", "SETUID"},
    "redis-us-east": {"CHOWN", "SETGID", "SETUID"},
    "redis-ap-southeast": {"CHOWN", "SETGID", "SETUID"},
}
DATA_ONLY = {"kafka", "postgres", "connect", "redis-eu-west", "redis-us-east", "redis-ap-southeast"}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_every_container_is_confined(compose: dict[str, Any]) -> None:
    assert set(compose["services"]) == set(SECRETS)
    for name, service in compose["services"].items():
        assert service["cap_drop"] == ["ALL"], name
        assert "no-new-privileges:true" in service["security_opt"], name
        assert service.get("mem_limit"), f"{name} has no memory limit"
        assert set(service.get("cap_add", [])) == CAP_ADD.get(name, set()), name
        assert service["read_only"] is (name not in WRITABLE_ROOT), name
        assert "privileged" not in service and "network_mode" not in service, name
        image = service["image"]
        assert ":" in image and not image.endswith(":latest"), f"{name}: {image} is not pinned"


def test_writable_roots_are_waived_in_the_docs() -> None:
    text = (ROOT / "docs" / "security.md").read_text()
    for name in WRITABLE_ROOT:
        assert f"`{name}`" in text.split("### Waivers", 1)[1], name


def test_the_data_plane_has_no_route_out_and_only_public_services_publish(
    compose: dict[str, Any],
) -> None:
    networks = compose["networks"]
    assert networks["data"]["internal"] is True and networks["monitoring"]["internal"] is True
    for name, service in compose["services"].items():
        joined = set(service["networks"])
        if name in DATA_ONLY:
            assert joined == {"data"}, name
        for port in service.get("ports", []):
            assert "public" in joined, name
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"


def test_each_container_gets_only_its_secrets_as_files(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        assert set(service.get("secrets", [])) == SECRETS[name], name
    for secret in compose["secrets"].values():
        assert secret["file"].startswith("./secrets/")
    gitignore = (ROOT / ".gitignore").read_text().split()
    assert "secrets/" in gitignore


def _redis_rules(command: str) -> dict[str, set[str]]:
    words = shlex.split(command)
    users: dict[str, set[str]] = {}
    for index, word in enumerate(words):
        if word == "--user":
            name = words[index + 1]
            rest = []
            for item in words[index + 2 :]:
                if item.startswith("--"):
                    break
                rest.append(item)
            users[name] = {w[1:] for w in rest if w.startswith("+")}
    return users


def test_redis_runs_the_acl_users_of_edge_cache_with_a_memory_bound(
    compose: dict[str, Any],
) -> None:
    for region in ("eu-west", "us-east", "ap-southeast"):
        command = compose["services"][f"redis-{region}"]["command"]
        assert command[:2] == ["sh", "-c"]
        rules = _redis_rules(command[2])
        assert rules == {
            "default": set(),
            "edgefeed-lookup": set(COMMANDS["reader"]),
            "edgefeed-writer": set(COMMANDS["writer"]),
        }
        assert "default off" in command[2]
        assert re.search(r"--maxmemory \d+[mg]b --maxmemory-policy noeviction", command[2])
        assert ">" not in command[2].replace("2>", "")  # passwords only as SHA-256 (#...)


def test_settings_users_match_the_mounted_secrets() -> None:
    settings = yaml.safe_load((ROOT / "deploy" / "edgefeed.compose.yaml").read_text())
    for region in settings["regions"]:
        assert region["reader"]["password_file"] == "/run/secrets/redis_lookup_password"
        assert region["writer"]["password_file"] == "/run/secrets/redis_writer_password"
    assert settings["database"]["replication"]["password_file"] == "/run/secrets/cdc_password"
