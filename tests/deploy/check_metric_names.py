#!/usr/bin/env python3
"""Checks deploy/'s metric names against the daemon's contract.

Static mode (default): every kvdepot_* metric that the Grafana dashboards and
Prometheus rule files query must be a family of exported_metrics.txt (a
histogram through its _bucket, _sum or _count series), and every recording
rule they use (a name with a colon) must be defined in the rule files. With
--require-all-used, every family of the contract must also be queried
somewhere, so the dashboard and rules keep up with the daemon.

Live mode (--metrics-url URL): fetches a Prometheus text exposition and checks
that its kvdepot_* families (# TYPE lines) are exactly the contract's, with
the contract's types. Families with no labelled child yet have no # TYPE line
in prometheus-cpp's output: exercise the daemon first.

Exit status: 0 clean, 1 violations (listed on stderr), 2 unusable input.
"""

import argparse
import glob
import json
import os
import re
import sys
import urllib.request

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_NAME = re.compile(r"(?<![A-Za-z0-9_:$])[A-Za-z_:][A-Za-z0-9_:]*")
_HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def load_contract(path):
    """Returns {family: type} from exported_metrics.txt."""
    families = {}
    with open(path) as f:
        for number, line in enumerate(f, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 2 or parts[1] not in (
                "counter",
                "gauge",
                "histogram",
                "summary",
            ):
                raise ValueError(f"{path}:{number}: expected 'family type'")
            families[parts[0]] = parts[1]
    return families


def metric_names(expr):
    """The metric and recording-rule names a PromQL expression selects."""
    expr = _MATCHERS.sub(" ", _STRING.sub('""', expr))
    return {
        name
        for name in _NAME.findall(expr)
        if name.startswith("kvdepot_") or ":" in name
    }


def rule_expressions(path):
    """Returns ([(where, expr)], {recorded names}) of a Prometheus rule file."""
    with open(path) as f:
        doc = yaml.safe_load(f) or {}
    exprs, recorded = [], set()
    for group in doc.get("groups", []):
        for rule in group.get("rules", []):
            name = rule.get("record") or rule.get("alert")
            exprs.append((f"{path}: {name}", str(rule["expr"])))
            if "record" in rule:
                recorded.add(rule["record"])
    return exprs, recorded


def dashboard_expressions(path):
    """Returns [(where, expr)]: panel targets and query variables."""
    with open(path) as f:
        doc = json.load(f)
    exprs = []

    def walk(node, where):
        if isinstance(node, dict):
            title = node.get("title") or node.get("name") or where
            if isinstance(node.get("expr"), str):
                exprs.append((f"{path}: {title}", node["expr"]))
            for value in node.values():
                walk(value, title)
        elif isinstance(node, list):
            for value in node:
                walk(value, where)

    walk(doc.get("panels", []), "panels")
    for var in doc.get("templating", {}).get("list", []):
        if var.get("type") != "query":
            continue
        query = var.get("query")
        if isinstance(query, dict):
            query = query.get("query")
        if isinstance(query, str):
            exprs.append((f"{path}: variable {var.get('name')}", query))
    return exprs


def resolve(name, contract):
    """The contract family a kvdepot_* series name belongs to, or None."""
    kind = contract.get(name)
    if kind in ("counter", "gauge"):
        return name
    for suffix in _HISTOGRAM_SUFFIXES:
        base = name[: -len(suffix)]
        if name.endswith(suffix) and contract.get(base) in ("histogram", "summary"):
            if suffix == "_bucket" and contract[base] == "summary":
                return None
            return base
    return None


def check_static(contract, dashboards, rule_files, require_all_used=False):
    """Returns a list of violations."""
    exprs, recorded = [], set()
    for path in rule_files:
        e, r = rule_expressions(path)
        exprs += e
        recorded |= r
    for path in dashboards:
        exprs += dashboard_expressions(path)
    errors, used = [], set()
    for where, expr in exprs:
        for name in sorted(metric_names(expr)):
            if ":" in name:
                if name not in recorded:
                    errors.append(
                        f"{where}: recording rule {name} is not defined "
                        "by any rule file"
                    )
                continue
            family = resolve(name, contract)
            if family is None:
                hint = ""
                if contract.get(name) in ("histogram", "summary"):
                    hint = " (a histogram: use _bucket, _sum or _count)"
                errors.append(
                    f"{where}: {name} is not exported by kvdepotd"
                    f"{hint}; see tests/deploy/exported_metrics.txt"
                )
            else:
                used.add(family)
    if require_all_used:
        for family in sorted(set(contract) - used):
            errors.append(f"{family} is exported but no dashboard or rule queries it")
    return errors


def check_exposition(contract, text):
    """Checks a /metrics text against the contract. Returns violations."""
    exported = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[:2] == ["#", "TYPE"]:
            exported[parts[2]] = parts[3]
    errors = []
    for family, kind in sorted(contract.items()):
        if family not in exported:
            errors.append(f"{family} ({kind}) is missing from /metrics")
        elif exported[family] != kind:
            errors.append(
                f"{family} is a {exported[family]} in /metrics, "
                f"a {kind} in the contract"
            )
    for family in sorted(exported):
        if family.startswith("kvdepot_") and family not in contract:
            errors.append(
                f"{family} is exported but not in the contract "
                "(add it to tests/deploy/exported_metrics.txt)"
            )
    return errors


def main(argv):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--contract", default=os.path.join(HERE, "exported_metrics.txt")
    )
    parser.add_argument(
        "--dashboard",
        action="append",
        help="Grafana dashboard JSON (default: deploy/grafana/*.json)",
    )
    parser.add_argument(
        "--rules",
        action="append",
        help="Prometheus rule file (default: deploy/prometheus/*_rules.yml)",
    )
    parser.add_argument("--require-all-used", action="store_true")
    parser.add_argument("--metrics-url", help="check a live /metrics instead")
    parser.add_argument("--timeout", type=float, default=10)
    args = parser.parse_args(argv)

    try:
        contract = load_contract(args.contract)
        if args.metrics_url:
            with urllib.request.urlopen(args.metrics_url, timeout=args.timeout) as r:
                text = r.read().decode("utf-8")
            errors = check_exposition(contract, text)
        else:
            dashboards = args.dashboard
            if dashboards is None:
                dashboards = sorted(
                    glob.glob(os.path.join(REPO, "deploy/grafana/*.json"))
                )
            rules = args.rules
            if rules is None:
                rules = sorted(
                    glob.glob(os.path.join(REPO, "deploy/prometheus/*_rules.yml"))
                )
            if not dashboards and not rules:
                raise ValueError("no dashboards or rule files to check")
            errors = check_static(contract, dashboards, rules, args.require_all_used)
    except (OSError, ValueError, KeyError, yaml.YAMLError) as e:
        print(f"check_metric_names: {e}", file=sys.stderr)
        return 2
    for error in errors:
        print(error, file=sys.stderr)
    if errors:
        print(f"check_metric_names: {len(errors)} violation(s)", file=sys.stderr)
        return 1
    print(f"check_metric_names: OK ({len(contract)} families)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
