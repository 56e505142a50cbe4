"""The worker's event loop (uvloop when installed) and its per-model batch default."""

from __future__ import annotations

import asyncio
import sys

import pytest
import uvloop

from workers.exceptions import WorkerConfigError
from workers.models.classifier import ImageClassifier
from workers.models.ranking import Ranker
from workers.server import event_loop_name, loop_factory, run_on_loop
from workers.settings import WorkerSettings


async def _loop_type() -> type:
    return type(asyncio.get_running_loop())


def test_auto_runs_on_uvloop_when_it_is_installed() -> None:
    assert loop_factory("auto") is uvloop.new_event_loop
    assert event_loop_name("auto") == "uvloop"
    assert run_on_loop(_loop_type(), "auto") is uvloop.Loop


def test_asyncio_never_uses_uvloop() -> None:
    assert loop_factory("asyncio") is None
    assert event_loop_name("asyncio") == "asyncio"
    assert not issubclass(run_on_loop(_loop_type(), "asyncio"), uvloop.Loop)


def test_without_uvloop_auto_falls_back_and_uvloop_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop now raises ImportError
    assert loop_factory("auto") is None
    main = _loop_type()
    with pytest.raises(WorkerConfigError, match=r"uvloop is not installed.*auto or asyncio"):
        run_on_loop(main, "uvloop")
    assert main.cr_frame is None  # closed, never left unawaited


def test_settings_name_the_loop_and_refuse_an_unknown_one() -> None:
    assert WorkerSettings().event_loop == "auto"
    assert WorkerSettings(event_loop="asyncio").event_loop == "asyncio"
    with pytest.raises(ValueError, match="event_loop"):
        WorkerSettings(event_loop="trio")  # type: ignore[arg-type]


def test_batch_rows_default_to_the_served_models_and_a_setting_wins() -> None:
    assert Ranker.default_max_batch_size == 256
    assert ImageClassifier.default_max_batch_size == 32  # the ServedModel default
    unset = WorkerSettings()
    assert unset.batching(Ranker.default_max_batch_size).max_batch_size == 256
    assert unset.runtime(Ranker.default_max_batch_size).max_batch_rows == 256
    assert unset.batching().max_batch_size == 32
    given = WorkerSettings(max_batch_size=64)
    assert given.batching(Ranker.default_max_batch_size).max_batch_size == 64
    assert given.runtime(Ranker.default_max_batch_size).max_batch_rows == 64


class _Stop(Exception):
    pass


@pytest.mark.parametrize(
    ("args", "env", "expected"),
    [
        ([], {}, 4),
        (["--coalesce-turns", "1"], {}, 1),
        ([], {"EDGEFEED_WORKERS_COALESCE_TURNS": "8"}, 8),
        ([], {"EDGEFEED_WORKERS_COALESCE_LOOKUPS": "false"}, None),
    ],
)
def test_serve_hands_the_lookup_coalescing_setting_to_the_rankers_feature_source(
    monkeypatch: pytest.MonkeyPatch, args: list[str], env: dict[str, str], expected: int | None
) -> None:
    from typer.testing import CliRunner

    import edgefeed.cli.workers as cli_workers
    from edgefeed.cli import app

    seen: dict[str, object] = {}

    def load(*_args: object, **kwargs: object) -> None:
        seen.update(kwargs)
        raise _Stop

    monkeypatch.setattr(cli_workers, "_load_model", load)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    command = ["workers", "serve", "--model", "ranker", "--region", "eu-west", *args]
    result = CliRunner().invoke(app, command)
    assert isinstance(result.exception, _Stop), result.output
    assert seen["coalesce_turns"] == expected


def test_a_coalescing_setting_out_of_range_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="coalesce_turns"):
        WorkerSettings(coalesce_turns=65)
