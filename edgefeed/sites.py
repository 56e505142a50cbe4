"""Sites: a broker per region and the emulated WAN links between the sites.

Without a ``sites:`` section (the default) every region shares the one broker
of ``kafka.bootstrap_servers``, as ``make demo`` runs. With one, a region named
there has a broker of its own: its feature workers, their changelog and dead
letters live on it, and a forwarder (pipeline.forward) carries the region's
changes to it from the central broker::

    sites:
      compression: zstd            # batch compression of the producers that cross a link
      regions:
        eu-west:
          bootstrap_servers: 127.0.0.1:19192     # the region's broker, as its site sees it
          link: {listen_port: 19193, delay_ms: 100, jitter_ms: 2}   # central <-> eu-west
      links:                       # other links, e.g. client <-> edge in front of a Redis
        client-eu-west: {listen_port: 16479, target: 127.0.0.1:16379, delay_ms: 15}

A region's link is named ``central-<region>``; the local stack's WAN emulator
(edgefeed.wan) runs every link, and ``edgefeed dev wan`` controls them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = [
    "Compression",
    "ExtraLinkSettings",
    "LinkSettings",
    "RegionSiteSettings",
    "SitesSettings",
]

Compression = Literal["zstd", "lz4", "gzip", "snappy", "none"]


def _host_port(value: str, what: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"{what} {value!r} must be host:port")
    return value


class LinkSettings(BaseModel):
    """An emulated WAN link: a loopback port that carries traffic to an endpoint.

    Attributes:
        listen_port: Loopback port the far side connects to.
        delay_ms: One-way delay (each direction).
        jitter_ms: Uniform variation of the delay, +/- (never reorders a stream).
        bandwidth_mbit: Cap per direction, megabits per second; none by default.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    listen_port: int = Field(ge=1, le=65535)
    delay_ms: float = Field(default=0.0, ge=0, le=60_000)
    jitter_ms: float = Field(default=0.0, ge=0, le=60_000)
    bandwidth_mbit: float | None = Field(default=None, gt=0)

    def spec(self, name: str, target: str) -> dict[str, Any]:
        """The emulator's description of this link (edgefeed.wan.LinkSpec.from_dict)."""
        return {"name": name, "target": target, **self.model_dump()}


class ExtraLinkSettings(LinkSettings):
    """A link in front of any endpoint (``target``, host:port)."""

    target: str

    @field_validator("target")
    @classmethod
    def _target(cls, value: str) -> str:
        return _host_port(value, "link target")


class RegionSiteSettings(BaseModel):
    """A region's own site.

    Attributes:
        bootstrap_servers: The region's broker, as the region's own workers reach it.
        link: The central <-> region link, in front of that broker (the forwarder
            produces through it); without one, the central site reaches the
            broker directly.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    bootstrap_servers: list[str] = Field(min_length=1)
    link: LinkSettings | None = None

    @field_validator("bootstrap_servers", mode="before")
    @classmethod
    def _split(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("bootstrap_servers")
    @classmethod
    def _each(cls, value: list[str]) -> list[str]:
        return [_host_port(server, "bootstrap server") for server in value]


class SitesSettings(BaseModel):
    """The sites of a multi-site deployment (empty: one broker for every region).

    Attributes:
        regions: Region name -> its site. Regions not named share the central broker.
        links: Other links by name (client <-> edge, for instance).
        compression: Batch compression of the producers whose records cross a
            link (the forwarders): ``zstd`` (default), ``lz4``, ``gzip``,
            ``snappy`` or ``none``.
        request_timeout_ms: How long a forwarder waits for the region's broker to
            acknowledge a batch before sending it again (a cut link).
        forward_max_in_flight: Batches a forwarder sends before the first of them
            is acknowledged (1: one batch per round trip across the link).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    regions: dict[str, RegionSiteSettings] = Field(default_factory=dict)
    links: dict[str, ExtraLinkSettings] = Field(default_factory=dict)
    compression: Compression = "zstd"
    request_timeout_ms: int = Field(default=10_000, ge=1_000, le=300_000)
    forward_max_in_flight: int = Field(default=8, ge=1, le=64)

    @model_validator(mode="after")
    def _names_and_ports(self) -> SitesSettings:
        ports: dict[int, str] = {}
        for name, link in self.all_links().items():
            if link.listen_port in ports:
                raise ValueError(
                    f"links {ports[link.listen_port]!r} and {name!r} both listen on port "
                    f"{link.listen_port}; give each link its own listen_port"
                )
            ports[link.listen_port] = name
        for name in self.links:
            if name.startswith("central-") and name[len("central-") :] in self.regions:
                raise ValueError(
                    f"link name {name!r} is taken by the link of region "
                    f"{name[len('central-') :]!r}; choose another name"
                )
        return self

    @property
    def enabled(self) -> bool:
        return bool(self.regions or self.links)

    def all_links(self) -> dict[str, LinkSettings]:
        """Every link by name: ``central-<region>`` for the regions' links, then the others."""
        found: dict[str, LinkSettings] = {
            f"central-{region}": site.link
            for region, site in self.regions.items()
            if site.link is not None
        }
        found.update(self.links)
        return found

    def link_specs(self) -> list[dict[str, Any]]:
        """The emulator's links (edgefeed.wan), each with its target."""
        specs = []
        for region, site in self.regions.items():
            if site.link is not None:
                specs.append(site.link.spec(f"central-{region}", site.bootstrap_servers[0]))
        specs += [link.spec(name, link.target) for name, link in self.links.items()]
        return specs

    def bootstrap_of(self, region: str) -> list[str] | None:
        """The region's own broker, or None when it shares the central one."""
        site = self.regions.get(region)
        return None if site is None else list(site.bootstrap_servers)

    def remote_address_map(self, region: str) -> dict[str, str]:
        """How the central site reaches the region's broker: its address -> the link's."""
        site = self.regions.get(region)
        if site is None or site.link is None:
            return {}
        return {site.bootstrap_servers[0]: f"127.0.0.1:{site.link.listen_port}"}
