"""The package's layers: each module imports only modules of its own layer or the layers below, and no
two modules import each other, directly or around a cycle. Imports inside functions count too.

The order, lowest first (docs/design.md explains it):
"""

import ast
import pathlib

import pytest

import ckptshard

LAYERS = [
    ("errors", "version"),  # what every layer raises and reports
    ("dtypes", "tree"),  # dtypes without torch; nested dict/list helpers
    ("tensors",),  # TensorRef, Source, Fill: the data every layer passes around
    ("layout",),  # FSDP instances, chunk and box arithmetic
    ("formats",),  # bytes <-> objects: zip records, torch pickles, safetensors header, DCP metadata
    ("osio",),  # file descriptors and the OS: atomic outputs, input watching, hashing, CRCs, manifests
    ("read",),  # discover, open and check checkpoints
    ("plan",),  # copy plans between layouts
    ("write",),  # copier and output writers
    ("sources",),  # what a checkpoint is: every family probed in one place, opened into a Source
    ("execute",),  # the commands: validate, plan, write, with progress
    ("fsdp",),  # live FSDP models: loading, wrapping, CPU compatibility
    ("testing",),  # real-FSDP fixtures and oracles
    ("recipes",),  # models, wrappings and data that verify-resume runs (examples and built-ins)
    ("harness",),  # verify-resume
    ("cli", "__init__"),  # the command line and the declared library API
]
RANK = {name: i for i, names in enumerate(LAYERS) for name in names}
PACKAGE = pathlib.Path(ckptshard.__file__).parent


def module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def layer(module: str) -> str:
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def imports_of(path: pathlib.Path):
    """(line, imported ckptshard module) for every import in the file, at any depth."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("ckptshard"):
                continue
            for alias in node.names:  # "from . import x" and "from .pkg import module" name modules
                sub = f"{target}.{alias.name}"
                yield node.lineno, sub if (PACKAGE.parent / (sub.replace(".", "/") + ".py")).exists() else target
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("ckptshard"):
                    yield node.lineno, alias.name


def graph(root: pathlib.Path = PACKAGE):
    files = sorted(root.rglob("*.py"))
    return {module_name(f): (f, sorted(set(imports_of(f)))) for f in files}


def violations(modules):
    out = []
    for name, (path, imports) in modules.items():
        for line, target in imports:
            if layer(target) not in RANK:
                out.append(f"{path.name}:{line}: {target} is in no layer")
            elif RANK[layer(target)] > RANK[layer(name)]:
                out.append(f"{name}:{line} imports {target}, a layer above it")
    return out


def cycles(modules):
    edges = {name: {t for _, t in imports if t in modules and t != name} for name, (_, imports) in modules.items()}
    found, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(edges[node]):
            if state.get(nxt) == "open":
                found.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    return found


def test_every_module_is_in_a_layer_and_imports_only_downwards():
    modules = graph()
    assert {layer(m) for m in modules} <= set(RANK), {layer(m) for m in modules} - set(RANK)
    assert violations(modules) == []


def test_no_import_cycles():
    assert cycles(graph()) == []


def test_the_checks_catch_an_upward_import_and_a_cycle(tmp_path):
    """The test above fails on an import against the order (a reader importing a writer) and on a cycle."""
    pkg = tmp_path / "ckptshard"
    for rel in ("__init__.py", "read/__init__.py", "read/a.py", "read/b.py", "write/__init__.py", "write/w.py"):
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text("")
    (pkg / "read/a.py").write_text("from . import b\n\n\ndef f():\n    from ..write import w\n")
    (pkg / "read/b.py").write_text("from .a import f\n")
    global PACKAGE
    saved, PACKAGE = PACKAGE, pkg
    try:
        modules = graph(pkg)
        assert violations(modules) == ["ckptshard.read.a:5 imports ckptshard.write.w, a layer above it"]
        assert cycles(modules) == [["ckptshard.read.a", "ckptshard.read.b", "ckptshard.read.a"]]
    finally:
        PACKAGE = saved


FUNCTIONS = {n for n in ckptshard.__all__ if n[0].islower() and n != "__version__"}


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_the_declared_api_is_importable_and_each_function_states_its_contract(name):
    doc = getattr(ckptshard, name).__doc__ or ""
    for section in ("Args:", "Returns:", "Raises:"):
        assert section in doc, f"{name}: no {section}"


def test_internal_modules_say_so():
    """Every subpackage's docstring marks it internal: the API is what ckptshard/__init__.py declares."""
    for init in sorted(PACKAGE.glob("*/__init__.py")):
        assert "Internal" in (ast.get_docstring(ast.parse(init.read_text())) or ""), init.parent.name


LEAN_RUN = """
import sys
from ckptshard.cli import main
try:
    main(["reshard", sys.argv[1], "-n", "3", "-o", sys.argv[2], "-q", "--no-fsync"])
except SystemExit as e:
    assert e.code == 0, e.code
print(" ".join(sorted(sys.modules)))
"""


def test_a_fairscale_reshard_imports_no_other_familys_modules(tmp_path):
    """Modules for DCP folders and torch FSDP's DTensors are imported where a checkpoint needs them, not on
    every run: their import is a fixed cost of every command (docs/performance.md)."""
    import subprocess
    import sys

    made = (
        f"from ckptshard.testing.synthetic import write_synthetic; write_synthetic({str(tmp_path / 'src')!r}, 2, 2, 16)"
    )
    subprocess.run([sys.executable, "-c", made], check=True)
    done = subprocess.run(
        [sys.executable, "-c", LEAN_RUN, str(tmp_path / "src"), str(tmp_path / "out")], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    loaded = set(done.stdout.split())
    assert (tmp_path / "out").is_dir() and "ckptshard.execute.reshard" in loaded
    unneeded = {"torch", "ckptshard.sources.dcp", "ckptshard.formats.dtensor_pickle", "ckptshard.write.dtensor_mesh"}
    assert not loaded & unneeded
