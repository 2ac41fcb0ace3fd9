"""The package layering, read from the source: no import cycle anywhere in src/ (imports inside
functions and under TYPE_CHECKING count), and each layer imports only what docs/interfaces.md
allows it."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).parents[1] / "src"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def resolve(name: str, modules: set[str]) -> str | None:
    """`scaletui.tui.views` -> itself; `scaletui.records.Record` -> `scaletui.records`."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in SRC.rglob("*.py")}
    modules = set(files)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                # `from scaletui import specs` imports the module scaletui.specs
                targets = [f"{base}.{a.name}" for a in node.names]
            for target in targets:
                got = resolve(target, modules) if target.startswith("scaletui") else None
                if got and got != mod:
                    graph[mod].add(got)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_walker_sees_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_in_src():
    graph = import_graph()
    assert "scaletui.tui.views" in graph and graph["scaletui.tui.views"]
    assert cycles(graph) == []


def test_layers_import_only_what_they_may():
    """specs, placement and the shared records/procs/latency/xla_env modules import nothing of
    ours; policy nothing, pages only policy, shape only specs, dtypes and policy; roofline only
    specs, placement, latency, shape, policy and pages; loadgen only itself and the shared
    modules; tui never serve (HTTP only); serve's layers one way, http -> scheduling -> engine
    -> weights (scheduling sees the engine only through its protocol, engine_api); calibrate
    only the kernels' build and roofline's spread record; and only the `scaletui` dispatcher
    imports the commands layer (no library imports a verb)."""
    shared = {"scaletui.records", "scaletui.procs", "scaletui.latency", "scaletui.xla_env"}
    serve_base = {"scaletui.specs", "scaletui.dtypes", "scaletui.shape", "scaletui.placement"}
    allowed = {
        "scaletui.specs": set(),
        "scaletui.records": set(),
        "scaletui.procs": set(),
        "scaletui.latency": set(),
        "scaletui.xla_env": set(),
        "scaletui.policy": set(),
        "scaletui.pages": {"scaletui.policy"},
        "scaletui.dtypes": set(),
        "scaletui.placement": set(),
        "scaletui.shape": {"scaletui.specs", "scaletui.dtypes", "scaletui.policy"},
        "scaletui.shape_flags": {"scaletui.shape", "scaletui.dtypes"},
        "scaletui.roofline": {
            "scaletui.specs",
            "scaletui.placement",
            "scaletui.latency",
            "scaletui.dtypes",
            "scaletui.shape",
            "scaletui.policy",
            "scaletui.pages",
        },
        "scaletui.loadgen": shared,
        "scaletui.tui": {
            "scaletui.specs",
            "scaletui.placement",
            "scaletui.dtypes",
            "scaletui.shape",
            "scaletui.roofline",
            "scaletui.loadgen",
            *shared,
        },
        "scaletui.serve.weights": serve_base,
        # and the policy's packing of a mixed call's pieces (`riders`, MIX_PIECES): pure
        "scaletui.serve.engine": {
            *serve_base,
            "scaletui.serve.weights",
            "scaletui.roofline",
            "scaletui.policy",
        },
        "scaletui.serve.scheduling": {
            *serve_base,
            "scaletui.serve.engine.engine_api",
            "scaletui.policy",
            "scaletui.pages",
            # the engine fit that prices each call (the speed factor): pure, no JAX
            "scaletui.roofline.callcost",
            "scaletui.roofline.costmodel",
            "scaletui.roofline.fitstore",
            # and the speed log its blocks go to (the band's horizon): pure, no JAX
            "scaletui.roofline.speedlog",
        },
        "scaletui.serve.http": {
            *serve_base,
            "scaletui.serve.scheduling",
            "scaletui.serve.engine",
            "scaletui.procs",
        },
        # the kernels' build, and the one spelling of a p10/p50/p90 spread (pure, no JAX)
        "scaletui.calibrate": {
            *serve_base,
            "scaletui.serve.engine.native",
            "scaletui.roofline.band",
        },
    }
    verbs = {"scaletui.cli", "scaletui.__main__"}
    wrong = []
    for mod, deps in import_graph().items():
        if mod not in verbs and not mod.startswith("scaletui.commands"):
            wrong += [f"{mod} -> {d}" for d in deps if d.startswith("scaletui.commands")]
        layer = next((k for k in allowed if mod == k or mod.startswith(k + ".")), None)
        if layer is None:
            continue
        for dep in deps:
            if dep == layer or dep.startswith(layer + "."):
                continue
            if not any(dep == a or dep.startswith(a + ".") for a in allowed[layer]):
                wrong.append(f"{mod} -> {dep}")
    assert wrong == []


def test_simulate_and_roofline_import_no_jax():
    """`scaletui simulate` and `scaletui roofline` (their modules, the shape, and --help) run
    in a fresh interpreter without JAX ever being imported."""
    import subprocess
    import sys

    code = (
        "import contextlib, sys\n"
        "from scaletui import shape\n"
        "from scaletui.commands import simulate as simulate_cli\n"
        "from scaletui.commands import roofline as roofline_cli\n"
        "for main in (simulate_cli.main, roofline_cli.main):\n"
        "    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(None):\n"
        "        main(['--help'])\n"
        "shape.ServerShape.from_json({'model': 'tiny', 'max_seq_len': 64})\n"
        "print(sorted(m for m in sys.modules if m == 'jax' or m.startswith(('jax.', 'jaxlib'))))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
