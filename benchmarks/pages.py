"""What every benchmark script writes, written one way: the command that reproduces a page, its markdown tables,
the page itself, its JSON data and its PNG plots (matplotlib without a display)."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Any, Iterable, Sequence


def command(script: str, argv: Sequence[str] | None = None) -> str:
    """``python benchmarks/<script> <args>``: the line a page quotes to reproduce itself (``argv``: the script's
    arguments, default this process's)."""
    args = list(sys.argv[1:] if argv is None else argv)
    return " ".join(["python", f"benchmarks/{script}", *(shlex.quote(str(a)) for a in args)])


def md_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    """A markdown table's lines: the header, its rule, one line per row (cells as ``str``)."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(str(c) for c in row) + " |" for row in rows)]


def write_page(path: Path, lines: Sequence[str] | str) -> str:
    """Write a markdown page (lines joined by newlines, one trailing newline); return its text."""
    text = lines if isinstance(lines, str) else "\n".join(lines)
    text = text.rstrip("\n") + "\n"
    Path(path).write_text(text)
    return text


def write_json(path: Path, data: Any) -> None:
    """Write a page's data (``float`` for what JSON does not know, e.g. numpy scalars)."""
    Path(path).write_text(json.dumps(data, indent=1, default=float) + "\n")


def pyplot():
    """``matplotlib.pyplot`` on the file-only Agg backend (benchmarks run on machines without a display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path, dpi: int = 110) -> None:
    """Save ``fig`` as a PNG and free it."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
