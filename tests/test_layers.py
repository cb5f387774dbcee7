"""The package's imports run one way, in the layer order docs/layout.md declares, and no two
modules import each other (directly or round a longer circle), counting imports inside functions:
those break a circle at run time only, and the next person to move one finds it."""
import ast
from pathlib import Path

from conftest import REPO

# lowest first; a module may import its own package and the packages of lower layers only
LAYERS = (
    # read by every layer
    ("commodity_bert.run_config", "commodity_bert.run_dir", "commodity_bert.cli_help", "commodity_bert.host",
     "commodity_bert.launcher_env"),
    ("commodity_bert.data", "commodity_bert.model", "commodity_bert.collectives"),
    ("commodity_bert.optim",),
    ("commodity_bert.comm",),
    ("commodity_bert.train", "train"),  # train.py is the trainer's entry point
    ("commodity_bert.finetune", "commodity_bert.plan", "data_prep"),
    ("commodity_bert.ablate", "commodity_bert.launch", "commodity_bert.domain"),
)
OURS = ("commodity_bert", "data_prep", "train")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_of(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "commodity_bert" and len(parts) > 1 else parts[0]


def project_imports() -> dict[str, set[str]]:
    """module → the project's modules it imports, at the top or inside a function."""
    files = [*REPO.glob("commodity_bert/**/*.py"), *REPO.glob("data_prep/**/*.py"), REPO / "train.py"]
    modules = {module_name(f): f for f in files}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names if a.name.split(".")[0] in OURS}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                    and node.module.split(".")[0] in OURS:
                for alias in node.names:  # `from pkg import module` names the module
                    sub = f"{node.module}.{alias.name}"
                    targets.add(sub if sub in modules else node.module)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def layer_of(module: str) -> int:
    for level, packages in enumerate(LAYERS):
        if package_of(module) in packages or module in packages:
            return level
    raise AssertionError(f"{module} is in no layer: add its package to LAYERS and docs/layout.md")


def test_imports_follow_the_declared_layer_order():
    against = []
    for module, targets in project_imports().items():
        for target in targets:
            if package_of(target) != package_of(module) and layer_of(target) >= layer_of(module) \
                    and not (layer_of(target) == layer_of(module) == 4):  # train.py and its package
                against.append(f"{module} imports {target}")
    assert not against, "imports against the layer order (docs/layout.md):\n" + "\n".join(sorted(against))


def test_no_two_modules_import_each_other():
    graph = project_imports()
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(node):  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    assert not circles, f"import circles: {circles}"


def test_the_checks_see_a_circle_and_an_upward_import(tmp_path, monkeypatch):
    """The two checks above would fail on the shapes they look for."""
    graph = {"commodity_bert.optim.a": {"commodity_bert.comm.b"}, "commodity_bert.comm.b": {"commodity_bert.optim.a"}}
    monkeypatch.setattr(__import__(__name__), "project_imports", lambda: graph)
    try:
        test_imports_follow_the_declared_layer_order()
    except AssertionError as exc:
        assert "commodity_bert.optim.a imports commodity_bert.comm.b" in str(exc)
    else:
        raise AssertionError("an upward import passed")
    try:
        test_no_two_modules_import_each_other()
    except AssertionError as exc:
        assert "commodity_bert.comm.b" in str(exc)
    else:
        raise AssertionError("a circle passed")
