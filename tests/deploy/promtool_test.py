#!/usr/bin/env python3
"""deploy/prometheus through promtool: the config and rule files load, the rule
unit tests (rules_test.yml) pass, and every dashboard query parses as PromQL.
Plus, without promtool: every alert has a severity, its annotations and a
unit test.

  promtool_test.py [--promtool PATH] [unittest args]

Exits 77 (ctest's skip) after the checks that need no promtool when promtool
is not installed (Debian: apt-get install prometheus).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
PROM = os.path.join(REPO, "deploy/prometheus")
DASHBOARD = os.path.join(REPO, "deploy/grafana/kvdepot-dashboard.json")
PROMTOOL = None  # set by main()

# What Grafana substitutes before a query reaches Prometheus.
GRAFANA_SUBSTITUTIONS = {
    "$__rate_interval": "1m",
    "$__interval": "15s",
    "$__range": "6h",
    "$instance": ".*",
    "$namespace": ".*",
}


def load_yaml(name):
    with open(os.path.join(PROM, name)) as f:
        return yaml.safe_load(f)


def alerts():
    return [r for g in load_yaml("alert_rules.yml")["groups"] for r in g["rules"]]


class AlertRulesTest(unittest.TestCase):
    """Conventions every alert follows; no promtool needed."""

    def test_alerts_have_severity_and_annotations(self):
        names = [a["alert"] for a in alerts()]
        self.assertEqual(len(names), len(set(names)))
        for alert in alerts():
            self.assertIn(
                alert["labels"]["severity"],
                ("critical", "warning", "info"),
                alert["alert"],
            )
            for key in ("summary", "description", "runbook"):
                self.assertTrue(
                    alert["annotations"].get(key), f"{alert['alert']}: {key}"
                )

    def test_required_alerts_exist(self):
        names = {a["alert"] for a in alerts()}
        for name in (
            "KvdepotDown",
            "KvdepotTargetsMissing",
            "KvdepotRestarting",
            "KvdepotIntegrityErrors",
            "KvdepotEvictionStorm",
            "KvdepotHighLatencyP99",
            "KvdepotPinsLeaking",
            "KvdepotDemotionFailures",
            "KvdepotNvmeNotWritable",
            "KvdepotRequestErrors",
            "KvdepotDrainingTooLong",
        ):
            self.assertIn(name, names)

    def test_no_alert_on_tier_fullness(self):
        # A warm NVMe tier evicts only at 100% of nvme_capacity: an alert on
        # its fullness fires on every healthy node.
        for alert in alerts():
            self.assertNotIn("kvdepot_tier_used_bytes", alert["expr"], alert["alert"])

    def test_every_alert_has_a_firing_unit_test(self):
        tested = set()
        for test in load_yaml("rules_test.yml")["tests"]:
            for case in test.get("alert_rule_test", []):
                if case.get("exp_alerts"):
                    tested.add(case["alertname"])
        self.assertEqual({a["alert"] for a in alerts()} - tested, set())

    def test_down_alert_matches_the_scrape_job(self):
        jobs = [c["job_name"] for c in load_yaml("prometheus.yml")["scrape_configs"]]
        self.assertIn("kvdepot", jobs)
        for name in ("KvdepotDown", "KvdepotTargetsMissing"):
            alert = next(a for a in alerts() if a["alert"] == name)
            self.assertIn('job="kvdepot"', alert["expr"], name)

    def test_scrape_job_honors_the_namespace_label(self):
        # kvdepotd's namespace label (its cache namespace) must not become
        # exported_namespace when a target label of that name is added.
        job = next(
            c for c in load_yaml("prometheus.yml")["scrape_configs"]
            if c["job_name"] == "kvdepot"
        )
        self.assertIs(job.get("honor_labels"), True)


class PromtoolTest(unittest.TestCase):
    def setUp(self):
        if PROMTOOL is None:
            self.skipTest("promtool not found")

    def promtool(self, *args, cwd=PROM):
        return subprocess.run(
            [PROMTOOL, *args], cwd=cwd, capture_output=True, text=True
        )

    def assertPromtoolOk(self, *args):
        proc = self.promtool(*args)
        self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)

    def test_check_config(self):
        # Also loads the rule files prometheus.yml names.
        self.assertPromtoolOk("check", "config", "prometheus.yml")

    def test_check_rules(self):
        self.assertPromtoolOk(
            "check", "rules", "recording_rules.yml", "alert_rules.yml"
        )

    def test_rule_unit_tests(self):
        self.assertPromtoolOk("test", "rules", "rules_test.yml")

    def test_broken_rule_is_rejected(self):
        # Guards the harness: promtool's failures must reach us.
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "bad.yml")
            with open(path, "w") as f:
                f.write(
                    "groups:\n- name: g\n  rules:\n"
                    "  - record: kvdepot:bad\n    expr: sum(rate(x[5m])\n"
                )
            self.assertNotEqual(self.promtool("check", "rules", path).returncode, 0)

    def test_dashboard_queries_parse(self):
        with open(DASHBOARD) as f:
            dash = json.load(f)
        exprs = []

        def walk(node):
            if isinstance(node, dict):
                if isinstance(node.get("expr"), str):
                    exprs.append(node["expr"])
                for v in node.values():
                    walk(v)
            elif isinstance(node, list):
                for v in node:
                    walk(v)

        walk(dash["panels"])
        self.assertGreater(len(exprs), 10)
        rules = []
        for i, expr in enumerate(exprs):
            for var, value in GRAFANA_SUBSTITUTIONS.items():
                expr = expr.replace(var, value)
            self.assertNotIn("$", expr, "unknown Grafana variable")
            rules.append({"record": f"dashboard:query_{i}", "expr": expr})
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "dashboard_queries.yml")
            with open(path, "w") as f:
                yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}, f)
            proc = self.promtool("check", "rules", path)
            self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)


def main():
    global PROMTOOL
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--promtool")
    args, rest = parser.parse_known_args()
    candidate = args.promtool or shutil.which("promtool")
    if candidate and os.access(candidate, os.X_OK):
        PROMTOOL = candidate
    program = unittest.main(argv=[sys.argv[0], *rest], exit=False)
    if not program.result.wasSuccessful():
        return 1
    if PROMTOOL is None:
        print("SKIPPED: promtool not found (Debian: apt-get install prometheus)")
        return 77
    return 0


if __name__ == "__main__":
    sys.exit(main())
