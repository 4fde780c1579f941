"""Checks the type stub kvdepot/_kvdepot.pyi against the built native module,
so that it cannot drift from _kvdepot.cc's pybind11 definitions (mypy and
stubtest are not installed here).

For the module and each class: the stub names every public attribute the
module has, and nothing it lacks, of the same kind (function or method,
static method, property, enum member); the protocol methods the binding
defines (__init__, __len__, __enter__, __exit__, __int__, __index__) are in
the stub exactly where the binding has them. For every function and method,
the parameter names (pybind11's signature line in its docstring) and which
parameters have defaults are the same; pybind11's unnamed parameters (arg0,
...) are positional-only in the stub. Also: the stub installed next to the
built module is the source's copy, and the packaging ships it.

Run with PYTHONPATH=<build>/python (ctest: python_stub_test). Exits 77
(skipped) when the kvdepot package does not import (no numpy).
"""

import ast
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest

try:
    import kvdepot
    from kvdepot import _kvdepot as native
except ImportError as e:  # pragma: no cover
    print(f"skipping: {e}", file=sys.stderr)
    sys.exit(77)

SOURCE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE_STUB = os.path.join(SOURCE_DIR, "kvdepot", "_kvdepot.pyi")
# Protocol methods a binding may define; each must be in the stub exactly
# where the binding defines it.
CHECKED_DUNDERS = {"__init__", "__len__", "__enter__", "__exit__", "__int__", "__index__"}


def runtime_kind(owner, name):
    """'function', 'staticmethod', 'property', 'member' (enum value) or
    None (something else, e.g. a dunder the stub need not name)."""
    raw = vars(owner).get(name) if isinstance(owner, type) else getattr(owner, name)
    if isinstance(owner, type):
        if isinstance(raw, staticmethod):
            return "staticmethod"
        if isinstance(raw, property):
            return "property"
        if isinstance(raw, owner):
            return "member"
        if type(raw).__name__ in ("instancemethod", "builtin_function_or_method"):
            return "function"
        return None
    if type(raw).__name__ == "builtin_function_or_method":
        return "function"
    if isinstance(raw, type):
        return "class"
    return None


def stub_members(body):
    """{name: (kind, node)} of a stub module or class body."""
    out = {}
    for node in body:
        if isinstance(node, ast.ClassDef):
            out[node.name] = ("class", node)
        elif isinstance(node, ast.FunctionDef):
            decorators = {d.id for d in node.decorator_list if isinstance(d, ast.Name)}
            if "property" in decorators:
                out[node.name] = ("property", node)
            elif "staticmethod" in decorators:
                out[node.name] = ("staticmethod", node)
            else:
                out[node.name] = ("function", node)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = ("member", node)
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    out[t.id] = ("alias", node)
    return out


def split_top_level(text):
    """Splits at the commas outside brackets and quotes."""
    parts, depth, quote, cur = [], 0, None, ""
    for ch in text:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
            continue
        cur += ch
    if cur.strip():
        parts.append(cur)
    return parts


def runtime_params(func, name):
    """[(name, has_default)] from pybind11's signature line, without self."""
    doc = func.__doc__ or ""
    m = re.match(re.escape(name) + r"\((.*?)\) -> ", doc)
    if m is None:
        raise AssertionError(f"no pybind11 signature line for {name}: {doc[:80]!r}")
    params = []
    for part in split_top_level(m.group(1)):
        pname = part.split(":")[0].strip()
        has_default = re.search(r"\s=\s", part) is not None
        params.append((pname, has_default))
    if params and params[0][0] == "self":
        params = params[1:]
    return params


def stub_params(node, is_method):
    """[(name, has_default, positional_only)] of a stub def, without self."""
    a = node.args
    pos = a.posonlyargs + a.args
    defaults = [False] * (len(pos) - len(a.defaults)) + [True] * len(a.defaults)
    out = [(p.arg, d, i < len(a.posonlyargs)) for i, (p, d) in enumerate(zip(pos, defaults))]
    out += [(p.arg, d is not None, False) for p, d in zip(a.kwonlyargs, a.kw_defaults)]
    if is_method and out and out[0][0] == "self":
        out = out[1:]
    return out


class StubTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        installed = os.path.join(os.path.dirname(native.__file__), "_kvdepot.pyi")
        with open(installed, encoding="utf-8") as f:
            cls.stub_text = f.read()
        cls.installed = installed
        cls.stub = ast.parse(cls.stub_text)

    def check_params(self, func, node, qualname, is_method):
        want = runtime_params(func, func.__name__)
        got = stub_params(node, is_method)
        self.assertEqual(len(got), len(want), f"{qualname}: {got} vs {want}")
        for (sname, sdef, sposonly), (rname, rdef) in zip(got, want):
            if re.fullmatch(r"arg\d+", rname):  # unnamed in the binding
                self.assertTrue(sposonly, f"{qualname}: {sname} must be positional-only")
            else:
                self.assertEqual(sname, rname, qualname)
                self.assertFalse(sposonly, f"{qualname}: {sname} is a keyword too")
            self.assertEqual(sdef, rdef, f"{qualname}: default of {sname}")

    def test_installed_stub_is_the_source(self):
        with open(SOURCE_STUB, encoding="utf-8") as f:
            self.assertEqual(self.stub_text, f.read(),
                             f"{self.installed} is stale: rebuild (cmake copies it)")

    def test_packaging_ships_the_stub(self):
        import tomllib

        with open(os.path.join(SOURCE_DIR, "pyproject.toml"), "rb") as f:
            data = tomllib.load(f)["tool"]["setuptools"]["package-data"]["kvdepot"]
        self.assertIn("_kvdepot.pyi", data)
        self.assertIn("py.typed", data)
        with open(os.path.join(SOURCE_DIR, "CMakeLists.txt"), encoding="utf-8") as f:
            self.assertIn("kvdepot/_kvdepot.pyi", f.read())

    def test_setup_refuses_a_tree_without_the_native_module(self):
        # pip never compiles _kvdepot: a wheel built without it would not
        # import, so setup.py stops, saying why (and works with it there).
        try:
            import setuptools  # noqa: F401
        except ImportError:
            self.skipTest("setuptools is not installed")
        with tempfile.TemporaryDirectory() as tree:
            for name in ("setup.py", "pyproject.toml", "README.md"):
                shutil.copy(os.path.join(SOURCE_DIR, name), tree)
            shutil.copytree(os.path.join(SOURCE_DIR, "kvdepot"),
                            os.path.join(tree, "kvdepot"),
                            ignore=shutil.ignore_patterns("*.so", "__pycache__"))

            def version():
                return subprocess.run([sys.executable, "setup.py", "--version"], cwd=tree,
                                      capture_output=True, text=True, timeout=120)

            r = version()
            self.assertNotEqual(r.returncode, 0, r.stdout)
            self.assertIn("no native module kvdepot/_kvdepot*.so", r.stderr)
            open(os.path.join(tree, "kvdepot", "_kvdepot.cpython-311-x86_64-linux-gnu.so"),
                 "wb").close()
            r = version()
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertEqual(r.stdout.split()[-1], "0.1.0")

    def test_module_attributes(self):
        public = {n for n in dir(native) if not n.startswith("_")}
        members = {n: k for n, k in stub_members(self.stub.body).items()
                   if not n.startswith("_")}
        self.assertEqual(set(members), public)
        for name, (kind, node) in members.items():
            self.assertEqual(kind, runtime_kind(native, name), name)
            if kind == "function":
                self.check_params(getattr(native, name), node, name, is_method=False)

    def test_class_attributes(self):
        for cname, (kind, cnode) in stub_members(self.stub.body).items():
            if kind != "class":
                continue
            cls = getattr(native, cname)
            runtime = {n: runtime_kind(cls, n) for n in vars(cls)}
            runtime = {n: k for n, k in runtime.items() if k is not None and (
                not n.startswith("_") or n in CHECKED_DUNDERS)}
            stub = {n: m for n, m in stub_members(cnode.body).items()
                    if not n.startswith("_") or n in CHECKED_DUNDERS}
            self.assertEqual(set(stub), set(runtime), cname)
            for name, (skind, node) in stub.items():
                self.assertEqual(skind, runtime[name], f"{cname}.{name}")
                if skind in ("function", "staticmethod"):
                    self.check_params(getattr(cls, name), node, f"{cname}.{name}",
                                      is_method=skind == "function")

    def test_enum_members_are_all_named(self):
        for cname in ("Tier", "KvDtype", "KvCacheLayout"):
            cls = getattr(native, cname)
            cnode = next(n for n in self.stub.body
                         if isinstance(n, ast.ClassDef) and n.name == cname)
            members = {n for n, (k, _) in stub_members(cnode.body).items() if k == "member"}
            self.assertEqual(members - {"__members__"}, set(cls.__members__), cname)

    def test_the_package_reexports_what_the_stub_types(self):
        # The package's names for the native classes are the native ones
        # (Client is a subclass with the same methods and more).
        for name in ("BlockInfo", "CacheLoad", "KvCacheLayout", "KvDtype", "KvLayout",
                     "LookupReply", "Tier", "TransferOp", "gather", "scatter",
                     "dtype_bytes", "dtype_name"):
            self.assertIs(getattr(kvdepot, name), getattr(native, name), name)
        self.assertTrue(issubclass(kvdepot.Client, native.Client))


if __name__ == "__main__":
    unittest.main()
