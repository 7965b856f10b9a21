"""Where a row of a dataset came from, for the messages about it: a data file and its line (or row), not the row's
position after the eval hold-out shuffled it or a mixture concatenated it.

`load_datasets` numbers every source's rows (`ROW_COLUMN`) before anything reorders them; tokenization names a bad
row with `RowOrigin.where(number)`, which is worked out only when a message is written (reading a JSON-lines file up
to the row, blank lines skipped as datasets skips them). `bad_json_line` finds the first line of a JSON file that
datasets' reader (pyarrow, which names no line) failed on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from hftrain.data.jsonlines import BAD_LINE, parse_line

ROW_COLUMN = "hftrain_row"  # a source's row number, 0-based, added before the hold-out shuffles the rows


def _is_json_array(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4096).lstrip().startswith(b"[")


def bad_json_line(path: str | Path) -> str | None:
    """'file, line N: why' for the first line of a JSON file that is not a JSON object (JSON lines) or where the
    document stops being JSON (a file holding one array); None when the file reads as JSON."""
    path = Path(path)
    if _is_json_array(path):
        try:
            json.loads(path.read_bytes())
        except json.JSONDecodeError as exc:
            return f"{path}, line {exc.lineno} column {exc.colno}: not JSON ({exc.msg})"
        except ValueError as exc:  # not UTF-8
            return f"{path}: not JSON ({exc})"
        return None
    with path.open("rb") as f:
        for line, text in enumerate(f, 1):
            if text.strip():
                bad = parse_line(text, str(path), line).get(BAD_LINE)
                if bad is not None:
                    return bad
    return None


@dataclass(frozen=True)
class RowOrigin:
    """A source of rows: `name` as the recipe gives it, the local file it was read from (None: a hub dataset or a
    saved folder) and a note added to each place (e.g. that the row was held out for evaluation)."""

    name: str
    path: str | None = None
    note: str = ""
    # the last row located: (row, its line, the byte offset after it); a later row is found reading on from there,
    # so naming the bad rows of a stream in order reads its file once
    _last: dict = field(default_factory=dict, compare=False, repr=False)

    def describe(self, row: int) -> str:
        path = Path(self.path) if self.path else None
        if path is not None and path.suffix.lower() in (".jsonl", ".json") and not _is_json_array(path):
            place = f"{self.name}, line {self._line(path, row)}"
        elif path is not None and path.suffix.lower() == ".csv":
            place = f"{self.name}, data row {row + 1} (after the header)"
        else:
            place = f"{self.name}, row {row + 1}"
        return place + self.note

    def _line(self, path: Path, row: int) -> int:
        """The line holding row `row` (0-based) of a JSON-lines file: datasets (and hftrain's stream reader) skip
        blank lines."""
        last = self._last.get("at", (-1, 0, 0))
        seen, line, offset = last if row > last[0] else (-1, 0, 0)
        with path.open("rb") as f:
            f.seek(offset)
            for text in f:
                line, offset = line + 1, offset + len(text)
                seen += bool(text.strip())
                if seen == row and text.strip():
                    self._last["at"] = (seen, line, offset)
                    return line
        raise ValueError(f"{path} has fewer than {row + 1} rows")

    def where(self, row: int) -> Where:
        return Where(self, row)


class Where:
    """A row's place as a message names it, worked out when formatted (`f"{where}: ..."`), so that the rows that
    are fine cost nothing."""

    __slots__ = ("origin", "row")

    def __init__(self, origin: RowOrigin, row: int):
        self.origin, self.row = origin, row

    def __str__(self) -> str:
        return self.origin.describe(self.row)

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)
