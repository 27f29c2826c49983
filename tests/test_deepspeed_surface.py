"""docs/deepspeed-surface.md stays true and complete, and every docs/ citation in the code resolves.

* true: each row's DeepSpeed name is at the cited DeepSpeed 0.19.8 line (within 3 lines), and our
  spelling at each cited line of ours (within 8; ``python tests/_surface.py --update`` refreshes
  ours after code moves);
* complete: a private DeepSpeed name used in integration/ or bench/ (an attribute or method DeepSpeed
  defines with a leading underscore, a name-mangled attribute, a DeepSpeed module or class attribute
  we assign) has a row;
* citations: every ``docs/<file>.md`` named in aidaptiv_ds/, tests/, README.md and launch/ exists,
  and every ``§N`` after it is a heading of that file.
"""
from __future__ import annotations

import ast
import pathlib
import re

import _surface
import pytest

REPO = _surface.REPO
PKG = REPO / "aidaptiv_ds"
DS = _surface.deepspeed_root()

# our own private names that DeepSpeed happens to define too (not DeepSpeed's objects)
COINCIDENCES = {"_capacity", "_handle", "_lock", "_names", "_pending", "_release", "_sizes", "_t0", "_write",
                "_timed", "_state", "_loc", "_run", "_fn", "_mean"}


@pytest.fixture(scope="module")
def rows():
    return _surface.parse(_surface.DOC.read_text())


@pytest.fixture(scope="module")
def tokens(rows):
    out = set()
    for r in rows:
        out.add(r.ds_token)
        out.add(r.our_token.strip('"'))
        out.add(r.name.rsplit(".", 1)[-1].removesuffix("()"))
    return out


def test_the_table_is_read(rows):
    assert len(rows) >= 70, len(rows)
    assert {r.kind for r in rows} >= {"name-mangled attribute read", "private method overridden",
                                      "private method called", "module attribute swapped (looked up when `Init` "
                                                                "builds its swapper)"}


def test_every_row_is_at_its_cited_lines(rows):
    assert DS is not None, "DeepSpeed is not installed (install_requires pins deepspeed==0.19.8)"
    bad = _surface.problems(rows, DS)
    assert not bad, "docs/deepspeed-surface.md is out of date:\n" + "\n".join(bad)


def test_the_check_fails_on_a_moved_or_vanished_name(rows, tmp_path):
    """The checker itself: a DeepSpeed line off by 10, our name moved by 30 lines, our name gone."""
    import copy
    by_name = {r.name: r for r in rows}
    r0, r1, r2 = (copy.deepcopy(by_name[n]) for n in ("deepspeed.initialize",
                                                       "PartitionedParameterCoordinator.__param_queue",
                                                       "stage3.DeepSpeedZeroOptimizer_Stage3"))
    r0.ds_line += 10
    r1.ours = [(r1.ours[0][0], r1.ours[0][1] + 30)]
    r2.our_token = "name_that_is_nowhere"
    bad = _surface.problems([r0, r1, r2], DS)
    assert len(bad) == 3 and "not within 3 lines of deepspeed/" in bad[0]
    assert "run `python tests/_surface.py --update`" in bad[1] and "no longer contains" in bad[2]


def test_update_moves_our_line_numbers_to_the_name(tmp_path):
    ours = tmp_path / "aidaptiv_ds" / "integration" / "x.py"
    ours.parent.mkdir(parents=True)
    ours.write_text("\n" * 40 + "def swap_in():\n    pass\n" + "\n" * 40 + "swap_in()\n")
    doc = ("| DeepSpeed name | kind | DeepSpeed 0.19.8 | ours | what breaks if it changes |\n|---|---|---|---|---|\n"
           "| `swap_in` | swapper method | `runtime/zero/partition_parameters.py:1718` | "
           "`aidaptiv_ds/integration/x.py:50` | reads |\n")
    new, gone = _surface.update(doc, repo=tmp_path)
    assert "`aidaptiv_ds/integration/x.py:41`" in new and not gone  # nearest of lines 41 and 84 to 50
    assert _surface.problems(_surface.parse(new), DS, repo=tmp_path) == []


def _deepspeed_private_names() -> set:
    names = set()
    for p in DS.rglob("*.py"):
        s = p.read_text(errors="ignore")
        names |= set(re.findall(r"def (_[A-Za-z]\w*)\(", s))
        names |= set(re.findall(r"self\.(_[A-Za-z]\w*)\s*=", s))
        names |= set(re.findall(r"^\s*(_[A-Za-z]\w*)\s*=", s, re.M))
    return names


def _adapter_files():
    for p in sorted(PKG.rglob("*.py")):
        if p.relative_to(PKG).parts[0] in ("integration", "bench"):
            yield p


def test_every_private_deepspeed_name_we_use_has_a_row(tokens):
    ds_private = _deepspeed_private_names()
    missing = {}
    for p in _adapter_files():
        tree = ast.parse(p.read_text())
        mangled = any(isinstance(n, ast.Constant) and isinstance(n.value, str) and re.fullmatch(r"_[A-Z]\w*__", n.value)
                      for n in ast.walk(tree))
        for n in ast.walk(tree):
            found = []
            if isinstance(n, ast.Attribute):
                found.append(n.attr)
            elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append(n.name)
            elif isinstance(n, ast.Constant) and isinstance(n.value, str) and re.fullmatch(r"\w+", n.value):
                found.append(n.value)
                if mangled and not n.value.startswith("_"):  # "param_queue" -> DeepSpeed's self.__param_queue
                    found.append("__" + n.value)
            for name in found:
                private = name.startswith("_") and not (name.startswith("__") and name.endswith("__"))
                if private and (name in ds_private or name.startswith("__")) and name not in COINCIDENCES \
                        and name not in tokens and name.lstrip("_") not in tokens and not name.startswith("_aidaptiv"):
                    if name.startswith("__") and not _mangled_in_deepspeed(name):
                        continue
                    missing.setdefault(name, set()).add(str(p.relative_to(REPO)))
    assert not missing, ("DeepSpeed private names used without a row in docs/deepspeed-surface.md "
                         "(add one, or list our own coincident name in COINCIDENCES): " + repr(missing))


_MANGLED_CACHE: dict = {}


def _mangled_in_deepspeed(name: str) -> bool:
    if not _MANGLED_CACHE:
        text = (DS / "runtime" / "zero" / "partitioned_param_coordinator.py").read_text()
        _MANGLED_CACHE["names"] = set(re.findall(r"(?:self\.|def )(__[a-z]\w*[a-z0-9])\b", text))
    return name in _MANGLED_CACHE["names"]


def test_every_deepspeed_attribute_we_assign_has_a_row(tokens):
    """``pp.AsyncPartitionedParameterSwapper = ...``, ``OpBuilder._loaded_ops[...] = ...``, ``S.swap_in =
    ...``: an assignment to an attribute of a name bound by a DeepSpeed import."""
    missing = []
    for p in _adapter_files():
        tree = ast.parse(p.read_text())
        ds_names = set()
        for n in ast.walk(tree):
            if isinstance(n, ast.Import):
                ds_names |= {(a.asname or a.name.split(".")[0]) for a in n.names if a.name.startswith("deepspeed")}
            elif isinstance(n, ast.ImportFrom) and (n.module or "").startswith("deepspeed") and not n.level:
                ds_names |= {a.asname or a.name for a in n.names}
        for n in ast.walk(tree):
            if not isinstance(n, ast.Assign):
                continue
            for t in n.targets:
                t = t.value if isinstance(t, ast.Subscript) else t
                if isinstance(t, ast.Attribute) and isinstance(t.value, (ast.Name, ast.Attribute)):
                    root = t.value
                    while isinstance(root, ast.Attribute):
                        root = root.value
                    if isinstance(root, ast.Name) and root.id in ds_names and t.attr not in tokens:
                        missing.append(f"{p.relative_to(REPO)}:{n.lineno}: {ast.unparse(t)}")
    assert not missing, "DeepSpeed attributes assigned without a row in docs/deepspeed-surface.md:\n" + "\n".join(missing)


# ---------------------------------------------------------------------------- citations of docs/
_CITE = re.compile(r"docs/([\w.-]+\.md)((?:[`\s]*(?:§|section )[\d.]+(?:-[\d.]+)?,?)*)")


def _headings(doc: pathlib.Path) -> set:
    out = set()
    for line in doc.read_text().splitlines():
        m = re.match(r"#+\s+(?:Appendix\s+)?([\dA-Z]+(?:\.\d+)*)\.?\s", line)
        if m:
            out.add(m.group(1))
    return out


def _citing_files():
    yield from sorted(PKG.rglob("*.py"))
    yield from sorted((REPO / "tests").rglob("*.py"))
    yield from sorted((REPO / "launch").glob("*"))
    yield REPO / "README.md"


def test_every_docs_citation_resolves():
    seen, bad = 0, []
    for f in _citing_files():
        if not f.is_file() or f.suffix not in (".py", ".md"):
            continue
        text = f.read_text()
        for m in _CITE.finditer(text):
            seen += 1
            doc = REPO / "docs" / m.group(1)
            where = f"{f.relative_to(REPO)}:{text.count(chr(10), 0, m.start()) + 1}"
            if not doc.is_file():
                bad.append(f"{where}: docs/{m.group(1)} does not exist")
                continue
            heads = _headings(doc)
            for sec in re.findall(r"[\d.]+(?:-[\d.]+)?", m.group(2)):
                for one in sec.split("-"):
                    one = one.rstrip(".")
                    if one and one not in heads and (one.split(".")[0] + "." + one.split(".")[-1]) not in heads:
                        bad.append(f"{where}: docs/{m.group(1)} has no section {one}")
        for m in re.finditer(r"(?<![/\w])deepspeed-seams\.md", text):
            if f.suffix == ".py" and f.name != pathlib.Path(__file__).name:
                bad.append(f"{f.relative_to(REPO)}: cites deepspeed-seams.md without docs/")
    assert seen >= 14, seen  # the scan itself works
    assert not bad, "\n".join(bad)
