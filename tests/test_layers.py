"""The layers of docs/design.md, enforced on the source: every ``import`` in aidaptiv_ds (also the lazy
ones inside functions) points down or sideways as allowed, and DeepSpeed is imported only where the
design says. Parsed with ``ast``; nothing is imported, so the test is instant and cannot be fooled
by import order.

Ranks, bottom-up (a module may import its own package and anything of a lower rank; packages of
the same rank are independent of each other):

0. ``errors``: the error root (imports nothing);
1. ``units``, ``jsonsafe``, ``ports``, ``spans``, ``torch_env``, ``process_group``: leaf utilities (standard
   library and ``errors`` only);
2. ``io``: reads and writes of bytes at file offsets;
3. ``store``: slabs, extents, striping, the ledger;
4. ``tiers``: the DRAM tier and eviction;
5. ``telemetry``: counters, NVML, host facts;
6. ``planner``, ``checkpoint``;
7. ``integration``: the DeepSpeed adapter;
8. ``inference``: the prefix KV cache (on the store and the DRAM tier; the ZeRO-Inference parameter
   gather through ``integration``);
9. ``bench``: measurements;
10. ``cli``, ``finetune``: the applications;
11. ``_autoload`` (installs the hooks), 12. ``__init__`` and ``run``: the entry points.

Any DeepSpeed module may be imported by ``integration/`` only. ``bench/``, ``finetune/`` and the
generation job (``cli/generate.py``) are DeepSpeed *applications* and may import DeepSpeed's public
API (``deepspeed``, ``deepspeed.comm``, ``deepspeed.accelerator``), and so may the doctor's version
report (``cli/doctor.py``: :func:`check_versions`), plus the exceptions listed in
:data:`DEEPSPEED_EXCEPTIONS`. What they need of DeepSpeed's internals (its op registry, its swapper,
the optimizer's private state) is a function of ``integration/``; ``tests/test_deepspeed_surface.py``
checks the names they use as well.
"""
from __future__ import annotations

import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[1]
PKG = REPO / "aidaptiv_ds"

RANK = {"errors": 0, "units": 1, "jsonsafe": 1, "ports": 1, "spans": 1, "torch_env": 1, "process_group": 1,
        "io": 2, "store": 3, "tiers": 4, "telemetry": 5,
        "planner": 6, "checkpoint": 6, "integration": 7, "inference": 8, "bench": 9, "cli": 10, "finetune": 10,
        "_autoload": 11, "__init__": 12, "run": 12}

DEEPSPEED_PACKAGES = {"integration"}
#: the packages that are DeepSpeed applications: they may import PUBLIC_DEEPSPEED
APPLICATION_PACKAGES = {"bench", "finetune"}
DOCTOR_FUNCTIONS = {"check_versions"}
PUBLIC_DEEPSPEED = {"deepspeed", "deepspeed.comm", "deepspeed.accelerator"}
#: application files outside the application packages that may import PUBLIC_DEEPSPEED (they run deepspeed.initialize)
APPLICATION_FILES = {"aidaptiv_ds/cli/generate.py"}
# (file, DeepSpeed module): known imports of DeepSpeed outside the allowed places, each with its reason.
# Remove the entry when the import moves; a stale entry fails the test.
DEEPSPEED_EXCEPTIONS: dict = {}


def _unit(path: pathlib.Path, pkg: pathlib.Path = PKG) -> str:
    """The layer of a source file: its top-level package, or the root module's name."""
    rel = path.relative_to(pkg).parts
    return rel[0] if len(rel) > 1 else rel[0][:-3]


def _imports(path: pathlib.Path, pkg: pathlib.Path = PKG):
    """``(line, absolute module name, enclosing top-level function or None)`` for every import in ``path``
    (module level, inside functions, and ``importlib.import_module("...")`` with a literal name)."""
    pkg_parts = ["aidaptiv_ds", *path.relative_to(pkg).parts[:-1]]
    tree = ast.parse(path.read_text(), str(path))
    out = []

    def visit(node, func):
        for child in ast.iter_child_nodes(node):
            f = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) and func is None else func
            if isinstance(child, ast.Import):
                out.extend((child.lineno, a.name, func) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = pkg_parts[:len(pkg_parts) - (child.level - 1)]
                    mod = ".".join(base + ([child.module] if child.module else []))
                    if child.module is None:  # from .. import x: x is a submodule, or a name of the package
                        here = pkg.joinpath(*base[1:])
                        out.extend((child.lineno, f"{mod}.{a.name}" if (here / a.name).is_dir()
                                    or (here / f"{a.name}.py").is_file() else mod, func) for a in child.names)
                        continue
                else:
                    mod = child.module
                out.append((child.lineno, mod, func))
            elif (isinstance(child, ast.Call) and isinstance(child.func, (ast.Attribute, ast.Name))
                  and getattr(child.func, "attr", getattr(child.func, "id", None)) in ("import_module", "__import__")
                  and child.args and isinstance(child.args[0], ast.Constant) and isinstance(child.args[0].value, str)):
                out.append((child.lineno, child.args[0].value, func))
            visit(child, f)

    visit(tree, None)
    return out


def _sources(pkg: pathlib.Path = PKG):
    return sorted(pkg.rglob("*.py"))


def _target_unit(mod: str) -> str | None:
    parts = mod.split(".")
    if parts[0] != "aidaptiv_ds" or len(parts) == 1:
        return None  # another package, or the bare package (its __init__ runs for any import anyway)
    return parts[1]


def layer_violations(pkg: pathlib.Path = PKG) -> list[str]:
    """``file:line: what`` for every import that points up, sideways between siblings, or to an unknown layer."""
    bad = []
    for path in _sources(pkg):
        src = _unit(path, pkg)
        if src not in RANK:
            bad.append(f"{path.relative_to(pkg.parent)}: {src} has no rank (add it here and to docs/design.md)")
            continue
        for line, mod, _ in _imports(path, pkg):
            dst = _target_unit(mod)
            if dst is None or dst == src:
                continue
            if dst not in RANK:
                bad.append(f"{path.relative_to(pkg.parent)}:{line}: imports unknown {mod}")
            elif RANK[dst] >= RANK[src]:
                bad.append(f"{path.relative_to(pkg.parent)}:{line}: {src} (rank {RANK[src]}) imports {mod} "
                           f"({dst}, rank {RANK[dst]}): " + ("siblings are independent" if RANK[dst] == RANK[src]
                                                             else "arrows point down only"))
    return bad


def deepspeed_violations(pkg: pathlib.Path = PKG) -> tuple[list[str], set]:
    """(``file:line: imports X`` outside the allowed places, the exceptions of DEEPSPEED_EXCEPTIONS in use)."""
    bad, used = [], set()
    for path in _sources(pkg):
        rel, unit = str(path.relative_to(pkg.parent)), _unit(path, pkg)
        for line, mod, func in _imports(path, pkg):
            if not (mod == "deepspeed" or mod.startswith("deepspeed.")) or unit in DEEPSPEED_PACKAGES:
                continue
            public = mod in PUBLIC_DEEPSPEED
            if public and rel == "aidaptiv_ds/cli/doctor.py" and func in DOCTOR_FUNCTIONS:
                continue
            if public and (unit in APPLICATION_PACKAGES or rel in APPLICATION_FILES):
                continue
            if (rel, mod) in DEEPSPEED_EXCEPTIONS:
                used.add((rel, mod))
                continue
            bad.append(f"{rel}:{line}: imports {mod}" + (f" (in {func})" if func else ""))
    return bad, used


def test_imports_point_down_only():
    assert len(_sources()) > 60  # the walk itself works
    bad = layer_violations()
    assert not bad, "layering broken (see docs/design.md):\n" + "\n".join(bad)


def test_deepspeed_internals_are_imported_only_by_the_adapter():
    bad, used = deepspeed_violations()
    assert not bad, ("DeepSpeed imported outside integration/, or a DeepSpeed module other than its public API "
                     "imported by an application (move the code into integration/):\n" + "\n".join(bad))
    stale = set(DEEPSPEED_EXCEPTIONS) - used
    assert not stale, f"exceptions no longer needed; delete them: {sorted(stale)}"


def test_the_checks_see_each_kind_of_violation(tmp_path):
    """The scanner on a planted package: io importing store lazily, store importing tiers, tiers
    importing integration, a DeepSpeed import in io/ and in the doctor outside its version report, a
    benchmark importing DeepSpeed's op builder (its public ``deepspeed`` is fine), two independent
    siblings importing each other, a package without a rank."""
    pkg = tmp_path / "aidaptiv_ds"
    files = {
        "io/engine.py": "def f():\n    from ..store import layout\n    import deepspeed.runtime.engine\n",
        "store/store.py": "from ..tiers.host_tier import HostTier\n",
        "tiers/host_tier.py": "import aidaptiv_ds.integration.hooks\n",
        "planner/plan.py": "from ..checkpoint import format\n",
        "cli/doctor.py": "def check_versions():\n    import deepspeed\n\ndef other():\n    import deepspeed\n",
        "integration/hooks.py": "import deepspeed.runtime.zero.stage3\nfrom ..io import engine\n",
        "bench/aio.py": "import deepspeed\n\ndef f():\n    from deepspeed.ops.op_builder.builder import OpBuilder\n",
        "newpkg/x.py": "",
    }
    for rel, text in files.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    bad = "\n".join(layer_violations(pkg))
    for expected in ("io/engine.py:2: io (rank 2) imports aidaptiv_ds.store",
                     "store/store.py:1: store (rank 3) imports aidaptiv_ds.tiers.host_tier",
                     "tiers/host_tier.py:1: tiers (rank 4) imports aidaptiv_ds.integration.hooks",
                     "planner/plan.py:1: planner (rank 6) imports aidaptiv_ds.checkpoint (checkpoint, rank 6): "
                     "siblings are independent",
                     "newpkg/x.py: newpkg has no rank"):
        assert expected in bad, bad
    assert "integration/hooks.py" not in bad
    ds, _ = deepspeed_violations(pkg)
    assert ds == ["aidaptiv_ds/bench/aio.py:4: imports deepspeed.ops.op_builder.builder (in f)",
                  "aidaptiv_ds/cli/doctor.py:5: imports deepspeed (in other)",
                  "aidaptiv_ds/io/engine.py:3: imports deepspeed.runtime.engine (in f)"], ds


#: fields of ``tiers.host_tier.TieredUnit`` that only ``HostTier`` changes, under its lock (issue 39)
SLICE_FIELDS = {"refs", "dirty", "prefetched", "writing", "ready", "on_drop", "writeback", "members", "nbytes", "buf",
                "last_use"}
#: (file, attribute) assignments outside tiers/ that are not a TieredUnit's: other records with a field of that name
NOT_SLICE = {("aidaptiv_ds/inference/block_store.py", "last_use")}


#: a :class:`TieredUnit`'s transitions whose names no other record's method has ([Note: a unit's transitions])
UNIT_TRANSITIONS = {"pin", "unpin", "enter", "leave", "written", "writing_from", "touch"}


def _outside_tiers():
    """``(rel, node)`` for every AST node of the package's modules outside ``tiers/``."""
    for path in _sources():
        rel = path.relative_to(REPO).as_posix()
        if not rel.startswith("aidaptiv_ds/tiers/"):
            for node in ast.walk(ast.parse(path.read_text(), rel)):
                yield rel, node


def test_only_the_tier_runs_a_units_transitions():
    """A unit's transitions change the fields its state follows from; :class:`HostTier` runs them under its lock.
    An owner calling one directly (``unit.pin()``) would race the budget check, so outside ``tiers/`` no call of a
    transition method is allowed (owners call the tier: ``tier.acquire(unit)``)."""
    bad = [f"{rel}:{node.lineno}: {ast.unparse(node.func)}(...)" for rel, node in _outside_tiers()
           if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
           and node.func.attr in UNIT_TRANSITIONS]
    assert not bad, "\n".join(bad)


def test_only_the_tier_writes_a_slices_fields():
    """A slice's flags decide eviction and write-back; an owner that flips one without the tier's lock races the
    budget check (issue 39). Owners ask the tier instead (``mark_dirty``, ``mark_used``, ``set_members``,
    ``drop``); assignments to those field names on anything but ``self`` outside ``tiers/`` are refused."""
    bad = []
    for rel, node in _outside_tiers():
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for t in targets:
            if (isinstance(t, ast.Attribute) and t.attr in SLICE_FIELDS
                    and not (isinstance(t.value, ast.Name) and t.value.id == "self")
                    and (rel, t.attr) not in NOT_SLICE):
                bad.append(f"{rel}:{node.lineno}: {ast.unparse(t)} = ...")
    assert not bad, "\n".join(bad)
