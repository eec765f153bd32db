"""Arrows point down (DESIGN.md): pallas_kernels imports nothing from jaxkv or models;
jaxkv nothing from models, except its CLI (the top layer, which loads models)."""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _imports(path):
  tree = ast.parse(open(path, encoding="utf-8").read(), path)
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      yield from (a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      yield node.module


@pytest.mark.parametrize("package,forbidden", [("pallas_kernels", ("jaxkv", "models")),
                                               ("jaxkv", ("models",))])
def test_no_upward_imports(package, forbidden):
  pkg = os.path.join(ROOT, package)
  top = ("cli.py", "__main__.py") if package == "jaxkv" else ()
  files = [f for f in sorted(os.listdir(pkg)) if f.endswith(".py") and f not in top]
  assert files
  bad = [(f, m) for f in files for m in _imports(os.path.join(pkg, f))
         if m.split(".")[0] in forbidden]
  assert not bad, bad


def test_no_module_shadowed_by_a_reexported_name():
  """``jaxkv.X`` is one thing: no submodule shares its name with a re-export."""
  import jaxkv  # pylint: disable=import-outside-toplevel
  modules = {f[:-3] for f in os.listdir(os.path.join(ROOT, "jaxkv")) if f.endswith(".py")}
  clashes = [n for n in jaxkv.__all__ if n in modules and not isinstance(
      getattr(jaxkv, n), type(jaxkv))]
  assert not clashes, clashes
