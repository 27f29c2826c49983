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
    python tests/_surface.py --uses        # every DeepSpeed internal name our package uses, where, row or not

**Which of our names are DeepSpeed's internals** (:func:`internal_uses`, read with ``ast``, nothing imported):

* a name DeepSpeed defines with a leading underscore (``def _x``, ``self._x =``, a module-level ``_x =``),
  a name-mangled one (``_Class__x``, or a string ``"x"`` in a file that builds ``"_Class__" + x``), and
  a dunder DeepSpeed defines that Python does not (``deepspeed.ops.__compatible_ops__``);
* a name imported from a DeepSpeed module other than :data:`PUBLIC_MODULES`
  (``from deepspeed.runtime.utils import is_invalid_grad_norm``);
* an attribute (read, written, or named in ``getattr``/``setattr``/``hasattr``) that DeepSpeed defines
  in its internal code (``runtime/``, ``ops/``, ``git_version_info.py``: ``opt.sub_group_to_group_id``,
  ``param.ds_tensor``), unless it is also public (a name of :data:`PUBLIC_MODULES`, a method of the
  engine or one of :data:`PUBLIC_ENGINE_ATTRIBUTES`, a method of the accelerator or of ``deepspeed.comm``),
  a name of Python or torch, or one our package defines itself (a function, class, class attribute, an
  attribute set in ``__init__``). A name both internal and public (``loss_scale``: the Stage-3
  optimizer's attribute and an engine method) cannot be told apart by name and is not reported.

A name is covered by a row when it is one of the row's names (every `` `code` `` of the name cell, each
dotted part: ``DeepSpeedEngine.save_checkpoint`` covers both), its DeepSpeed spelling or our
spelling; there is no prefix matching (``_release_swap_buffers`` is not covered by a row of
``release_swap_buffers``).
"""
from __future__ import annotations

import ast
import dataclasses
import functools
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
    names: list = dataclasses.field(default_factory=list)  # every `code` of the name cell

    @property
    def ds_token(self) -> str:
        return self.ds_spelling or self.name.rsplit(".", 1)[-1].removesuffix("()")

    @property
    def covers(self) -> set:
        """The names this row documents: each identifier in a `code` of its name cell (every dotted
        part), its DeepSpeed spelling and ours. Exact names only: no prefix or underscore matching."""
        out = {w for n in self.names for w in re.findall(r"\w+", n)}
        return out | {self.ds_token, self.our_token.strip('"')}


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
        row = Row(i, names[0], kind, ds.group(1), int(ds.group(2)), ours, "", breaks, names=names)
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
                out.append(f"{where}: {r.ds_token!r} is not within {DS_SLACK} lines of "
                           f"deepspeed/{r.ds_file}:{r.ds_line}")
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


# ---------------------------------------------------------------------------- DeepSpeed's internal names in our code
#: the one part of the package that may use DeepSpeed's internal names (each one with a row)
ADAPTER = "aidaptiv_ds/integration/"
#: names our code uses that DeepSpeed's internals define too, but that are not DeepSpeed's objects where we use them
COINCIDENCES = {
    # our own private attributes
    "_sizes": "integration/config.py: a validator",
    # other libraries' attributes
    "SCHEDULER": "vLLM's KVConnectorRole", "request_id": "vLLM's requests", "num_tokens": "vLLM's requests",
    "create": "the OpenAI client", "decoder": "tokenizers", "get_state": "numpy.random", "set_state": "numpy.random",
    "grid": "matplotlib", "loader": "importlib's module spec", "logits": "transformers' model output",
    "num_hidden_layers": "transformers' model config",
    "num_key_value_heads": "transformers' model config", "signature": "inspect.signature", "wrapped": "bench/aio.py: the op module we wrap",
    "collect": "Python's gc.collect", "_exit": "Python's os._exit", "training": "torch.nn.Module.training",
}
#: DeepSpeed modules whose names are its public API; a name imported from any other DeepSpeed module is internal
PUBLIC_MODULES = ("deepspeed", "deepspeed.comm", "deepspeed.accelerator", "deepspeed.zero")
#: DeepSpeed files whose non-underscore names are public: the package's and ``deepspeed.zero``'s names, the
#: engine's methods (``engine.backward``, ``engine.save_16bit_model``), the accelerator and ``deepspeed.comm``
_PUBLIC_FILES = ("__init__.py", "runtime/zero/__init__.py", "runtime/engine.py")
_PUBLIC_DIRS = ("comm/", "accelerator/")
#: where DeepSpeed's internal names are defined
_INTERNAL_DIRS = ("runtime/", "ops/")
_INTERNAL_FILES = ("git_version_info.py",)
#: the engine's instance attributes that its users read (the engine's methods are public anyway; its other
#: attributes, most of them internal state, are not)
PUBLIC_ENGINE_ATTRIBUTES = {"global_rank"}
_MANGLED = re.compile(r"_([A-Z]\w*?)__([a-z]\w*)")


@dataclasses.dataclass(frozen=True)
class DeepSpeedNames:
    """What DeepSpeed 0.19.8 defines, read from its source: ``private`` (leading underscore, or a dunder
    Python does not define), ``internal`` (non-underscore names of its internal code that are not also
    public), ``classes`` (for name-mangled spellings)."""
    private: frozenset
    internal: frozenset
    classes: frozenset


def _assigned_names(body: list) -> set:
    out = set()
    for b in body:
        targets = b.targets if isinstance(b, ast.Assign) else [b.target] if isinstance(b, ast.AnnAssign) else []
        out |= {t.id for t in targets if isinstance(t, ast.Name)}
    return out


def _defined(tree: ast.Module, exports: bool = False, attributes: bool = True) -> set:
    """Names a module defines: functions, classes, module and class attributes, ``x.attr = ...`` targets,
    string constants spelling an underscored name (``setattr(sys, "_x", m)``); with ``exports`` also the
    names it imports (a package's ``__init__``)."""
    out = _assigned_names(tree.body)
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
            if isinstance(n, ast.ClassDef):
                out |= _assigned_names(n.body)
        elif exports and isinstance(n, (ast.Import, ast.ImportFrom)):
            out |= {(a.asname or a.name).split(".")[0] for a in n.names}
        elif attributes and isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
            out.add(n.attr)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str) and re.fullmatch(r"_\w+", n.value):
            out.add(n.value)  # globals()["__compatible_ops__"], setattr(sys, "_deepspeed_pin_memory_op_module", m)
    return out


_DS_NAMES: dict = {}


def deepspeed_names(ds_root: pathlib.Path) -> DeepSpeedNames:
    """The names DeepSpeed defines, sorted into private and internal (see the module docstring)."""
    if ds_root in _DS_NAMES:
        return _DS_NAMES[ds_root]
    import types

    python = set(dir(object)) | set(dir(type)) | set(dir(types.ModuleType)) | set(dir(types.FunctionType)) \
        | set(dir(BaseException)) | {"__version__", "__file__", "__path__", "__all__", "__wrapped__", "__enter__",
                                     "__exit__", "__call__", "__getattr__", "__iter__", "__len__", "__getitem__",
                                     "__post_init__", "__getstate__", "__setstate__", "__slots__", "__main__"}
    defined, public, underscored, classes = set(), set(), set(), set()
    for p in sorted(ds_root.rglob("*.py")):
        rel = p.relative_to(ds_root).as_posix()
        is_public = rel in _PUBLIC_FILES or rel.startswith(_PUBLIC_DIRS)
        if not (is_public or rel.startswith(_INTERNAL_DIRS) or rel in _INTERNAL_FILES):
            continue
        try:
            tree = ast.parse(p.read_text(errors="ignore"))
        except SyntaxError:
            continue
        if is_public:
            public |= _defined(tree, exports=rel.endswith("__init__.py"), attributes=False)
            underscored |= {n for n in _defined(tree) if n.startswith("_")}
        else:
            defined |= _defined(tree)
        classes |= {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    private = {n for n in defined | underscored if n.startswith("_") and not (n.startswith("__") and n.endswith("__"))}
    private |= {n for n in defined if n.startswith("__") and n.endswith("__") and n not in python}
    internal = {n for n in defined if not n.startswith("_")} - public - PUBLIC_ENGINE_ATTRIBUTES
    out = DeepSpeedNames(frozenset(private), frozenset(internal), frozenset(classes))
    _DS_NAMES[ds_root] = out
    return out


_TREES: dict = {}


def _tree(path: pathlib.Path) -> ast.Module:
    """``path`` parsed (once per content)."""
    text = path.read_text()
    key = (str(path), hash(text))
    if key not in _TREES:
        _TREES[key] = ast.parse(text)
    return _TREES[key]


def our_definitions(pkg: pathlib.Path) -> set:
    """Names our package defines itself (so a use of them is ours): functions, classes, class
    attributes, module-level names, attributes set in ``__init__``/``__post_init__`` of our classes, and
    the ``args.<dest>`` of our command lines."""
    import builtins

    trees = [_tree(p) for p in sorted(pkg.rglob("*.py"))]
    classes = {n.name for t in trees for n in ast.walk(t) if isinstance(n, ast.ClassDef)}
    out = set()
    for tree in trees:
        imported = {(a.asname or a.name).split(".")[0] for n in ast.walk(tree)
                    if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(n.name)
            elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "add_argument":
                out |= {a.value.lstrip("-").replace("-", "_") for a in n.args  # argparse: args.<dest>
                        if isinstance(a, ast.Constant) and isinstance(a.value, str)}
                out |= {k.value.value for k in n.keywords if k.arg == "dest" and isinstance(k.value, ast.Constant)}
            if isinstance(n, ast.ClassDef):
                # a class built on a base given at run time (DeepSpeed's Stage 3: ``class X(..., base)``) sets
                # DeepSpeed's attributes in its __init__, not ours
                built_on = {b.id for b in n.bases if isinstance(b, ast.Name)} - classes - imported - set(dir(builtins))
                out |= _assigned_names(n.body)
                for b in n.body:
                    if isinstance(b, ast.FunctionDef) and b.name in ("__init__", "__post_init__") and not built_on:
                        out |= {a.attr for a in ast.walk(b) if isinstance(a, ast.Attribute)
                                and isinstance(a.ctx, ast.Store) and isinstance(a.value, ast.Name)
                                and a.value.id == "self"}
        out |= _assigned_names(tree.body)
    return out


@functools.lru_cache(maxsize=1)
def _foreign() -> frozenset:
    """Attribute names of Python's and torch's own objects (a DeepSpeed object's ``.dtype`` is torch's)."""
    import collections
    import importlib.machinery
    import logging
    import os
    import threading
    import types
    import weakref

    import torch

    out = set(vars(logging.getLogger("aidaptiv_ds")))  # a logger's instance attributes (.disabled)
    for o in (torch.Tensor, torch.nn.Module, torch.nn.Parameter, torch.optim.Optimizer, torch.dtype, torch.device,
              torch, torch.utils, dict, list, str, set, tuple, int, float, bytes, object, types.ModuleType,
              BaseException, threading, pathlib.Path, os, os.path, sys, collections, logging.Logger,
              importlib.machinery.ModuleSpec, weakref):
        out |= set(dir(o))
    return frozenset(out | {"param_groups", "state", "defaults"})  # and a torch optimizer's instance attributes


def _is_public_module(mod: str) -> bool:
    return mod in PUBLIC_MODULES


def internal_uses(path: pathlib.Path, names: DeepSpeedNames, ours: set, foreign: set, overrides: bool = True,
                  coincidences=None) -> list:
    """``(line, name, how)`` for each use of a DeepSpeed internal name in one of our files (the rules of
    the module docstring). ``how``: ``imported from <module>``, ``attribute``, ``defined`` (an override:
    a ``def`` of a DeepSpeed private name; only looked for where ``overrides``, as a ``def`` outside
    ``integration/`` cannot override anything of DeepSpeed's), ``string`` (``getattr``/``setattr`` or a
    name-mangled spelling). Names in ``coincidences`` (default :data:`COINCIDENCES`) are left out."""
    tree = _tree(path)
    out = []
    mangled_file = any(isinstance(n, ast.Constant) and isinstance(n.value, str)
                       and re.fullmatch(r"_[A-Z]\w*__", n.value) for n in ast.walk(tree))

    def private(name: str) -> bool:
        if name in names.private:
            return True
        m = _MANGLED.fullmatch(name)
        return bool(m and m.group(1) in names.classes)

    def internal(name: str) -> bool:
        return name in names.internal and name not in ours and name not in foreign

    by_string = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("getattr", "setattr", "hasattr",
                                                                                       "delattr") \
                and len(n.args) >= 2 and isinstance(n.args[1], ast.Constant) and isinstance(n.args[1].value, str):
            by_string.add(id(n.args[1]))
    for n in ast.walk(tree):
        line = getattr(n, "lineno", 0)
        if isinstance(n, ast.ImportFrom) and n.module and n.module.split(".")[0] == "deepspeed" and n.level == 0:
            if not _is_public_module(n.module):
                out.extend((line, a.name, f"imported from {n.module}") for a in n.names)
        elif isinstance(n, ast.Attribute):
            if private(n.attr) and n.attr not in ours:
                out.append((line, n.attr, "attribute"))
            elif internal(n.attr):
                out.append((line, n.attr, "attribute"))
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and private(n.name) and overrides:
            out.append((line, n.name, "defined"))
        elif isinstance(n, ast.Constant) and isinstance(n.value, str) and re.fullmatch(r"\w+", n.value):
            v = n.value
            if private(v) and v not in ours and not v.startswith("__"):
                out.append((line, v, "string"))
            elif id(n) in by_string and internal(v):
                out.append((line, v, "string"))
            elif mangled_file and not v.startswith("_") and "__" + v in names.private:  # "_Class__" + "param_queue"
                out.append((line, "__" + v, "string"))
    skip = COINCIDENCES if coincidences is None else coincidences
    return [u for u in out if u[1] not in skip]


def in_adapter(rel: str) -> bool:
    """Whether ``rel`` (``aidaptiv_ds/...``) is in ``integration/``, the one place DeepSpeed's internals may be used."""
    return rel.startswith(ADAPTER)


def uses_by_file(pkg: pathlib.Path, ds_root: pathlib.Path, coincidences=None) -> dict:
    """``{path relative to pkg's parent: [(line, name, how)]}`` over every source file of ``pkg``
    (``coincidences``: as for :func:`internal_uses`)."""
    names, ours, foreign = deepspeed_names(ds_root), our_definitions(pkg), _foreign()
    out = {}
    for p in sorted(pkg.rglob("*.py")):
        rel = p.relative_to(pkg.parent).as_posix()
        out[rel] = internal_uses(p, names, ours, foreign, overrides=in_adapter(rel), coincidences=coincidences)
    return out


def _print_uses(pkg: pathlib.Path, ds_root: pathlib.Path, rows: list[Row]) -> int:
    """``--uses``: each use of a DeepSpeed internal name (``row`` where the table covers it), then the
    counts inside and outside ``integration/``. Exit 1 when a name is used outside it or has no row."""
    covered = set().union(*(r.covers for r in rows)) if rows else set()
    counts = {True: [0, set(), set()], False: [0, set(), set()]}  # adapter? -> [uses, names, files]
    bad = 0
    for rel, uses in uses_by_file(pkg, ds_root).items():
        for line, name, how in sorted(uses):
            inside = in_adapter(rel)
            ok = inside and name in covered
            bad += not ok
            c = counts[inside]
            c[0] += 1
            c[1].add(name)
            c[2].add(rel)
            flag = "" if ok else " <- no row" if inside else " <- outside integration/"
            print(f"{rel}:{line}: {name} ({how}){flag}")
    for inside, label in ((True, "in integration/"), (False, "outside integration/")):
        n, names, files = counts[inside]
        print(f"{label}: {n} uses of {len(names)} DeepSpeed internal names in {len(files)} files")
    return 1 if bad else 0


def main(argv: list[str]) -> int:
    text = DOC.read_text()
    if "--uses" in argv:
        root = deepspeed_root()
        if root is None:
            print("DeepSpeed is not installed", file=sys.stderr)
            return 2
        return _print_uses(REPO / "aidaptiv_ds", root, parse(text))
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
