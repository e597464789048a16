"""The package's layout: `aggdec/` imports no Ray and its modules import one another without circles
(module-level, function-level and type-checking imports alike), so that each module reads on its own."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _imports() -> dict[str, set[str]]:
    """Each module of aggdec (dotted name) -> every aggdec module and every top-level package it imports."""
    modules = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
               for p in (ROOT / "aggdec").rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
        graph[name] = {m for m in found if m in modules and m != name} | {m.split(".")[0] for m in found}
    return graph


def test_aggdec_imports_no_ray_and_has_no_import_circles():
    graph = _imports()
    assert not [m for m, deps in graph.items() if "ray" in deps]
    inner = {m: {d for d in deps if d in graph} for m, deps in graph.items()}
    circles = []
    for start in inner:  # a module that reaches itself
        seen, todo = set(), list(inner[start])
        while todo:
            m = todo.pop()
            if m == start:
                circles.append(start)
                break
            if m not in seen:
                seen.add(m)
                todo.extend(inner[m])
    assert not circles, circles
