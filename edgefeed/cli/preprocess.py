"""`edgefeed preprocess`: turn images into model-ready envelopes, showing the bytes saved."""

from __future__ import annotations

import json
import multiprocessing
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

__all__ = ["register"]


@dataclass(slots=True)
class _Outcome:
    source: Path
    output: Path | None = None
    bytes_in: int = 0
    bytes_out: int = 0
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    error: str | None = None
    bad_input: bool = True


def _output_paths(images: list[Path], out: Path) -> list[Path]:
    """``DIR/<stem>.efe``, one distinct file per input.

    Two inputs sharing a stem (``a.jpg``, ``x/a.jpg``) get ``a.efe`` and
    ``a-1.efe``; a suffix never lands on a name another input owns (``a-1.jpg``
    then gets ``a-1-1.efe``), so no input overwrites another's envelope.
    Names compare case-insensitively, as on macOS and Windows file systems.
    """
    owned = {image.stem.casefold() for image in images}
    taken: set[str] = set()
    paths = []
    for image in images:
        name = image.stem
        if name.casefold() in taken:
            count = 1
            while (candidate := f"{image.stem}-{count}").casefold() in taken | owned:
                count += 1
            name = candidate
        taken.add(name.casefold())
        paths.append(out / f"{name}.efe")
    return paths


def _human_bytes(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def _run(
    images: list[Path],
    out: Path,
    profile_name: str,
    encoding: str | None,
    workers: int,
    max_bytes: int | None,
    as_json: bool,
) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn
    from rich.table import Table

    from edgefeed.cli._common import console, err_console, fail
    from preprocess import (
        DEFAULT_LIMITS,
        Limits,
        PreprocessError,
        decode_envelope,
        encode_image_file,
        get_profile,
    )
    from preprocess.envelope import ENCODINGS

    try:
        profile = get_profile(profile_name)
    except PreprocessError as exc:
        fail(exc)
    if encoding is not None and encoding not in ENCODINGS:
        err_console.print(
            f"[bold red]error:[/] --encoding {encoding!r} is not one of "
            f"{', '.join(sorted(ENCODINGS))}"
        )
        raise typer.Exit(2)
    limits = DEFAULT_LIMITS if max_bytes is None else Limits(max_input_bytes=max_bytes)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        err_console.print(f"[bold red]error:[/] cannot create --out {str(out)!r}: {exc.strerror}")
        raise typer.Exit(1) from None
    outcomes = [_Outcome(source=image) for image in images]
    targets = _output_paths(images, out)

    def finish(index: int, result: tuple[int, bytes] | BaseException) -> None:
        outcome = outcomes[index]
        if isinstance(result, PreprocessError):
            outcome.error, outcome.bad_input = str(result), isinstance(result, ValueError)
            return
        if isinstance(result, BaseException):
            outcome.error, outcome.bad_input = f"{type(result).__name__}: {result}", False
            return
        outcome.bytes_in, envelope = result
        try:
            targets[index].write_bytes(envelope)
        except OSError as exc:
            outcome.error, outcome.bad_input = f"cannot write {targets[index]}: {exc}", False
            return
        header = decode_envelope(envelope, max_bytes=len(envelope))
        outcome.output, outcome.bytes_out = targets[index], len(envelope)
        outcome.shape, outcome.dtype = header.shape, header.dtype

    progress = Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=err_console,
        transient=True,
        disable=as_json or len(images) < 2,
    )
    args = [(str(image), profile, encoding, limits) for image in images]
    with progress:
        task = progress.add_task(f"preprocess ({profile.name})", total=len(images))
        if workers <= 1 or len(images) < 2:
            for index, arguments in enumerate(args):
                try:
                    finish(index, encode_image_file(*arguments))  # type: ignore[arg-type]
                except PreprocessError as exc:
                    finish(index, exc)
                progress.advance(task)
        else:
            context = multiprocessing.get_context("forkserver")
            with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
                futures: dict[Future[tuple[int, bytes]], int] = {
                    pool.submit(encode_image_file, *arguments): i  # type: ignore[arg-type]
                    for i, arguments in enumerate(args)
                }
                for future in as_completed(futures):
                    try:
                        finish(futures[future], future.result())
                    except (PreprocessError, BrokenProcessPool) as exc:
                        finish(futures[future], exc)
                    progress.advance(task)

    total_in = sum(o.bytes_in for o in outcomes if o.error is None)
    total_out = sum(o.bytes_out for o in outcomes if o.error is None)
    failed = [o for o in outcomes if o.error is not None]
    if as_json:
        report: dict[str, Any] = {
            "profile": profile.name,
            "encoding": encoding or profile.encoding,
            "files": [
                {
                    "input": str(o.source),
                    "output": None if o.output is None else str(o.output),
                    "bytes_in": o.bytes_in,
                    "bytes_out": o.bytes_out,
                    "shape": None if o.shape is None else list(o.shape),
                    "dtype": o.dtype,
                    "error": o.error,
                }
                for o in outcomes
            ],
            "bytes_in": total_in,
            "bytes_out": total_out,
            "failed": len(failed),
        }
        console.print_json(json.dumps(report))
    else:
        table = Table(title=f"profile {profile.name}, encoding {encoding or profile.encoding}")
        for column in ("input", "before", "after", "ratio", "tensor"):
            table.add_column(
                column,
                justify="left" if column in ("input", "tensor") else "right",
                overflow="fold",
                no_wrap=column != "input",
            )
        for o in outcomes:
            if o.error is None:
                table.add_row(
                    str(o.source),
                    _human_bytes(o.bytes_in),
                    _human_bytes(o.bytes_out),
                    f"{o.bytes_out / max(o.bytes_in, 1):.2f}x",
                    f"{'x'.join(map(str, o.shape or ()))} {o.dtype}",
                )
        if len(outcomes) - len(failed) > 1:
            table.add_row(
                "[bold]total",
                _human_bytes(total_in),
                _human_bytes(total_out),
                f"{total_out / max(total_in, 1):.2f}x",
                "",
            )
        console.print(table)
        for o in failed:
            err_console.print(f"[bold red]error:[/] {o.source}: {o.error}", highlight=False)
    if not failed:
        return 0
    return 2 if all(o.bad_input for o in failed) else 1


def register(app: typer.Typer) -> None:
    """Add the ``preprocess`` command to the root app."""

    @app.command("preprocess")
    def preprocess_command(
        images: Annotated[
            list[Path], typer.Argument(help="JPEG, PNG or WebP files.", show_default=False)
        ],
        out: Annotated[
            Path, typer.Option("--out", "-o", help="Folder for the <name>.efe envelopes.")
        ],
        profile: Annotated[
            str,
            typer.Option(
                "--profile",
                "-p",
                help="Image profile: imagenet-224, imagenet-224-fp16, imagenet-224-fast, "
                "imagenet-224-uint8, letterbox-640, webp-720 (or any registered one).",
            ),
        ] = "imagenet-224",
        encoding: Annotated[
            str | None,
            typer.Option(
                "--encoding",
                "-e",
                help="raw, webp, webp-lossless, brotli or arrow (default: the profile's).",
            ),
        ] = None,
        workers: Annotated[
            int, typer.Option("--workers", "-w", min=1, help="Processes to use.")
        ] = 1,
        max_bytes: Annotated[
            int | None,
            typer.Option("--max-bytes", min=1, help="Refuse input files larger than this."),
        ] = None,
        as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    ) -> None:
        """Preprocess images into envelopes for the model workers; print bytes before/after.

        Exit codes: 0 all done, 2 some inputs were bad (each is reported, the
        rest are written), 1 another failure.
        """
        code = _run(images, out, profile, encoding, workers, max_bytes, as_json)
        if code:
            raise typer.Exit(code)
