"""A tiny progress bar for long work (DataLoader tuning, ``optimize()``'s search).

It writes to stderr, and only when stderr is a terminal (or when forced), updating one line in
place with ``\\r``: ``label [#####.....] 3/8  0:04  current item``. No dependency; a failing
stream disables it rather than breaking the caller.

Example:
    >>> import io
    >>> out = io.StringIO()
    >>> with Progress(2, label="tune", stream=out, force=True) as bar:
    ...     for item in ("a", "b"):
    ...         bar.start(item)
    ...         bar.advance()
    >>> out.getvalue().endswith("2/2  0:00\\n")
    True
"""

from __future__ import annotations

import shutil
import sys
import time
from types import TracebackType
from typing import TextIO

__all__ = ["Progress"]


def _clock(seconds: float) -> str:
    s = int(seconds)
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    """A one-line progress bar: ``n/total``, elapsed time and the item being worked on.

    Args:
        total: number of items.
        label: shown before the bar.
        stream: where to write (default: ``sys.stderr`` at construction).
        force: True: draw even if the stream is not a terminal; False: never draw;
            None (default): draw only on a terminal.
        width: characters of the bar itself.
        min_interval: least seconds between redraws caused by :meth:`advance` alone
            (a new item or the end always redraws).
    """

    def __init__(self, total: int, *, label: str = "", stream: TextIO | None = None,
                 force: bool | None = None, width: int = 20, min_interval: float = 0.1
                 ) -> None:
        if isinstance(total, bool) or not isinstance(total, int) or total < 0:
            raise ValueError(f"Progress: total must be an int >= 0, got {total!r}")
        self.total = total
        self.label = label
        self.stream: TextIO = sys.stderr if stream is None else stream
        self.width = max(1, width)
        self.min_interval = min_interval
        self.n = 0
        self.item = ""
        self.enabled = self._decide(force)
        self._start = time.perf_counter()
        self._drawn_at = -float("inf")
        self._last_len = 0
        self._closed = False

    def _decide(self, force: bool | None) -> bool:
        if force is not None:
            return force
        try:
            return bool(self.stream.isatty())
        except (AttributeError, OSError, ValueError):
            return False

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self._start

    def line(self) -> str:
        """The text of the bar as it would be drawn now (without ``\\r``)."""
        frac = self.n / self.total if self.total else 1.0
        filled = min(self.width, int(frac * self.width))
        bar = "#" * filled + "." * (self.width - filled)
        head = f"{self.label} " if self.label else ""
        text = f"{head}[{bar}] {self.n}/{self.total}  {_clock(self.elapsed)}"
        if self.item:
            text += f"  {self.item}"
        columns = shutil.get_terminal_size((100, 20)).columns
        return text if len(text) < columns else text[: max(10, columns - 2)] + "…"

    def _draw(self, force: bool = False, end: str = "") -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if not force and now - self._drawn_at < self.min_interval:
            return
        self._drawn_at = now
        text = self.line()
        # wipe what a longer line left behind
        wipe = "\r" + " " * self._last_len if len(text) < self._last_len else ""
        self._last_len = len(text)
        try:
            self.stream.write(f"{wipe}\r{text}{end}")
            self.stream.flush()
        except (OSError, ValueError):  # closed or broken stream: stop drawing, carry on
            self.enabled = False

    def start(self, item: str) -> None:
        """Show that ``item`` is now being worked on."""
        self.item = item
        self._draw(force=True)

    def advance(self, n: int = 1) -> None:
        """Mark ``n`` more items done."""
        self.n = min(self.total, self.n + n) if self.total else self.n + n
        self._draw(force=self.n >= self.total)

    def write(self, message: str) -> None:
        """Print a line of text above the bar (the bar is redrawn below it)."""
        if not self.enabled:
            return
        try:
            self.stream.write("\r" + message.ljust(self._last_len) + "\n")
        except (OSError, ValueError):
            self.enabled = False
            return
        self._last_len = 0
        self._draw(force=True)

    def close(self) -> None:
        """Draw the final state and end the line (once)."""
        if self._closed:
            return
        self._closed = True
        self.item = ""
        self._draw(force=True, end="\n")

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
