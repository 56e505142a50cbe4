"""``edgefeed deploy``: the deployment files that follow from the settings."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from edgefeed.cli._common import EXIT_ERROR, console, err_console, run_reported, settings_path_of

__all__ = ["register"]

deploy_app = typer.Typer(
    help="Deployment files generated from the settings: Kubernetes overlays.",
    no_args_is_help=True,
)

DEFAULT_SETTINGS = Path("deploy/edgefeed.compose.yaml")


@deploy_app.command("k8s")
def k8s_cmd(
    ctx: typer.Context,
    out: Annotated[Path, typer.Option(help="The kustomize tree to write.")] = Path("deploy/k8s"),
    alerts: Annotated[Path, typer.Option(help="Prometheus alert rules.")] = Path(
        "deploy/prometheus/alerts.yml"
    ),
    dashboard: Annotated[Path, typer.Option(help="Grafana dashboard.")] = Path(
        "deploy/grafana/dashboards/edgefeed.json"
    ),
    check: Annotated[
        bool, typer.Option("--check", help="Write nothing; exit 1 if a file is out of date.")
    ] = False,
) -> None:
    """Write deploy/k8s's generated parts (overlay per region, settings, rules) from the settings.

    The settings file is the root --settings, or deploy/edgefeed.compose.yaml
    (the file the compose stack reads) when none is given.
    """
    from edgefeed import __version__, k8s
    from edgefeed.settings import SettingsError, load_settings

    path = settings_path_of(ctx) or DEFAULT_SETTINGS

    def read(file: Path, what: str) -> str:
        try:
            return file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
            raise SettingsError(f"cannot read the {what} {file} ({reason})") from None

    def inputs() -> k8s.K8sInputs:
        return k8s.K8sInputs(
            settings=load_settings(path),
            settings_text=read(path, "settings file"),
            alerts_text=read(alerts, "alert rules (--alerts)"),
            dashboard_text=read(dashboard, "dashboard (--dashboard)"),
            image_tag=__version__,
        )

    files = run_reported(lambda: k8s.render(run_reported(inputs)))
    if check:
        problems = k8s.diff(out, files)
        for problem in problems:
            err_console.print(problem)
        if problems:
            err_console.print(f"{out} is out of date with {path}: run `edgefeed deploy k8s`")
            raise typer.Exit(EXIT_ERROR)
        console.print(f"{out}: up to date with {path} ({len(files)} generated files)")
        return
    changed = k8s.write(out, files)
    for line in changed:
        console.print(line.replace("missing:", "wrote:").replace("differs:", "updated:"))
    console.print(f"{out}: {len(changed)} of {len(files)} generated files changed, from {path}")


def register(app: typer.Typer) -> None:
    """Add the ``deploy`` commands to the root app."""
    app.add_typer(deploy_app, name="deploy")
