"""Reads and checks the table of ``docs/deepspeed-surface.md``; ``--update`` refreshes our line numbers.

Each table row names a DeepSpeed identifier, where DeepSpeed 0.19.8 has it (``file:line`` under the
installed ``deepspeed/`` package) and where aidaptiv_ds touches it (one or more ``path:line`` under
the repository, optionally ``as `token``` when our spelling differs, e.g. a name-mangled attribute
built from a string). A row is true when

* the DeepSpeed token occurs in the cited DeepSpeed file within :data:`DS_SLACK` lines of the cited
  line (DeepSpeed is pinned to 0.19.8, so these lines never move), and
* our token occurs in each cited file of ours within :data:`OUR_SLACK` lines of the cited line.

The token of a DeepSpeed name is its last dotted component without ``()`` (``Init.__init__`` ->
``__init__``; ``PartitionedParameterCoordinator.__param_queue`` -> ``__param_queue``), or the
``as `x``` spelling given in the DeepSpeed cell.

When our code moves, refresh the line numbers (each is set to the nearest line holding the token;
rows whose token is gone are reported and must be edited by hand)::

    python tests/_surface.py --update      # rewrites docs/deepspeed-surface.md in place
    python tests/_surface.py               # prints the rows that are wrong, exit 1 if any
"""
from __future__ import annotations

import dataclasses
import pathlib
import re
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "deepspeed-surface.md"
DS_SLACK = 3
OUR_SLACK = 8

_CODE = re.compile(r"`([^`]+)`")
_LOC = re.compile(r"^([\w./-]+\.(?:py|cpp|h)):(\d+)$")


def deepspeed_root() -> pathlib.Path | None:
    """The installed DeepSpeed package directory (found without importing DeepSpeed), or None."""
    import importlib.util

    spec = importlib.util.find_spec("deepspeed")
    if spec is None or not spec.submodule_search_locations:
        return None
    return pathlib.Path(list(spec.submodule_search_locations)[0])


@dataclasses.dataclass
class Row:
    line_no: int  # line of the row in the doc
    name: str
    kind: str
    ds_file: str
    ds_line: int
    ours: list  # [(path, line)]
    our_token: str
    breaks: str
    ds_spelling: str | None = None  # "as `x`" in the DeepSpeed cell: DeepSpeed's own spelling

    @property
    def ds_token(self) -> str:
        return self.ds_spelling or self.name.rsplit(".", 1)[-1].removesuffix("()")


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def parse(text: str) -> list[Row]:
    """The rows of the surface table (the first Markdown table whose header starts ``| DeepSpeed name``).

    Raises:
        ValueError: a row without the expected cells, naming its line.
    """
    rows, in_table = [], False
    for i, line in enumerate(text.splitlines(), start=1):
        if line.startswith("| DeepSpeed name"):
            in_table = True
            continue
        if not in_table:
            continue
        if not line.startswith("|"):
            if rows:
                break
            continue
        if set(line) <= set("|-: "):
            continue
        cells = _cells(line)
        if len(cells) != 5:
            raise ValueError(f"{DOC.name}:{i}: expected 5 cells, got {len(cells)}: {line}")
        name_cell, kind, ds_cell, ours_cell, breaks = cells
        names = _CODE.findall(name_cell)
        ds_parts = ds_cell.split(" as ")
        ds = _LOC.match((_CODE.findall(ds_parts[0]) or [""])[0])
        if not names or not ds:
            raise ValueError(f"{DOC.name}:{i}: need `name` and `deepspeed/file.py:line`: {line}")
        ours, token = [], None
        parts = ours_cell.split(" as ")
        for code in _CODE.findall(parts[0]):
            m = _LOC.match(code)
            if not m:
                raise ValueError(f"{DOC.name}:{i}: our location {code!r} is not path:line")
            ours.append((m.group(1), int(m.group(2))))
        if len(parts) > 1:
            token = _CODE.findall(parts[1])[0]
        if not ours:
            raise ValueError(f"{DOC.name}:{i}: no location of ours")
        row = Row(i, names[0], kind, ds.group(1), int(ds.group(2)), ours, "", breaks)
        if len(ds_parts) > 1:
            row.ds_spelling = _CODE.findall(ds_parts[1])[0]
        row.our_token = token or row.ds_token
        rows.append(row)
    return rows


def _near(lines: list[str], token: str, line: int, slack: int) -> bool:
    lo, hi = max(1, line - slack), min(len(lines), line + slack)
    return any(token in lines[k - 1] for k in range(lo, hi + 1))


def problems(rows: list[Row], ds_root: pathlib.Path | None, repo: pathlib.Path = REPO) -> list[str]:
    """What is wrong with each row (empty when the table is true). DeepSpeed-side checks are skipped
    when DeepSpeed is not installed (``ds_root`` None)."""
    out, cache = [], {}

    def read(p: pathlib.Path):
        if p not in cache:
            cache[p] = p.read_text().splitlines() if p.is_file() else None
        return cache[p]

    for r in rows:
        where = f"{DOC.name}:{r.line_no} ({r.name})"
        if ds_root is not None:
            lines = read(ds_root / r.ds_file)
            if lines is None:
                out.append(f"{where}: DeepSpeed has no file {r.ds_file}")
            elif not _near(lines, r.ds_token, r.ds_line, DS_SLACK):
                out.append(f"{where}: {r.ds_token!r} is not within {DS_SLACK} lines of deepspeed/{r.ds_file}:{r.ds_line}")
        for path, line in r.ours:
            lines = read(repo / path)
            if lines is None:
                out.append(f"{where}: no file {path}")
            elif not any(r.our_token in ln for ln in lines):
                out.append(f"{where}: {path} no longer contains {r.our_token!r}: update or remove the row")
            elif not _near(lines, r.our_token, line, OUR_SLACK):
                out.append(f"{where}: {r.our_token!r} is not within {OUR_SLACK} lines of {path}:{line} "
                           f"(run `python tests/_surface.py --update`)")
    return out


def update(text: str, repo: pathlib.Path = REPO) -> tuple[str, list[str]]:
    """``text`` with each of our line numbers moved to the nearest line holding the row's token; and the
    rows whose token is gone from a cited file (left as they are)."""
    lines = text.splitlines(keepends=True)
    gone = []
    for r in parse(text):
        row = lines[r.line_no - 1]
        cells = row.split("|")
        ours_cell = cells[4]
        for path, line in r.ours:
            p = repo / path
            src = p.read_text().splitlines() if p.is_file() else []
            hits = [k for k, ln in enumerate(src, start=1) if r.our_token in ln]
            if not hits:
                gone.append(f"{DOC.name}:{r.line_no} ({r.name}): {path} has no {r.our_token!r}")
                continue
            best = min(hits, key=lambda k: (abs(k - line), k))
            ours_cell = ours_cell.replace(f"`{path}:{line}`", f"`{path}:{best}`", 1)
        cells[4] = ours_cell
        lines[r.line_no - 1] = "|".join(cells)
    return "".join(lines), gone


def main(argv: list[str]) -> int:
    text = DOC.read_text()
    if "--update" in argv:
        new, gone = update(text)
        if new != text:
            DOC.write_text(new)
            print(f"updated {DOC.relative_to(REPO)}")
        for g in gone:
            print(g, file=sys.stderr)
        text = new
    bad = problems(parse(text), deepspeed_root())
    for b in bad:
        print(b, file=sys.stderr)
    print(f"{len(parse(text))} rows, {len(bad)} problems")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
