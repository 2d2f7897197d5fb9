"""The architecture, read from the source: layers import only downward, no import cycle (between packages or
between modules), imports at module top except heavy optional packages, no package file over 450 lines,
``rollout/`` free of Lightning, and lazy package exports that ``dir()`` and type checkers see."""

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

import lightning_codraft

ROOT = Path(lightning_codraft.__file__).parent
#: what each layer (a package, or a top-level module) may import from the project; see docs/design/interfaces.md
ALLOWED = {
    "_lazy": set(),
    "config": {"config_sections", "task_config"},
    # the recipe's sections derive from training/config.py's loss sections; draft.warm_start is distill/settings.py's
    "config_sections": {"training", "distill"},
    "task_config": set(),
    "run_config": {"config"},  # a run directory's settings across its segments
    "attention": set(),
    "batch": {"attention"},
    "models": {"attention"},
    "parallel": {"attention", "batch", "models"},
    "training": {"attention", "batch", "models", "parallel"},
    "rollout": {"attention", "models"},
    "distill": {"attention", "batch", "models", "training", "rollout"},
    "drafters": {"models", "rollout"},  # the drafter protocol's table: each type's model, engine and formats
    "fabric": {"batch", "parallel", "training", "rollout"},
    "pytorch": {"batch", "parallel", "training", "rollout"},
    "plan": {"config", "config_sections", "models", "parallel"},
    "rl": {"config", "config_sections", "task_config", "run_config", "attention", "batch", "models", "parallel", "training", "rollout", "fabric",
           "distill", "drafters"},
    "cli": {"config", "config_sections", "models", "rl", "rollout", "plan"},
    "__init__": set(),
}
#: imported inside functions on purpose: optional or heavy, and only on the paths that need them
LAZY_OK = ("vllm", "flash_attn", "transformers", "tokenizers", "datasets", "matplotlib", "math_verify")


def _modules() -> dict[str, Path]:
    return {".".join(p.relative_to(ROOT.parent).with_suffix("").parts): p for p in ROOT.rglob("*.py")}


def _imports(path: Path, module: str) -> list[tuple[str, bool]]:
    """(absolute imported module, at module top?) of every import of ``path`` (TYPE_CHECKING blocks skipped)."""
    tree = ast.parse(path.read_text())
    nested = {id(inner) for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
              for inner in ast.walk(node)}
    checking = {id(inner) for node in ast.walk(tree) if isinstance(node, ast.If)
                and getattr(node.test, "id", None) == "TYPE_CHECKING" for inner in ast.walk(node)}
    known = _modules()
    out = []
    for node in ast.walk(tree):
        if id(node) in checking:
            continue
        if isinstance(node, ast.Import):
            out += [(alias.name, id(node) not in nested) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(module.split(".")[:-node.level] + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.append((sub if sub in known else base, id(node) not in nested))
    return out


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_cycle_finder_bites():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_layers_import_only_downward_and_modules_without_cycles():
    modules = _modules()
    module_graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        layer = _layer(name)
        assert layer in ALLOWED, f"{name}: layer {layer!r} is not in the architecture table of this test"
        deps = {m for m, _ in _imports(path, name) if m.startswith("lightning_codraft")}
        module_graph[name] = {d for d in deps if d in modules and not d.endswith("__init__")}
        if name.endswith("__init__"):
            continue  # package __init__s only re-export their own package (lazily)
        for dep in deps:
            target = _layer(dep)
            assert target == layer or target in ALLOWED[layer] or dep == "lightning_codraft", (  # root: __version__
                f"{name} imports {dep}: layer {layer} may import only {sorted(ALLOWED[layer])}")
    assert _cycle(module_graph) is None, f"import cycle: {' -> '.join(_cycle(module_graph))}"
    layers = {layer: {d for d in deps if d != layer} for layer, deps in ALLOWED.items()}
    assert _cycle(layers) is None


def test_imports_at_module_top_except_heavy_optional_packages():
    for name, path in _modules().items():
        for module, at_top in _imports(path, name):
            if name == "lightning_codraft.cli" and module.startswith("lightning_codraft."):
                continue  # the CLI imports its commands' modules when a command runs: --version, a config error
            if not at_top:
                assert module.split(".")[0] in LAZY_OK, (
                    f"{name} imports {module} inside a function; move it to the module top (only {LAZY_OK} are "
                    f"imported lazily)")


def test_no_package_file_over_450_lines():
    long = {str(p.relative_to(ROOT)): n for p in ROOT.rglob("*.py") if (n := len(p.read_text().splitlines())) > 450}
    assert not long, f"files over 450 lines: {long}"


def test_no_function_over_80_lines():
    """Docstring and signature included: a function a reader takes in at once (docs/design/architecture.md)."""
    long = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80:
                long.append(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not long, long


def test_the_package_is_linted_and_formatted_by_its_ruff_toml():
    """`ruff check` and `ruff format --check` pass on the package (.ci/run runs both; ruff is in the test extra)."""
    ruff = [sys.executable, "-m", "ruff"]
    if subprocess.run([*ruff, "--version"], capture_output=True).returncode:
        pytest.skip("ruff is not installed (pip install -e '.[test]')")
    for args in (["check", "lightning_codraft"], ["format", "--check", "lightning_codraft"]):
        out = subprocess.run([*ruff, *args], capture_output=True, text=True, cwd=ROOT.parent)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]


def test_rollout_and_models_do_not_pull_in_lightning():
    code = ("import sys, lightning_codraft.rollout.embedded.speculative, lightning_codraft.rollout.refit.sync, "
            "lightning_codraft.rollout.vllm.engine, lightning_codraft.models.decode, lightning_codraft.batch; "
            "print(sorted(m for m in sys.modules if m == 'lightning' or m.startswith(('lightning.', 'vllm'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("package", ["lightning_codraft", "lightning_codraft.models", "lightning_codraft.parallel",
                                     "lightning_codraft.training", "lightning_codraft.rollout", "lightning_codraft.rl",
                                     "lightning_codraft.attention", "lightning_codraft.distill"])
def test_dir_lists_the_exports_and_type_checkers_see_them(package):
    pkg = importlib.import_module(package)
    names = set(pkg.__all__)
    assert names <= set(dir(pkg)), sorted(names - set(dir(pkg)))
    lazy = getattr(pkg, "_LAZY", None)
    if lazy is None:
        return  # attention/ imports its exports eagerly
    tree = ast.parse(Path(pkg.__file__).read_text())
    checked = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.If)
               and getattr(node.test, "id", None) == "TYPE_CHECKING" for inner in ast.walk(node)
               if isinstance(inner, ast.ImportFrom) for alias in inner.names}
    assert checked == set(lazy), f"TYPE_CHECKING imports differ from the lazy exports: {sorted(checked ^ set(lazy))}"
    for name in lazy:
        assert getattr(pkg, name) is not None


def test_the_benchmark_index_names_every_page():
    """docs/benchmarks/README.md links every markdown page of the folder, and every page it links exists."""
    folder = ROOT.parent / "docs" / "benchmarks"
    index = (folder / "README.md").read_text()
    linked = set(re.findall(r"\]\(([^)]+\.md)\)", index))
    pages = {p.name for p in folder.glob("*.md")} - {"README.md"}
    assert pages - linked == set(), f"pages the index does not name: {sorted(pages - linked)}"
    assert linked - pages == set(), f"the index links pages that do not exist: {sorted(linked - pages)}"


def test_every_file_of_the_benchmark_folder_belongs_to_a_page_and_carries_no_date():
    """docs/benchmarks/README.md's naming rule: each file or folder is ``<page>.<ext>`` / ``<page>_<what>...`` of a
    page of the folder, or a page names it; no name carries a date (a rerun replaces its page)."""
    folder = ROOT.parent / "docs" / "benchmarks"
    pages = {p.stem for p in folder.glob("*.md")} - {"README"}
    text = "\n".join(p.read_text() for p in folder.glob("*.md"))
    for entry in folder.iterdir():
        name = entry.name
        assert not re.search(r"\d{4}-\d{2}-\d{2}", name), f"{name}: a dated name (the naming rule: no dates)"
        if entry.suffix == ".md":
            continue
        stem = name.split(".")[0]
        owned = any(stem == p or stem.startswith(p + "_") for p in pages)
        assert owned or name in text, f"{name} belongs to no page of docs/benchmarks and no page names it"

