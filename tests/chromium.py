"""Headless Chromium (Debian's ``chromium``, installed by scripts/bootstrap.sh) driven
by subprocess: the DOM as the browser rendered it, and screenshots.

No webdriver: nothing may be downloaded at run time, and ``--dump-dom`` gives
the document as Chromium built it (after parsing, CSP and any script), which is
what a test of what a person sees needs. Tables are read from that DOM by the
``data-field`` attributes the status page puts on its cells.
"""

from __future__ import annotations

import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

__all__ = ["chromium", "dump_dom", "screenshot", "table_rows"]

TIMEOUT_S = 60


def chromium() -> str:
    """The browser's path; a clear failure when it is missing."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        raise AssertionError(
            "chromium is not installed: run scripts/bootstrap.sh (or apt-get install chromium)"
        )
    return found


def _run(profile: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # --no-sandbox: CI and these machines run the tests as root, where Chromium's
    # sandbox refuses to start; the page is our own, served from loopback.
    command = [
        chromium(),
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        "--disable-extensions",
        "--hide-scrollbars",
        f"--user-data-dir={profile}",
        *args,
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)


def dump_dom(url: str, profile: Path) -> str:
    """The DOM Chromium rendered for ``url``, serialized."""
    result = _run(profile, "--dump-dom", url)
    if result.returncode != 0 or "<html" not in result.stdout:
        raise AssertionError(f"chromium could not render {url}: {result.stderr[-2000:]}")
    return result.stdout


def screenshot(url: str, path: Path, profile: Path, size: tuple[int, int] = (1280, 900)) -> Path:
    """A PNG of ``url`` as Chromium shows it in a ``size`` window."""
    path.unlink(missing_ok=True)
    result = _run(profile, f"--screenshot={path}", f"--window-size={size[0]},{size[1]}", url)
    if not path.exists() or path.stat().st_size == 0:
        raise AssertionError(f"chromium made no screenshot of {url}: {result.stderr[-2000:]}")
    return path


class _Rows(HTMLParser):
    def __init__(self, container: str) -> None:
        super().__init__(convert_charrefs=True)
        self.container = container
        self.depth = 0  # inside the container while > 0
        self.rows: list[dict[str, str]] = []
        self.field: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if self.depth:
            if tag == "div":
                self.depth += 1
            elif tag == "tr":
                self.rows.append({})
            elif tag == "td" and self.rows:
                self.field = found.get("data-field")
                if self.field:
                    self.rows[-1][self.field] = ""
        elif tag == "div" and found.get("id") == self.container:
            self.depth = 1

    def handle_endtag(self, tag: str) -> None:
        if not self.depth:
            return
        if tag == "td":
            self.field = None
        elif tag == "div":
            self.depth -= 1

    def handle_data(self, data: str) -> None:
        if self.depth and self.field and self.rows:
            self.rows[-1][self.field] += data


def table_rows(dom: str, container: str) -> list[dict[str, str]]:
    """The rows of the table inside ``<div id=container>``: ``data-field`` -> the
    cell's text (whitespace collapsed), for the rows that have such cells."""
    parser = _Rows(container)
    parser.feed(dom)
    return [
        {field: " ".join(text.split()) for field, text in row.items()} for row in parser.rows if row
    ]
