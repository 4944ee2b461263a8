"""No import cycles between atom_kv's modules (``TYPE_CHECKING`` imports count: a cycle hidden behind one
still ties two modules that should each have one job)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "atom_kv"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The atom_kv modules ``path`` imports (``from pkg import name`` counts ``pkg.name`` when that is a module)."""
    found = set()
    here = _module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        found.update(n for n in names if n in modules and n != here)
    return found


def _graph() -> dict[str, set[str]]:
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(paths)
    return {name: _imports(path, modules) for name, path in paths.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_module_imports_itself_through_others():
    graph = _graph()
    assert "atom_kv.proxy.routing.pick" in graph["atom_kv.proxy.relay.stream"]  # the graph sees what a module imports
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles(graph) == []


# The proxy's rooms: each sub-package of atom_kv.proxy is one concern. The HTTP layer knows nothing
# of P/D; between the rooms (and the top-level modules: app, settings, server, __main__) no circle.
PROXY = "atom_kv.proxy"
PROXY_ROOMS = ("http", "fleet", "routing", "relay", "observability", "admission", "kv_events")


def _proxy_node(module: str) -> str | None:
    """The room a proxy module lives in (``atom_kv.proxy.relay``), or the module itself at the top; None outside."""
    if not module.startswith(PROXY + "."):
        return None
    first = module[len(PROXY) + 1:].split(".")[0]
    return f"{PROXY}.{first}" if first in PROXY_ROOMS else module


def _room_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph collapsed onto the proxy's rooms (imports inside one room drop out)."""
    rooms: dict[str, set[str]] = {}
    for module, deps in graph.items():
        node = _proxy_node(module)
        if node is None:
            continue
        targets = rooms.setdefault(node, set())
        for dep in deps:
            other = _proxy_node(dep)
            if other is not None and other != node:
                targets.add(other)
                rooms.setdefault(other, set())
    return rooms


def _http_imports_beyond_http(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Every (module, import) where a module of ``proxy/http/`` imports a proxy module outside it."""
    http = f"{PROXY}.http"
    return sorted((module, dep) for module, deps in graph.items() if _proxy_node(module) == http
                  for dep in deps if _proxy_node(dep) not in (None, http))


def test_proxy_http_layer_imports_nothing_of_the_relay_routing_or_fleet():
    graph = _graph()
    assert {f"{PROXY}.http.{m}" for m in ("httpserver", "upstream", "sse", "asgi_bridge")} <= set(graph)
    bad = {f"{PROXY}.http.sse": {f"{PROXY}.relay.legs", f"{PROXY}.http.upstream", "atom_kv.wire"}}
    assert _http_imports_beyond_http(bad) == [(f"{PROXY}.http.sse", f"{PROXY}.relay.legs")]
    assert _http_imports_beyond_http(graph) == []


def test_no_circle_among_the_proxy_rooms():
    graph = _graph()
    rooms = _room_graph(graph)
    assert f"{PROXY}.fleet" in rooms[f"{PROXY}.relay"]  # the collapsed graph sees the rooms' imports
    assert set(rooms) >= {f"{PROXY}.{r}" for r in PROXY_ROOMS}
    loop = {f"{PROXY}.fleet.health": {f"{PROXY}.routing.pick"}, f"{PROXY}.routing.pick": {f"{PROXY}.fleet.registry"}}
    assert _cycles(_room_graph(loop)) == [[f"{PROXY}.fleet", f"{PROXY}.routing"]]
    assert _cycles(rooms) == []


TRANSFER = "atom_kv.transfer"
#: top-level transfer modules that may know the backends: auto routes over them, the old probe paths name theirs
KNOWS_BACKENDS = {f"{TRANSFER}.auto", f"{TRANSFER}.nixl_probe", f"{TRANSFER}.moriio_probe"}


def _backend_of(module: str, backends: set[str]) -> str | None:
    """The backend sub-package ``module`` belongs to (``atom_kv.transfer.tcp``), or None."""
    parts = module.split(".")
    if len(parts) >= 3 and ".".join(parts[:3]) in backends:
        return ".".join(parts[:3])
    return None


def _transfer_layering(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) pairs that break the transfer layering: a backend
    sub-package imports only the shared top level and its own modules, never
    another backend; the shared top level imports no backend (but auto)."""
    backends = {m for m in graph if m.count(".") == 2 and m.startswith(f"{TRANSFER}.")
                and any(o.startswith(f"{m}.") for o in graph)}
    bad = []
    for importer, imported in sorted((a, b) for a, deps in graph.items() for b in deps):
        if not (importer.startswith(f"{TRANSFER}.") and imported.startswith(f"{TRANSFER}.")):
            continue
        theirs = _backend_of(imported, backends)
        if theirs is None:
            continue  # the shared top level: anyone in transfer may use it
        mine = _backend_of(importer, backends)
        if mine != theirs and importer not in KNOWS_BACKENDS:
            bad.append((importer, imported))
    return bad


def test_transfer_backends_import_only_the_shared_top_level_and_themselves():
    graph = _graph()
    assert {"atom_kv.transfer.tcp.server", "atom_kv.transfer._served"} <= graph["atom_kv.transfer.tcp.backend"]
    fake = {
        "atom_kv.transfer._regions": set(), "atom_kv.transfer.auto": {"atom_kv.transfer.tcp"},
        "atom_kv.transfer.tcp": {"atom_kv.transfer.tcp.backend"},
        "atom_kv.transfer.tcp.backend": {"atom_kv.transfer.nixl.plan", "atom_kv.transfer._regions"},
        "atom_kv.transfer.nixl": set(), "atom_kv.transfer.nixl.plan": {"atom_kv.transfer.tcp"},
        "atom_kv.transfer._jobs": {"atom_kv.transfer.nixl.plan"},
    }
    assert _transfer_layering(fake) == [("atom_kv.transfer._jobs", "atom_kv.transfer.nixl.plan"),
                                        ("atom_kv.transfer.nixl.plan", "atom_kv.transfer.tcp"),
                                        ("atom_kv.transfer.tcp.backend", "atom_kv.transfer.nixl.plan")]
    assert _transfer_layering(graph) == []
