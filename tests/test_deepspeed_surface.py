"""docs/deepspeed-surface.md stays true and complete, DeepSpeed's internals stay in integration/, and
every docs/ citation in the code resolves.

* true: each row's DeepSpeed name is at the cited DeepSpeed 0.19.8 line (within 3 lines), and our
  spelling at each cited line of ours (within 8; ``python tests/_surface.py --update`` refreshes
  ours after code moves);
* complete: each DeepSpeed internal name used in integration/ (the rules of ``tests/_surface.py``: a
  private or name-mangled name, a name from a non-public DeepSpeed module, an attribute DeepSpeed's
  internal code defines, a DeepSpeed module or class attribute we assign) is a name of a row, matched
  exactly (``_release_swap_buffers`` is not covered by ``release_swap_buffers``);
* confined: no other part of the package uses one (the benchmarks, the exporter, the doctor call
  functions of integration/ instead), and every row cites integration/ only;
* citations: every ``docs/<file>.md`` named in aidaptiv_ds/, tests/, README.md and launch/ exists,
  and every ``§N`` after it is a heading of that file.

``python tests/_surface.py --uses`` lists every use with its row, and the counts.
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


@pytest.fixture(scope="module")
def rows():
    return _surface.parse(_surface.DOC.read_text())


@pytest.fixture(scope="module")
def covered(rows):
    return set().union(*(r.covers for r in rows))


@pytest.fixture(scope="module")
def uses():
    assert DS is not None, "DeepSpeed is not installed (install_requires pins deepspeed==0.19.8)"
    return _surface.uses_by_file(PKG, DS)


def test_the_table_is_read(rows):
    assert len(rows) >= 90, len(rows)
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


# ---------------------------------------------------------------------------- complete and confined
def test_every_deepspeed_internal_name_used_in_integration_has_a_row(uses, covered):
    missing: dict = {}
    for rel, found in uses.items():
        if _surface.in_adapter(rel):
            for line, name, how in found:
                if name not in covered:
                    missing.setdefault(name, []).append(f"{rel}:{line} ({how})")
    assert not missing, ("DeepSpeed internal names used without a row in docs/deepspeed-surface.md (add one; or, for "
                         "a name that is ours or another library's, an entry in _surface.COINCIDENCES):\n"
                         + "\n".join(f"{n}: {', '.join(w)}" for n, w in sorted(missing.items())))


def test_no_deepspeed_internal_name_outside_integration(uses):
    outside = [f"{rel}:{line}: {name} ({how})" for rel, found in uses.items() if not _surface.in_adapter(rel)
               for line, name, how in found]
    assert not outside, ("DeepSpeed internal names used outside aidaptiv_ds/integration/ (give integration/ a "
                         "function for it and call that):\n" + "\n".join(outside))


def test_every_row_cites_integration_only(rows):
    bad = [f"{_surface.DOC.name}:{r.line_no} ({r.name}): {path}" for r in rows for path, _ in r.ours
           if not _surface.in_adapter(path)]
    assert not bad, "rows citing code outside aidaptiv_ds/integration/:\n" + "\n".join(bad)


def test_every_coincidence_is_still_needed():
    seen = {name for found in _surface.uses_by_file(PKG, DS, coincidences=set()).values() for _, name, _ in found}
    stale = set(_surface.COINCIDENCES) - seen
    assert not stale, f"_surface.COINCIDENCES entries no longer needed; delete them: {sorted(stale)}"


def test_the_scanner_sees_each_kind_of_use(tmp_path):
    """The scanner on a planted package, against the installed DeepSpeed: a private method one underscore
    away from a row's name, a name from a non-public module, internal attributes (read, by ``getattr``),
    a name-mangled attribute set by string and one built from a prefix, a private module dunder; and
    what it must leave alone: our own private attribute, torch's and Python's names, a public engine
    method, a name imported from ``deepspeed.comm``."""
    pkg = tmp_path / "aidaptiv_ds"
    (pkg / "bench").mkdir(parents=True)
    (pkg / "integration").mkdir()
    (pkg / "bench" / "w.py").write_text(
        "import deepspeed\nimport deepspeed.ops\nfrom deepspeed.comm import get_rank\n"
        "from deepspeed.runtime.utils import is_invalid_grad_norm\n\n\n"
        "def f(opt, p, engine):\n"
        "    opt._release_swap_buffers(0)\n"                        # 8
        "    g = opt.sub_group_to_group_id[0]\n"                     # 9
        "    n = getattr(p, 'ds_numel', 0)\n"                        # 10
        "    deepspeed.ops.__compatible_ops__['x'] = False\n"        # 11
        "    engine.backward(p.dtype)\n"
        "    return g, n, get_rank(), is_invalid_grad_norm\n")
    (pkg / "integration" / "s.py").write_text(
        "_PREFIX = '_PartitionedParameterCoordinator__'\n\n\n"
        "class Ours:\n"
        "    def __init__(self):\n"
        "        self._lock = None\n\n"
        "    def g(self, c):\n"
        "        setattr(self, '_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition', 1)\n"  # 9
        "        self._lock = getattr(c, _PREFIX + 'param_queue')\n"  # 10
        "        return self._lock, c.keys()\n")
    found = _surface.uses_by_file(pkg, DS)
    assert sorted((line, name) for line, name, _ in found["aidaptiv_ds/bench/w.py"]) == [
        (4, "is_invalid_grad_norm"), (8, "_release_swap_buffers"), (9, "sub_group_to_group_id"),
        (10, "ds_numel"), (11, "__compatible_ops__")], found["aidaptiv_ds/bench/w.py"]
    assert sorted((line, name) for line, name, _ in found["aidaptiv_ds/integration/s.py"]) == [
        (9, "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition"), (10, "__param_queue")], \
        found["aidaptiv_ds/integration/s.py"]
    row = _surface.parse("| DeepSpeed name | kind | DeepSpeed 0.19.8 | ours | what breaks |\n|---|---|---|---|---|\n"
                         "| `release_swap_buffers` | m | `runtime/zero/stage3.py:2784` | `a.py:1` | x |\n")[0]
    assert "release_swap_buffers" in row.covers and "_release_swap_buffers" not in row.covers


def test_every_deepspeed_attribute_we_assign_has_a_row(covered):
    """``pp.AsyncPartitionedParameterSwapper = ...``, ``OpBuilder._loaded_ops[...] = ...``, ``S.swap_in =
    ...``: an assignment to an attribute of a name bound by a DeepSpeed import; in integration/ with a
    row, nowhere else."""
    missing = []
    for p in sorted(PKG.rglob("*.py")):
        rel = str(p.relative_to(REPO))
        tree = ast.parse(p.read_text())
        ds_names = set()
        for n in ast.walk(tree):
            if isinstance(n, ast.Import):
                ds_names |= {(a.asname or a.name.split(".")[0]) for a in n.names if a.name.startswith("deepspeed")}
            elif isinstance(n, ast.ImportFrom) and (n.module or "").startswith("deepspeed"):
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
                    if isinstance(root, ast.Name) and root.id in ds_names \
                            and (t.attr not in covered or not _surface.in_adapter(rel)):
                        missing.append(f"{rel}:{n.lineno}: {ast.unparse(t)}")
    assert not missing, ("DeepSpeed attributes assigned outside integration/ or without a row in "
                         "docs/deepspeed-surface.md:\n" + "\n".join(missing))


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
