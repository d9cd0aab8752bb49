"""fasthorovod/_C.pyi describes the native module as it is: every public name, every method."""
import ast
from pathlib import Path

from fasthorovod import _C

STUB = Path(_C.__file__).with_name("_C.pyi")


def _stub_names():
    tree = ast.parse(STUB.read_text())
    names, members = set(), {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign):
            names.add(node.target.id)
        if isinstance(node, ast.ClassDef):
            members[node.name] = {n.name if isinstance(n, ast.FunctionDef) else n.target.id
                                  for n in node.body if isinstance(n, (ast.FunctionDef, ast.AnnAssign))}
    return names, members


def test_the_stub_names_exactly_what_the_module_exports():
    names, members = _stub_names()
    exported = {n for n in dir(_C) if not n.startswith("_")}
    assert names - {"Buffer"} == exported
    for cls, declared in members.items():
        public = {n for n in vars(getattr(_C, cls)) if not n.startswith("_")} | {"__init__"}
        assert declared - {"__buffer__"} == public, cls
