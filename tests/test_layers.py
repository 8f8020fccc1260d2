"""The package's layers, read from the code's own imports (every import, function-local ones
too): no import cycle, each layer imports only the layers below it, and a function-local import
is there only to keep a slow library off the path of commands that do not need it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "installer"

# layer -> the layers it may import (itself included); docs/architecture.md "Module map"
ALLOWED = {
    "core": {"core"},
    "host": {"core", "host"},
    "engine": {"core", "host", "engine"},
    "actions": {"core", "host", "engine", "actions"},
    "api": {"core", "host", "engine", "actions", "api"},
    "lab": {"core", "lab"},
    "cli": {"api", "lab", "cli", "installer"},      # the lab commands drive installer.lab
}
# imported inside a function on purpose: each costs seconds, and most commands never need it
# (node_api is the API client's node side: importing it loads urllib3 through host.kube; apireach
# loads paramiko and fabric through host.ssh; hosting, a hosted tenant's hosting cluster, urllib3;
# the hosted plane, all of those for a tenant's command)
LAZY_OK = ("installer.host.kube", "installer.host.kube_objects", "installer.host.node_api", "urllib3", "testinfra",
           "yaml.", "installer.host.apireach", "installer.host.hosting", "websocket",
           "installer.host.tenant_etcd", "installer.host.tenant_members", "installer.host.tenant_guards",
           "installer.engine.planes.hosted")


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module(p): p for p in PACKAGE.rglob("*.py")}


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(module imported, whether inside a function) for every import of ``path``."""
    tree = ast.parse(path.read_text())
    local: set[int] = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            local.update(id(n) for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom)))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import (the layers use absolute ones)"
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.append((sub if sub in MODULES else node.module, id(node) in local))
        elif isinstance(node, ast.Import):
            found += [(alias.name, id(node) in local) for alias in node.names]
    return found


GRAPH = {m: {i for i, _ in _imports(p) if i in MODULES and i != m} for m, p in MODULES.items()}


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "installer"


def test_the_package_has_its_layers():
    layers = {_layer(m) for m in MODULES}
    assert {"core", "host", "engine", "actions", "api", "cli", "lab"} <= layers
    flat = sorted(m for m in MODULES if _layer(m) not in set(ALLOWED) | {"installer"})
    assert flat == [], f"modules outside every layer: {flat}"


def test_no_import_cycle():
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:        # Tarjan: a strongly connected component > 1 is a cycle
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while (w := stack.pop()) != v:
                comp.append(w)
            if comp:
                cycles.append(sorted(comp + [v]))

    for m in sorted(GRAPH):
        if m not in index:
            visit(m)
    assert cycles == []


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _layer(m) in ALLOWED))
def test_each_layer_imports_only_the_layers_below(module):
    wrong = sorted(i for i in GRAPH[module] if _layer(i) not in ALLOWED[_layer(module)])
    assert wrong == [], f"{module} ({_layer(module)}) imports {wrong}"


def test_core_touches_no_host():
    for m in (m for m in MODULES if _layer(m) == "core"):
        for imported, _ in _imports(MODULES[m]):
            assert not imported.startswith(("paramiko", "fabric", "kubernetes", "invoke")), f"{m} imports {imported}"


def test_no_module_uses_the_kubernetes_client_library():
    # host/kube.py is the API client: the official one cost 0.12 s to import and its typed
    # classes 0.06-0.5 s each (kubernetes_validate, the schemas, is another package)
    users = sorted(m for m, p in MODULES.items() if any(i == "kubernetes" or i.startswith("kubernetes.")
                                                        for i, _ in _imports(p)))
    assert users == []


def test_only_the_ssh_module_touches_paramiko():
    users = sorted(m for m, p in MODULES.items() if any(i.startswith(("paramiko", "fabric")) for i, _ in _imports(p)))
    assert users == ["installer.host.ssh"]


def test_function_local_imports_are_only_the_slow_libraries():
    odd = [(m, i) for m, p in MODULES.items() if _layer(m) != "cli"
           for i, local in _imports(p) if local and not i.startswith(LAZY_OK)]
    assert odd == []


def test_no_action_imports_a_phase_module():
    # what a day-2 command shares with apply's phases lives outside engine/phases (engine/context,
    # parts, api_objects, bootstrap; host/): a phase is apply's step, never another command's helper
    users = sorted((m, i) for m, p in MODULES.items() if _layer(m) in ("actions", "api")
                   for i, _ in _imports(p) if i.startswith("installer.engine.phases."))
    assert users == []


def test_no_module_over_about_400_lines():
    # a module named for what it holds stays readable in one sitting; the few at the edge are
    # named here so a new one over the line is a decision, not drift
    long = sorted((m, n) for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > 415)
    assert long == []


def test_every_connection_is_made_by_a_session():
    # one way to connect: engine/session.py makes every Remote (host keys verified, closed with
    # the session, the lock given back); a module that builds its own skips all three
    makers = sorted(m for m, p in MODULES.items()
                    if any(isinstance(n, ast.Call) and getattr(n.func, "id", None) == "Remote"
                           for n in ast.walk(ast.parse(p.read_text()))))
    assert makers == []         # session.py calls its factory (Remote by default), never Remote(...) itself


def test_actions_and_the_engine_take_a_cluster_not_paths():
    # a command resolves its inventory and state once (core/cluster.py); an action or the runner
    # that loads an inventory or finds a state directory again is a second resolution
    again = sorted((m, n.func.id) for m, p in MODULES.items() if _layer(m) in ("actions", "engine")
                   for n in ast.walk(ast.parse(p.read_text()))
                   if isinstance(n, ast.Call) and getattr(n.func, "id", None) in ("as_inventory", "state_for", "load"))
    assert again == []


# --- the control plane as a target chosen once (engine/planes/, engine/run.py) -------------------

# who may ask the inventory whether the control plane is hosted: the pure core (the model, and
# the render of a tenant's objects, certificates and add-ons from it), the planes, and the host
# modules only the hosted plane uses (its hosting cluster, its etcd member count)
HOSTED_READERS = ("installer.core.", "installer.engine.planes", "installer.host.hosting",
                  "installer.host.tenant_members", "installer.host.tenant_guards")


def _reads_of(path: Path, attr: str) -> list[int]:
    return [n.lineno for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Attribute) and n.attr == attr]


def test_only_the_planes_ask_which_kind_of_control_plane_it_is():
    """Actions, phases, the runner and the CLI never branch on spec.controlPlane.mode: they ask
    the run's plane (a new kind of control plane is a class, not a branch in every command)."""
    branching = sorted((m, lines) for m, p in MODULES.items() if not m.startswith(HOSTED_READERS)
                       and (lines := _reads_of(p, "hosted")))
    assert branching == []


def test_each_plane_is_made_in_one_place():
    made = sorted((m, node.func.id) for m, p in MODULES.items() for node in ast.walk(ast.parse(p.read_text()))
                  if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("SystemdPlane", "HostedPlane"))
    assert made == [("installer.engine.planes", "HostedPlane"), ("installer.engine.planes", "SystemdPlane")]


# module-level state a process keeps, each named with why: a lock around one file's writes and a
# counter that only makes names unique; the lab's own host bookkeeping
PROCESS_STATE = {("installer.host.ssh", "_known_hosts_lock"), ("installer.host.runmark", "_scope_counter"),
                 ("installer.lab.nspawn", "_CGROUP_MAKING"), ("installer.lab.nspawn", "_STARTED")}


def test_no_process_wide_registry():
    """What a command holds (the state's flock, the apply lock, the tenant's Lease, the mark of
    its remote commands) lives on its Run and is handed down; nothing is remembered in a module
    for whoever asks next (a nested command used to find its outer one's lock that way)."""
    found = set()
    for m, p in MODULES.items():
        tree = ast.parse(p.read_text())
        assert not [n for n in ast.walk(tree) if isinstance(n, ast.Global)], f"{m}: a global statement"
        for node in tree.body:
            if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
                continue
            v = node.value
            mutable = (isinstance(v, (ast.Dict, ast.List, ast.Set)) and not (getattr(v, "keys", None) or
                                                                            getattr(v, "elts", None))
                       or isinstance(v, ast.Call) and (getattr(v.func, "id", None) in ("dict", "set", "list")
                                                       or getattr(v.func, "attr", None) in ("Lock", "RLock", "count",
                                                                                            "local")))
            if mutable:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                found |= {(m, t.id) for t in targets if isinstance(t, ast.Name)}
    assert found == PROCESS_STATE


def test_the_kubebuild_modules_import_no_cycle_and_nothing_imports_build():
    """tools/kubebuild imports its modules by name (build.py puts their directory on sys.path):
    build.py, the entry point, at the root and nothing importing it; buildcache.py at the leaves."""
    modules = {p.stem: p for p in (ROOT / "tools/kubebuild").glob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):     # function-local imports too
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
        graph[name] = found & modules.keys() - {name}
    assert sorted(m for m, deps in graph.items() if "build" in deps) == []
    done: list[str] = []
    while len(done) < len(graph):       # take off the modules whose imports are all taken off
        ready = sorted(m for m, deps in graph.items() if m not in done and deps <= set(done))
        assert ready, f"import cycle among {sorted(set(graph) - set(done))}"
        done += ready
    assert graph["buildcache"] == set()
