"""Progress of long work, shown by one process (rank 0): a tqdm bar on a terminal, milestone lines otherwise.

Off entirely with `enabled=False` (`--quiet`, or any rank but 0). When standard error is not a terminal (a log
file, CI, a pipe) no bar is drawn; the milestone lines (`note`) still appear, one per line, so logs stay readable.
"""

from __future__ import annotations

import sys
from typing import TextIO

from tqdm import tqdm


class Progress:
    def __init__(self, desc: str, unit: str = "it", enabled: bool = True, prefix: str = "",
                 stream: TextIO | None = None, bar: bool = True) -> None:
        """`enabled=False` shows nothing; `bar=False` keeps the milestone lines but never draws a bar."""
        self.desc, self.unit, self.enabled, self.prefix, self.want_bar = desc, unit, enabled, prefix, bar
        self.stream = stream or sys.stderr
        self.bar: tqdm | None = None

    @classmethod
    def for_loading(cls, enabled: bool) -> Progress:
        """Checkpoint reading on rank 0: bytes, and a line per finished file."""
        return cls("loading", unit="B", enabled=enabled, prefix="rank 0: ")

    @property
    def interactive(self) -> bool:
        return self.enabled and self.want_bar and self.stream.isatty()

    def start(self, total: float | None) -> Progress:
        if self.interactive and self.bar is None:
            scale = self.unit == "B"
            self.bar = tqdm(total=total, desc=self.desc, unit=self.unit, unit_scale=scale, unit_divisor=1024 if scale
                            else 1000, file=self.stream, leave=True, dynamic_ncols=True)
        return self

    def update(self, n: float = 1, **postfix: object) -> None:
        if self.bar is not None:
            if postfix:
                self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(n)

    def set_total(self, total: float) -> None:
        if self.bar is not None:
            self.bar.total = total
            self.bar.refresh()

    def note(self, line: str, stream: TextIO | None = None) -> None:
        """A milestone line (a file finished, a validation score) on `stream` (default: the bar's), printed
        above the bar while one is drawn."""
        if not self.enabled:
            return
        stream = stream or self.stream
        if self.bar is not None:
            self.bar.write(self.prefix + line, file=stream)
        else:
            print(self.prefix + line, file=stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def silent() -> Progress:
    return Progress("", enabled=False)
