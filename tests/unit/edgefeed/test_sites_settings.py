"""The sites: section: a broker per region, links, and what the stack plans from it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from edgefeed.devstack import DevStack, DevStackError, PortInUseError
from edgefeed.settings import SettingsError, load_settings, settings_from_mapping

BASE: dict[str, Any] = {
    "kafka": {"bootstrap_servers": "127.0.0.1:9092"},
    "regions": [
        {"name": "eu-west", "redis_url": "redis://127.0.0.1:6379/0", "residency_zone": "eu"},
        {"name": "us-east", "redis_url": "redis://127.0.0.1:6380/0", "residency_zone": "us"},
    ],
}
SITES: dict[str, Any] = {
    "regions": {
        "eu-west": {
            "bootstrap_servers": "127.0.0.1:9192",
            "link": {"listen_port": 9193, "delay_ms": 100, "jitter_ms": 2},
        }
    },
    "links": {"client-eu-west": {"listen_port": 6479, "target": "127.0.0.1:6379", "delay_ms": 15}},
}


def with_sites(sites: dict[str, Any]) -> dict[str, Any]:
    return {**BASE, "sites": sites}


def test_without_sites_every_region_uses_the_central_broker() -> None:
    settings = settings_from_mapping(BASE)
    assert not settings.sites.enabled
    for region in ("eu-west", "us-east"):
        assert settings.region_kafka(region).bootstrap_servers == ["127.0.0.1:9092"]


def test_a_region_with_a_site_uses_its_own_broker_and_the_others_the_central_one() -> None:
    settings = settings_from_mapping(with_sites(SITES))
    eu = settings.region_kafka("eu-west")
    assert eu.bootstrap_servers == ["127.0.0.1:9192"]
    assert eu.session_timeout_ms == settings.kafka.session_timeout_ms  # the rest is kept
    assert settings.region_kafka("us-east").bootstrap_servers == ["127.0.0.1:9092"]
    assert settings.sites.remote_address_map("eu-west") == {"127.0.0.1:9192": "127.0.0.1:9193"}
    assert settings.sites.remote_address_map("us-east") == {}
    assert settings.sites.compression == "zstd"


def test_links_are_named_and_target_their_endpoints() -> None:
    specs = {
        spec["name"]: spec for spec in settings_from_mapping(with_sites(SITES)).sites.link_specs()
    }
    assert specs["central-eu-west"]["target"] == "127.0.0.1:9192"
    assert specs["central-eu-west"]["delay_ms"] == 100
    assert specs["client-eu-west"]["target"] == "127.0.0.1:6379"


@pytest.mark.parametrize(
    ("sites", "named"),
    [
        ({"regions": {"mars": {"bootstrap_servers": "127.0.0.1:1"}}}, "'mars'"),
        ({"regions": {"eu-west": {"bootstrap_servers": "nohostport"}}}, "nohostport"),
        (
            {
                "regions": {
                    "eu-west": {"bootstrap_servers": "127.0.0.1:1", "link": {"listen_port": 7}}
                },
                "links": {"other": {"listen_port": 7, "target": "127.0.0.1:2"}},
            },
            "port 7",
        ),
        ({"links": {"x": {"listen_port": 8, "target": "127.0.0.1:2", "delay_ms": -1}}}, "delay_ms"),
        ({"compression": "brotli"}, "compression"),
        ({"regions": {"eu-west": {"bootstrap_servers": "127.0.0.1:1", "linkk": {}}}}, "linkk"),
    ],
)
def test_bad_sites_settings_name_the_value(sites: dict[str, Any], named: str) -> None:
    with pytest.raises(SettingsError, match=named):
        settings_from_mapping(with_sites(sites))


def test_the_stack_plans_a_broker_per_site_and_one_emulator(tmp_path: Path) -> None:
    stack = DevStack(settings_from_mapping(with_sites(SITES)), tmp_path, with_connect=False)
    kinds = {service.name: service.kind for service in stack.services}
    assert kinds["broker"] == kinds["broker-eu-west"] == "kafka-broker"
    assert kinds["wan"] == "wan-emulator"
    assert "broker-us-east" not in kinds
    assert stack.service("broker-eu-west").port == 9192


def test_the_single_site_stack_is_unchanged(tmp_path: Path) -> None:
    stack = DevStack(settings_from_mapping(BASE), tmp_path, with_connect=False)
    assert sorted(s.name for s in stack.services) == [
        "broker",
        "postgres",
        "redis-eu-west",
        "redis-us-east",
    ]


def test_a_link_port_taken_by_a_service_is_refused(tmp_path: Path) -> None:
    sites = {**SITES, "links": {"clash": {"listen_port": 6380, "target": "127.0.0.1:6379"}}}
    with pytest.raises(PortInUseError, match="6380"):
        DevStack(settings_from_mapping(with_sites(sites)), tmp_path, with_connect=False)


def test_the_sites_example_is_the_example_plus_its_sites() -> None:
    examples = Path(__file__).resolve().parents[3] / "examples"
    single = load_settings(examples / "edgefeed.yaml")
    sites = load_settings(examples / "edgefeed-sites.yaml")
    assert sites.model_dump(exclude={"sites"}) == single.model_dump(exclude={"sites"})
    assert set(sites.sites.regions) == set(sites.region_names)
    delays = {link["name"]: link["delay_ms"] for link in sites.sites.link_specs()}
    assert delays["central-eu-west"] == 100
    assert delays["central-us-east"] == 50
    assert delays["central-ap-southeast"] == 60
    assert delays["client-eu-west"] == 15


def test_lag_watches_the_forwarders_of_regions_with_a_site() -> None:
    from edgefeed.cli.monitoring import build_config

    names = settings_from_mapping(BASE).pipeline.names
    config = build_config(settings_from_mapping(with_sites(SITES)))
    assert config.expected_groups == (
        names.router_group,
        names.forward_group("eu-west"),  # its worker's group is on its own broker
        names.region_group("us-east"),  # shares the central broker
    )
    assert config.site_regions == ("eu-west",)
    assert config.region_links == {"eu-west": "central-eu-west"}  # the link its changes cross
    assert config.links is not None  # read from the local stack's WAN emulator
    single = build_config(settings_from_mapping(BASE))
    assert single.groups == () and single.links is None  # single site: as before


def test_a_state_folder_too_deep_for_the_control_socket_is_a_clear_error(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 120)
    stack = DevStack(settings_from_mapping(with_sites(SITES)), deep, with_connect=False)
    with pytest.raises(DevStackError, match="shorter --state-dir"):
        stack.service("wan").prepare()


def test_the_sites_demo_line_shows_each_regions_freshness_and_a_cut_link() -> None:
    from edgefeed.cli.demo_sites import freshness_line

    line = freshness_line(
        21.04,
        {"eu-west": 12.345, "us-east": 0.42, "ap-southeast": None},
        {"central-eu-west": "cut", "central-us-east": "up", "central-ap-southeast": "up"},
    )
    assert line.startswith("  t+ 21.0s  freshness: ")
    assert "eu-west  12.3s [cut]" in line  # the cut region, growing
    assert "us-east   0.4s" in line and "us-east   0.4s [" not in line  # up: no marker
    assert "ap-southeast    -  " in line  # no vector yet


def test_the_sites_demo_calls_a_region_caught_up_when_the_cut_no_longer_shows() -> None:
    from edgefeed.cli.demo_sites import caught_up

    behind = {"eu-west": 25.0, "us-east": 0.5, "ap-southeast": 0.7}
    assert not caught_up(behind, "eu-west", 2.0)  # still paying for the cut
    assert caught_up({**behind, "eu-west": 1.9}, "eu-west", 2.0)
    # A loaded machine: every region 20 s behind; eu-west no worse than the rest.
    loaded = {"eu-west": 21.0, "us-east": 20.0, "ap-southeast": 20.5}
    assert caught_up(loaded, "eu-west", 2.0)
    assert not caught_up({**loaded, "eu-west": 23.0}, "eu-west", 2.0)
    assert not caught_up({**loaded, "eu-west": None}, "eu-west", 2.0)  # no vector yet
