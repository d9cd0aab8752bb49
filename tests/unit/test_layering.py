"""The layers point down only (docs/dataplane.md, "Layers"): the scheduler never imports the torch facade
(it receives a Communicator), the data plane imports neither, and nothing above the data plane
reaches into its internals (its buffer pool, its dtype codes). The package is the product: nothing in
it imports the project's lab, benchmarks or tests, and the lab's model stays torch-free."""
import ast
import pathlib
import subprocess
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "fasthorovod"

# module prefix -> imports forbidden anywhere in it (module level, functions, TYPE_CHECKING alike)
FORBIDDEN = {
    "fasthorovod/scheduler": ("fasthorovod.torch", "horovod"),
    "fasthorovod/proxy": ("fasthorovod.torch", "fasthorovod.scheduler", "horovod.torch"),
    # the torch.distributed backend runs without Horovod: the data plane and c10d only
    "fasthorovod/distributed": ("fasthorovod.torch", "fasthorovod.scheduler", "horovod.torch"),
    "fasthorovod/buckets.py": ("fasthorovod.torch", "fasthorovod.scheduler", "fasthorovod.proxy", "horovod"),
    # the plan is decided by pure functions: nothing that starts a process, opens a socket or
    # touches the core (fasthorovod/proxy/plan.py), so it is tested without any
    "fasthorovod/proxy/plan.py": ("fasthorovod._C", "fasthorovod.proxy.startup", "fasthorovod.proxy.group",
                                  "fasthorovod.proxy.core", "torch", "socket", "subprocess"),
    # start-up builds the group's parts; it never posts a collective or reads a request
    "fasthorovod/proxy/startup.py": ("fasthorovod.proxy.requests", "torch"),
    # the package is the product: the lab, the benchmarks and the tests import it, never the reverse
    "fasthorovod": ("lab", "benchmarks", "tests"),
    # the model runs anywhere, quickly: no torch, no facade, no scheduler
    "lab/sim": ("fasthorovod.torch", "fasthorovod.scheduler", "horovod.torch", "torch"),
}


def imported_modules(path: pathlib.Path, root: pathlib.Path = PACKAGE.parent):
    """Every module an import statement in `path` names (``from a import b`` gives a and a.b)."""
    tree = ast.parse(path.read_text(), str(path))
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            yield node.lineno, base
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}"


def _files(prefix: str):
    target = PACKAGE.parent / prefix
    return [target] if target.suffix == ".py" else sorted(target.rglob("*.py"))


@pytest.mark.parametrize("prefix", sorted(FORBIDDEN))
def test_no_upward_imports(prefix):
    bad = []
    for path in _files(prefix):
        for line, module in imported_modules(path):
            for forbidden in FORBIDDEN[prefix]:
                if module == forbidden or module.startswith(forbidden + "."):
                    bad.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}")
    assert not bad, "\n".join(bad)


def test_the_scan_sees_imports_inside_functions(tmp_path):
    fake = tmp_path / "fasthorovod" / "scheduler" / "x.py"
    fake.parent.mkdir(parents=True)
    fake.write_text("def f():\n    from fasthorovod.torch import mpi_ops\n    from . import comm\n")
    found = {m for _, m in imported_modules(fake, tmp_path)}
    assert {"fasthorovod.torch", "fasthorovod.torch.mpi_ops", "fasthorovod.scheduler.comm"} <= found


def test_importing_the_scheduler_loads_neither_facade_nor_horovod_torch():
    code = ("import sys, fasthorovod.scheduler, fasthorovod.buckets, fasthorovod.proxy.group, "
            "fasthorovod.proxy.balance\n"
            "bad = sorted(m for m in sys.modules if m.startswith(('fasthorovod.torch', 'horovod.torch')))\n"
            "print(bad); sys.exit(1 if bad else 0)\n")
    env_path = str(PACKAGE.parent)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={**__import__("os").environ, "PYTHONPATH": env_path})
    assert result.returncode == 0, result.stdout + result.stderr


def test_nothing_above_the_data_plane_reaches_into_it():
    """The scheduler and the facade use ProxyGroup's public API (alloc, supports, ...), not its pool
    or its dtype codes."""
    bad = []
    for prefix in ("fasthorovod/scheduler", "fasthorovod/torch", "fasthorovod/buckets.py"):
        for path in _files(prefix):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and node.attr in ("pool", "channel", "DTYPE_CODES"):
                    bad.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} uses .{node.attr}")
                if isinstance(node, ast.Name) and node.id == "DTYPE_CODES":
                    bad.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} uses DTYPE_CODES")
                if isinstance(node, ast.alias) and node.name == "DTYPE_CODES":
                    bad.append(f"{path.relative_to(PACKAGE.parent)} imports DTYPE_CODES")
    assert not bad, "\n".join(bad)
