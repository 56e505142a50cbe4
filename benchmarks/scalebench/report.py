"""benchmarks/scale.py's tables and plot."""

from __future__ import annotations

import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from scalebench.bulk import PATTERNS
from scalebench.modes import MODES

# What both modes' tables begin with.
_LOAD_COLUMNS = (
    ("users", "users"),
    ("changes", "changes"),
    ("changes_per_s", "changes/s"),
    ("rss_mb", "RSS MB"),
    ("state_mb", "state MB"),
    ("kb_per_user", "KB/user"),
)

COLUMNS = (
    *_LOAD_COLUMNS,
    ("bytes_per_row", "B/row"),
    ("checkpoint_s", "checkpoint s"),
    ("serialized_mb", "changelog MB"),
    ("recovery_s", "recovery s"),
    ("rewritten", "rewritten after"),
)

DISK_COLUMNS = (
    *_LOAD_COLUMNS,
    ("checkpoint_s", "checkpoint s"),
    ("serialized_mb", "changelog MB"),
    ("log_mb", "log MB"),
    ("store_open_mb", "store MB open"),
    ("store_mb", "store MB"),
    ("store_ratio", "store/changelog"),
    ("peak_cache_mb", "peak cache MB"),
    ("loads", "loads"),
    ("evictions", "evictions"),
    ("recovery_s", "recovery s"),
    ("renew_s", "renew s"),
    ("rewritten", "rewritten after"),
    ("rebuild_s", "rebuild s"),
    ("recovered_equal", "recovered equal"),
)

RATIO_COLUMNS = (
    ("changes_per_s", "changes/s"),
    ("rss_mb", "RSS"),
    ("state_mb", "state MB"),
    ("checkpoint_s", "checkpoint s"),
    ("recovery_s", "recovery s"),
)


BULK_COLUMNS = (
    ("users", "users"),
    ("changes", "changes built"),
    ("build_jobs", "builders"),
    ("build_s", "build s"),
    ("build_changes_per_s", "build changes/s"),
    ("serialized_mb", "changelog MB"),
    ("store_mb", "store MB"),
    ("store_ratio", "store/changelog"),
    ("round_changes_per_s", "round changes/s"),
    ("uniform_changes_per_s", "uniform changes/s"),
    ("hot_changes_per_s", "hot changes/s"),
    ("round_vectors_per_s", "round vectors/s"),
    ("uniform_vectors_per_s", "uniform vectors/s"),
    ("hot_vectors_per_s", "hot vectors/s"),
    ("rss_mb", "RSS MB"),
    ("worker_rss_mb", "worker RSS MB"),
    ("peak_cache_mb", "peak cache MB"),
    ("kill_tail_records", "tail records"),
    ("kill_tail_s", "tail s"),
    ("kill_recovery_s", "kill -9 to fresh write s"),
    ("kill_equal", "exact after kill"),
    ("rebuild_s", "lost-disk rebuild s"),
    ("rebuilt_equal", "rebuilt exact"),
    ("sample_equal", "built = recomputed"),
)

BULK_RATIOS = (
    ("round_changes_per_s", "round changes/s"),
    ("uniform_changes_per_s", "uniform changes/s"),
    ("hot_changes_per_s", "hot changes/s"),
    ("round_vectors_per_s", "round vectors/s"),
    ("uniform_vectors_per_s", "uniform vectors/s"),
    ("hot_vectors_per_s", "hot vectors/s"),
    ("rss_mb", "RSS"),
    ("worker_rss_mb", "worker RSS"),
    ("kill_recovery_s", "kill -9 to fresh write"),
    ("rebuild_s", "lost-disk rebuild"),
)


def print_bulk_ratios(bulk: list[dict[str, Any]]) -> None:
    """Each bulk-built size's figures over the smallest's of its run (one machine)."""
    print("| users | " + " | ".join(f"{t} / smallest's" for _, t in BULK_RATIOS) + " |")
    print("|" + "---|" * (len(BULK_RATIOS) + 1))
    for result in bulk:
        run = [r for r in bulk if r.get("run", 0) == result.get("run", 0)]
        base = min(run, key=lambda r: r["users"])
        cells = [
            _ratio(result[key], base[key]) if key in result and key in base else "-"
            for key, _ in BULK_RATIOS
        ]
        print(f"| {result['users']:,} | " + " | ".join(cells) + " |")


def _cell(value: Any) -> str:
    return str(value) if isinstance(value, bool | str) else f"{value:,}"


def print_table(results: list[dict[str, Any]], columns: Sequence[tuple[str, str]]) -> None:
    print("| " + " | ".join(title for _, title in columns) + " |")
    print("|" + "---|" * len(columns))
    for result in results:
        print("| " + " | ".join(_cell(result.get(key, "-")) for key, _ in columns) + " |")


def print_ratios(results: list[dict[str, Any]]) -> None:
    """Disk mode's figures over memory mode's, per size (one run: one machine)."""
    pairs = _pairs(results)
    if not pairs:
        return
    titles = [title for _, title in RATIO_COLUMNS]
    print("| users | " + " | ".join(titles) + " | rebuild s / memory recovery s | same vectors |")
    print("|" + "---|" * (len(titles) + 3))
    for memory, disk in pairs:
        cells = [_ratio(disk[key], memory[key]) for key, _ in RATIO_COLUMNS]
        cells.append(_ratio(disk["rebuild_s"], memory["recovery_s"]))
        cells.append(str(disk["digest"] == memory["digest"]))
        print(f"| {memory['users']:,} | " + " | ".join(cells) + " |")


def _ratio(disk: float, memory: float) -> str:
    return f"{disk / memory:.3g}x" if memory else "-"


def _pairs(results: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    memory = {r["users"]: r for r in results if r["mode"] == "memory"}
    return [
        (memory[r["users"]], r) for r in results if r["mode"] == "disk" and r["users"] in memory
    ]


BULK_LINES = {  # panel -> (figure, label, style) of the bulk-built runs
    "rss_mb": (("rss_mb", "bulk-built state on disk: after the new changes", "-."),),
    "changes_per_s": tuple(
        (f"{p}_changes_per_s", f"bulk-built state on disk: new changes, {p} access", style)
        for p, style in zip(PATTERNS, (":", "-.", "--"), strict=True)
    ),
    "recovery_s": (
        ("kill_recovery_s", "bulk-built state on disk: kill -9 during load", "-."),
        ("rebuild_s", "bulk-built state on disk: a lost disk rebuilt from the changelog", ":"),
    ),
}


def _draw(axis: Any, found: list[dict[str, Any]], key: str, label: str, **style: Any) -> None:
    """A line of ``key`` against users per run (``run``: the --replot file it came
    from), in one colour (``style``'s, given), in the legend once."""
    for run in sorted({r.get("run", 0) for r in found}):
        points = sorted((r["users"], r[key]) for r in found if r.get("run", 0) == run and key in r)
        if points:
            users, values = zip(*points, strict=True)
            axis.plot(users, values, label=label, **style)
            label = "_"  # matplotlib leaves labels starting with _ out of the legend


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """Memory, changes/s, checkpoint and recovery time against users (log scale), a
    line per mode and run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(2, 2, figsize=(10, 7), sharex=True)
    panels = (
        ("rss_mb", "worker RSS (MB)"),
        ("changes_per_s", "apply path (changes/s, one core)"),
        ("checkpoint_s", "checkpoint time over the load (s)"),
        ("recovery_s", "recovery (s): until fresh writes are served"),
    )
    lines: list[tuple[str, str, str, str]] = []  # mode, key, label, style
    for mode in MODES:
        found = [r for r in results if r["mode"] == mode]
        if not found:
            continue
        label = (
            "edgefeed, states in memory"
            if mode == "memory"
            else f"edgefeed, states on disk ({found[0]['memory_mb']:g} MB budget)"
        )
        lines.append((mode, "", label, "-"))
    colours: dict[str, str] = {}

    def draw(axis: Any, found: list[dict[str, Any]], key: str, label: str, **style: Any) -> None:
        colour = colours.setdefault(label, f"C{len(colours) % 10}")
        _draw(axis, found, key, label, color=colour, **style)

    bulk = [r for r in results if r["mode"] == "bulk"]
    for axis, (key, title) in zip(axes.flat, panels, strict=True):
        for mode, _, label, style in lines:
            found = [r for r in results if r["mode"] == mode]
            draw(axis, found, key, label, linestyle=style, marker="o")
            if key == "recovery_s" and mode == "disk":
                rebuilt = "states on disk: a lost disk rebuilt from the changelog"
                draw(axis, found, "rebuild_s", rebuilt, linestyle="--", marker="x")
        for field, label, style in BULK_LINES.get(key, ()):
            draw(axis, bulk, field, label, linestyle=style, marker="s")
        axis.set_xscale("log")
        if key != "changes_per_s":
            axis.set_yscale("log")
        axis.set_title(title)
        axis.set_xlabel("users in the region")
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize="small")
    runs = len({r.get("run", 0) for r in results})
    each = f"; {runs} runs, a line each" if runs > 1 else ""
    figure.suptitle(f"A regional worker's state against its entities ({platform.machine()}{each})")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
