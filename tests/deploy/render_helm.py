#!/usr/bin/env python3
"""Renders a Helm chart without helm, for tests.

Implements the subset of Go templates and Sprig that deploy/helm/kvdepot uses,
with Helm's semantics for it:

  actions     {{ pipeline }}, {{- trimming -}}, {{/* comments */}}
  control     if / else if / else / end, with / else / end, range / else / end
              (over a list or, in key order, a map), define / end
  operands    . .Values.a.b $ $.Values.a "string" `raw` 123 true false nil
              ( pipeline )
  functions   include quote default toYaml nindent indent trunc trimSuffix
              contains printf eq ne not and or sha256sum fail hasKey lower
              toString trimPrefix regexMatch regexFind int64 add sub mul div lt kindIs

Anything else (variables, template, tpl, other functions) is an error, so the
chart cannot drift outside what the tests can render. As in Helm, values read
from YAML behave as float64: printing a number of 1e6 or more would give
scientific notation (1e+06), which this renderer refuses; use toYaml.

  render_helm.py CHART_DIR [--set a.b=value]... [-f values.yaml]...
                 [--release-name NAME] [--namespace NS] [--notes]
"""

import argparse
import copy
import hashlib
import json
import os
import re
import sys

import yaml


class TemplateError(Exception):
    pass


class ChartFailure(TemplateError):
    """The chart's own `fail`: Helm stops with the chart's message."""


# ---------------------------------------------------------------- lexing

_ACTION = re.compile(r"\{\{(-\s)?(.*?)(\s-)?\}\}", re.S)


def _lex(src, name):
    """Returns [("text", s)] and [("act", body, line)] items, trimming applied."""
    items = []
    pos = 0
    for m in _ACTION.finditer(src):
        items.append(["text", src[pos : m.start()]])
        line = src.count("\n", 0, m.start()) + 1
        items.append(
            [
                "act",
                m.group(2).strip(),
                f"{name}:{line}",
                m.group(1) is not None,
                m.group(3) is not None,
            ]
        )
        pos = m.end()
    items.append(["text", src[pos:]])
    for i, item in enumerate(items):
        if item[0] != "act":
            continue
        if item[3]:
            items[i - 1][1] = items[i - 1][1].rstrip(" \t\r\n")
        if item[4]:
            items[i + 1][1] = items[i + 1][1].lstrip(" \t\r\n")
    if "{{" in "".join(t[1] for t in items if t[0] == "text"):
        raise TemplateError(f"{name}: unterminated or malformed action")
    return [tuple(t[:3]) for t in items]


_TOKEN = re.compile(
    r"""
    (?P<ws>\s+)
  | (?P<str>"(?:[^"\\]|\\.)*")
  | (?P<raw>`[^`]*`)
  | (?P<num>-?\d+(?:\.\d+)?)
  | (?P<var>\$(?:\.[A-Za-z_][A-Za-z0-9_]*)*)
  | (?P<field>(?:\.[A-Za-z_][A-Za-z0-9_]*)+|\.)
  | (?P<ident>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<punct>[()|])
""",
    re.X,
)


def _tokenize(expr, where):
    if re.search(r"\$[A-Za-z_]", expr):
        raise TemplateError(f"{where}: variables are not supported: {expr!r}")
    tokens = []
    pos = 0
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if not m:
            raise TemplateError(f"{where}: unsupported syntax at {expr[pos:]!r}")
        pos = m.end()
        kind = m.lastgroup
        if kind != "ws":
            tokens.append((kind, m.group()))
    return tokens


# ---------------------------------------------------------------- parsing
#
# Expressions: a pipeline is a list of commands; a command is a list of
# operands; an operand is ("lit", v) | ("field", [names]) | ("root", [names])
# | ("ident", name) | ("pipe", pipeline).


def _parse_pipeline(tokens, pos, where):
    commands, command = [], []
    while pos < len(tokens):
        kind, text = tokens[pos]
        if text == ")":
            break
        pos += 1
        if text == "|":
            if not command:
                raise TemplateError(f"{where}: empty command in pipeline")
            commands.append(command)
            command = []
        elif text == "(":
            sub, pos = _parse_pipeline(tokens, pos, where)
            if pos >= len(tokens) or tokens[pos][1] != ")":
                raise TemplateError(f"{where}: unclosed (")
            pos += 1
            command.append(("pipe", sub))
        elif kind == "str":
            command.append(("lit", json.loads(text)))
        elif kind == "raw":
            command.append(("lit", text[1:-1]))
        elif kind == "num":
            command.append(("lit", float(text) if "." in text else int(text)))
        elif kind == "var":
            command.append(("root", text.split(".")[1:]))
        elif kind == "field":
            command.append(("field", [] if text == "." else text.split(".")[1:]))
        elif kind == "ident":
            if text in ("true", "false", "nil"):
                command.append(
                    ("lit", {"true": True, "false": False, "nil": None}[text])
                )
            else:
                command.append(("ident", text))
    if not command:
        raise TemplateError(f"{where}: empty pipeline")
    commands.append(command)
    return commands, pos


def _pipeline(expr, where):
    tokens = _tokenize(expr, where)
    commands, pos = _parse_pipeline(tokens, 0, where)
    if pos != len(tokens):
        raise TemplateError(f"{where}: unexpected ) in {expr!r}")
    return commands


def _parse(items, defines, name):
    """Parses lexed items into a node list. Nodes: ("text", s), ("out", p, w),
    ("if", [(p|None, body)], w), ("with"|"range", p, body, else_body, w)."""
    pos = 0

    def block(stop):
        nonlocal pos
        nodes = []
        while pos < len(items):
            item = items[pos]
            if item[0] == "text":
                if item[1]:
                    nodes.append(("text", item[1]))
                pos += 1
                continue
            body, where = item[1], item[2]
            word = body.split(None, 1)[0] if body else ""
            rest = body[len(word) :].strip()
            if body.startswith("/*"):
                if not body.endswith("*/"):
                    raise TemplateError(f"{where}: unterminated comment")
                pos += 1
            elif word in ("end", "else"):
                if word not in stop:
                    raise TemplateError(f"{where}: unexpected {{{{ {body} }}}}")
                return nodes, word, rest, where
            elif word == "if":
                pos += 1
                branches = []
                cond = _pipeline(rest, where)
                while True:
                    sub, ended_by, tail, w = block(("end", "else"))
                    branches.append((cond, sub))
                    pos += 1
                    if ended_by == "end":
                        break
                    if tail.startswith("if "):
                        cond = _pipeline(tail[3:], w)
                    elif not tail:
                        sub, ended_by, _, w = block(("end",))
                        pos += 1
                        branches.append((None, sub))
                        break
                    else:
                        raise TemplateError(f"{w}: unsupported else {tail!r}")
                nodes.append(("if", branches, where))
            elif word in ("with", "range"):
                pos += 1
                expr = _pipeline(rest, where)
                sub, ended_by, tail, w = block(("end", "else"))
                pos += 1
                else_sub = []
                if ended_by == "else":
                    if tail:
                        raise TemplateError(f"{w}: unsupported else {tail!r}")
                    else_sub, _, _, _ = block(("end",))
                    pos += 1
                nodes.append((word, expr, sub, else_sub, where))
            elif word == "define":
                m = re.fullmatch(r'"([^"]+)"', rest)
                if not m:
                    raise TemplateError(f"{where}: define needs a quoted name")
                pos += 1
                sub, _, _, _ = block(("end",))
                pos += 1
                if m.group(1) in defines:
                    raise TemplateError(
                        f"{where}: template {m.group(1)!r} defined twice"
                    )
                defines[m.group(1)] = sub
            elif word in ("template", "block"):
                raise TemplateError(f"{where}: unsupported action {{{{ {body} }}}}")
            else:
                nodes.append(("out", _pipeline(body, where), where))
                pos += 1
        if stop:
            raise TemplateError(f"{name}: missing {{{{ end }}}}")
        return nodes, None, "", name

    nodes, _, _, _ = block(())
    return nodes


# ---------------------------------------------------------------- values


def _truthy(v):
    if v is None or v is False:
        return False
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return v != 0
    if isinstance(v, (str, list, dict)):
        return len(v) > 0
    return True


def go_str(v, where="value"):
    """Formats a value as Go's %v does for Helm values (numbers are float64)."""
    if v is None:
        return ""  # Helm replaces <no value> with nothing.
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, Int64):
        return str(int(v))
    if isinstance(v, (int, float)):
        f = float(v)
        if f.is_integer() and abs(f) < 1e6:
            return str(int(f))
        if not f.is_integer() and 1e-4 <= abs(f) < 1e6:
            return repr(f)
        raise TemplateError(
            f"{where}: helm would print {v!r} in scientific notation; use toYaml"
        )
    if isinstance(v, str):
        return v
    raise TemplateError(f"{where}: cannot print a {type(v).__name__}; use toYaml")


def to_yaml(v):
    """Helm's toYaml: keys sorted, no trailing newline."""
    out = yaml.safe_dump(
        v, default_flow_style=False, sort_keys=True, allow_unicode=True, width=1 << 30
    )
    if out.endswith("\n...\n"):
        out = out[:-5]
    return out.rstrip("\n")


def _indent(n, s):
    pad = " " * int(n)
    return pad + s.replace("\n", "\n" + pad)


def _printf(fmt, *args):
    out, i = [], 0
    for m in re.finditer(r"%(.)|[^%]+", fmt):
        if m.group(1) is None:
            out.append(m.group())
        elif m.group(1) == "%":
            out.append("%")
        else:
            if i >= len(args):
                raise TemplateError(f"printf {fmt!r}: missing argument")
            arg = args[i]
            i += 1
            if m.group(1) in ("s", "v", "d"):
                out.append(go_str(arg, "printf"))
            elif m.group(1) == "q":
                out.append(json.dumps(go_str(arg, "printf"), ensure_ascii=False))
            else:
                raise TemplateError(f"printf: unsupported verb %{m.group(1)}")
    if i != len(args):
        raise TemplateError(f"printf {fmt!r}: too many arguments")
    return "".join(out)


def _default(d, *given):
    return given[0] if given and _truthy(given[0]) else d


def _and(*args):
    for a in args:
        if not _truthy(a):
            return a
    return args[-1]


def _or(*args):
    for a in args:
        if _truthy(a):
            return a
    return args[-1]


class Int64(int):
    """A Sprig int64 (add, mul, int64): printed in full, unlike values."""


def _wrap64(n):
    """Go's int64 arithmetic wraps around."""
    n &= (1 << 64) - 1
    return Int64(n - (1 << 64) if n >= 1 << 63 else n)


def _to_int64(v):
    """Sprig's toInt64 (cast.ToInt64): strings in Go's base-0 syntax, floats
    truncated; nil, anything unreadable and strings out of int64's range 0."""
    if isinstance(v, bool):
        return Int64(1 if v else 0)
    if isinstance(v, (int, float)):
        return _wrap64(int(v))
    if isinstance(v, str):
        s = v.strip()
        try:
            if re.fullmatch(r"[+-]?0[0-7]+", s):
                n = int(s, 8)  # Go's base 0: a leading 0 is octal
            else:
                n = int(s, 0)
        except ValueError:
            return Int64(0)
        return Int64(n) if -(1 << 63) <= n < (1 << 63) else Int64(0)
    return Int64(0)


def _kind_is(kind, v):
    """Sprig's kindIs for Helm values: YAML numbers are float64."""
    if v is None:
        actual = "invalid"
    elif isinstance(v, bool):
        actual = "bool"
    elif isinstance(v, Int64):
        actual = "int64"
    elif isinstance(v, (int, float)):
        actual = "float64"
    elif isinstance(v, str):
        actual = "string"
    elif isinstance(v, dict):
        actual = "map"
    elif isinstance(v, list):
        actual = "slice"
    else:
        actual = type(v).__name__
    return kind == actual


def _lt(a, b):
    numbers = (int, float)
    if isinstance(a, numbers) and isinstance(b, numbers):
        if isinstance(a, float) != isinstance(b, float):
            raise TemplateError("lt: incompatible types for comparison")
        return a < b
    if isinstance(a, str) and isinstance(b, str):
        return a < b
    raise TemplateError("lt: incompatible types for comparison")


def _fail(message):
    raise ChartFailure(go_str(message, "fail"))


def _has_key(d, key):
    if not isinstance(d, dict):
        raise TemplateError(f"hasKey: not a map: {type(d).__name__}")
    return key in d


def _mul(a, *rest):
    out = _to_int64(a)
    for b in rest:
        out = _wrap64(out * _to_int64(b))
    return out


def _eq(a, *others):
    if not others:
        raise TemplateError("eq needs two arguments")
    return any(a == b for b in others)


_FUNCS = {
    "quote": lambda *a: " ".join(
        json.dumps(go_str(x, "quote"), ensure_ascii=False) for x in a if x is not None
    ),
    "default": _default,
    "toYaml": to_yaml,
    "nindent": lambda n, s: "\n" + _indent(n, s),
    "indent": _indent,
    "trunc": lambda n, s: s[:n] if n >= 0 else s[n:],
    "trimSuffix": lambda suffix, s: s[: -len(suffix)]
    if suffix and s.endswith(suffix)
    else s,
    "contains": lambda sub, s: sub in s,
    "printf": _printf,
    "eq": _eq,
    "ne": lambda a, b: a != b,
    "not": lambda a: not _truthy(a),
    "and": _and,
    "or": _or,
    "sha256sum": lambda s: hashlib.sha256(s.encode()).hexdigest(),
    "fail": _fail,
    "hasKey": _has_key,
    "lower": lambda s: s.lower(),
    "toString": lambda v: go_str(v, "toString"),
    "trimPrefix": lambda prefix, s: s[len(prefix) :] if s.startswith(prefix) else s,
    # Go's RE2 and Python's re agree on the simple patterns the chart uses.
    "regexMatch": lambda regex, s: re.search(regex, s) is not None,
    "regexFind": lambda regex, s: (lambda m: m.group() if m else "")(
        re.search(regex, s)
    ),
    "int64": _to_int64,
    "add": lambda *a: _wrap64(sum(_to_int64(x) for x in a)),
    "mul": _mul,
    "sub": lambda a, b: _wrap64(_to_int64(a) - _to_int64(b)),
    "kindIs": _kind_is,
    # Go's integer division truncates toward zero; divisors here are positive.
    "div": lambda a, b: Int64(int(_to_int64(a) / _to_int64(b)))
    if _to_int64(b) != 0
    else _fail("div: division by zero"),
    "lt": _lt,
}

_NO_ARG = object()


class Renderer:
    """Renders parsed templates that share one set of defines."""

    def __init__(self, defines):
        self.defines = defines

    def _walk(self, value, names, where):
        for name in names:
            if value is None:
                raise TemplateError(f"{where}: nil pointer evaluating .{name}")
            if not isinstance(value, dict):
                raise TemplateError(
                    f"{where}: can't evaluate field {name} in a {type(value).__name__}"
                )
            value = value.get(name)
        return value

    def _operand(self, op, dot, root, where):
        kind, arg = op
        if kind == "lit":
            return arg
        if kind == "field":
            return self._walk(dot, arg, where)
        if kind == "root":
            return self._walk(root, arg, where)
        if kind == "pipe":
            return self.eval(arg, dot, root, where)
        raise TemplateError(f"{where}: function {arg!r} used as a value")

    def eval(self, pipeline, dot, root, where):
        value = _NO_ARG
        for command in pipeline:
            head = command[0]
            if head[0] == "ident":
                name = head[1]
                args = [self._operand(op, dot, root, where) for op in command[1:]]
                if value is not _NO_ARG:
                    args.append(value)
                if name == "include":
                    if len(args) != 2 or not isinstance(args[0], str):
                        raise TemplateError(
                            f"{where}: include needs a name and a context"
                        )
                    value = self.include(args[0], args[1], root, where)
                elif name in _FUNCS:
                    try:
                        value = _FUNCS[name](*args)
                    except TypeError as e:
                        raise TemplateError(f"{where}: {name}: {e}") from None
                else:
                    raise TemplateError(f"{where}: unsupported function {name!r}")
            else:
                if len(command) != 1 or value is not _NO_ARG:
                    raise TemplateError(f"{where}: can't give argument to non-function")
                value = self._operand(head, dot, root, where)
        return value

    def include(self, name, dot, root, where):
        if name not in self.defines:
            raise TemplateError(f"{where}: no template {name!r}")
        return self.render(self.defines[name], dot, root)

    def render(self, nodes, dot, root):
        out = []
        for node in nodes:
            kind = node[0]
            if kind == "text":
                out.append(node[1])
            elif kind == "out":
                out.append(go_str(self.eval(node[1], dot, root, node[2]), node[2]))
            elif kind == "if":
                for cond, body in node[1]:
                    if cond is None or _truthy(self.eval(cond, dot, root, node[2])):
                        out.append(self.render(body, dot, root))
                        break
            elif kind == "with":
                value = self.eval(node[1], dot, root, node[4])
                if _truthy(value):
                    out.append(self.render(node[2], value, root))
                else:
                    out.append(self.render(node[3], dot, root))
            elif kind == "range":
                value = self.eval(node[1], dot, root, node[4])
                if isinstance(value, dict):
                    elements = [value[k] for k in sorted(value)]
                elif isinstance(value, list):
                    elements = value
                elif value is None:
                    elements = []
                else:
                    raise TemplateError(
                        f"{node[4]}: range over a {type(value).__name__}"
                    )
                for element in elements:
                    out.append(self.render(node[2], element, root))
                if not elements:
                    out.append(self.render(node[3], dot, root))
        return "".join(out)


def render_string(templates, context, entry):
    """Renders templates[entry] ({name: source}) with `context` as . and $."""
    defines = {}
    parsed = {
        name: _parse(_lex(src, name), defines, name) for name, src in templates.items()
    }
    return Renderer(defines).render(parsed[entry], context, context)


# ---------------------------------------------------------------- charts


def deep_merge(base, override):
    out = copy.deepcopy(base)
    for key, value in override.items():
        if value is None:
            out.pop(key, None)  # Helm: null deletes the key
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def parse_set(assignments):
    """--set a.b=c ... as a nested dict; values are parsed as YAML scalars."""
    out = {}
    for assignment in assignments:
        key, sep, raw = assignment.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {assignment!r}: expected key=value")
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = yaml.safe_load(raw) if raw else ""
    return out


def render_chart(chart_dir, values=None, release_name="kvdepot", namespace="default"):
    """Renders every template of the chart. Returns {"templates/x.yaml": text},
    NOTES.txt included, manifests that render empty left out (as Helm does)."""
    with open(os.path.join(chart_dir, "Chart.yaml")) as f:
        chart = yaml.safe_load(f)
    with open(os.path.join(chart_dir, "values.yaml")) as f:
        merged = yaml.safe_load(f) or {}
    merged = deep_merge(merged, values or {})
    tdir = os.path.join(chart_dir, "templates")
    sources = {}
    for name in sorted(os.listdir(tdir)):
        with open(os.path.join(tdir, name)) as f:
            sources[f"templates/{name}"] = f.read()
    context = {
        "Values": merged,
        "Release": {
            "Name": release_name,
            "Namespace": namespace,
            "Service": "Helm",
            "IsInstall": True,
            "IsUpgrade": False,
        },
        "Chart": {
            "Name": chart["name"],
            "Version": chart["version"],
            "AppVersion": chart.get("appVersion", ""),
        },
    }
    defines = {}
    parsed = {
        name: _parse(_lex(src, name), defines, name) for name, src in sources.items()
    }
    renderer = Renderer(defines)
    out = {}
    for name, nodes in parsed.items():
        base = os.path.basename(name)
        if base.startswith("_"):
            continue
        context["Template"] = {
            "Name": f"{chart['name']}/{name}",
            "BasePath": f"{chart['name']}/templates",
        }
        text = renderer.render(nodes, context, context)
        if text.strip():
            out[name] = text
    return out


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("chart")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("-f", "--values", action="append", default=[])
    parser.add_argument("--release-name", default="kvdepot")
    parser.add_argument("--namespace", default="default")
    parser.add_argument("--notes", action="store_true", help="print NOTES.txt too")
    args = parser.parse_args(argv)
    values = {}
    for path in args.values:
        with open(path) as f:
            values = deep_merge(values, yaml.safe_load(f) or {})
    values = deep_merge(values, parse_set(args.set))
    try:
        rendered = render_chart(args.chart, values, args.release_name, args.namespace)
    except TemplateError as e:
        print(f"render_helm: {e}", file=sys.stderr)
        return 1
    chart_name = os.path.basename(os.path.normpath(args.chart))
    for name, text in rendered.items():
        if name.endswith("NOTES.txt") and not args.notes:
            continue
        print(f"---\n# Source: {chart_name}/{name}\n{text.strip(chr(10))}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
