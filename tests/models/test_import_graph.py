"""The models layer's import graph, read from the source: no cycle between its modules (e.g. policy <-> hf_io),
nothing from the layers above it, and imports at module top except the heavy optional ``transformers``."""

import ast
from pathlib import Path

import lightning_codraft.models as models_pkg

MODELS = Path(models_pkg.__file__).parent
ABOVE = ("lightning_codraft.parallel", "lightning_codraft.training", "lightning_codraft.rollout",
         "lightning_codraft.rl", "lightning_codraft.fabric", "lightning_codraft.pytorch", "lightning.", "vllm")
HEAVY_OPTIONAL = ("transformers",)


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(imported module, at module top?) for every import statement of ``path``; ``from pkg import mod`` names
    the submodule when ``mod`` is a file of the package."""
    tree = ast.parse(path.read_text())
    nested = {id(inner) for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
              for inner in ast.walk(node)}
    top = {id(node) for node in ast.walk(tree)} - nested     # module level, `if TYPE_CHECKING:` included
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, id(node) in top) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                is_module = node.module == "lightning_codraft.models" and (MODELS / f"{alias.name}.py").is_file()
                out.append((sub if is_module else node.module, id(node) in top))
    return out


def _graph() -> dict[str, set[str]]:
    names = {f"lightning_codraft.models.{p.stem}" for p in MODELS.glob("*.py") if p.stem != "__init__"}
    return {f"lightning_codraft.models.{p.stem}": {m for m, _ in _imports(p) if m in names}
            for p in MODELS.glob("*.py") if p.stem != "__init__"}


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


def test_models_modules_import_each_other_without_a_cycle():
    graph = _graph()
    assert "lightning_codraft.models.hf_io" in graph["lightning_codraft.models.policy"]
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph))}"


def test_models_imports_only_downward_and_at_module_top():
    for path in sorted(MODELS.glob("*.py")):
        for module, at_top in _imports(path):
            above = module == "lightning" or module.startswith(ABOVE)
            assert not above, f"models/{path.name} imports {module} from a layer above models/"
            if not at_top:
                assert module.startswith(HEAVY_OPTIONAL), (
                    f"models/{path.name} imports {module} inside a function; move it to the module top (only "
                    f"heavy optional packages {HEAVY_OPTIONAL} are imported lazily)")
