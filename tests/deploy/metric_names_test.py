#!/usr/bin/env python3
"""Tests check_metric_names.py: the repository's dashboard and rules pass, and
the checker catches what it exists to catch (its fixtures must fail)."""

import os
import subprocess
import sys
import tempfile
import unittest

import check_metric_names as cmn

HERE = os.path.dirname(os.path.abspath(__file__))
TESTDATA = os.path.join(HERE, "testdata")
CONTRACT = os.path.join(HERE, "exported_metrics.txt")


class MetricNamesTest(unittest.TestCase):
    def setUp(self):
        self.contract = cmn.load_contract(CONTRACT)

    def test_contract_lists_the_daemon_families(self):
        self.assertEqual(len(self.contract), 32)
        self.assertEqual(self.contract["kvdepot_request_duration_seconds"], "histogram")
        self.assertEqual(self.contract["kvdepot_pins_active"], "gauge")
        self.assertEqual(self.contract["kvdepot_draining"], "gauge")
        self.assertEqual(self.contract["kvdepot_start_time_seconds"], "gauge")

    def test_repository_dashboard_and_rules_pass(self):
        proc = subprocess.run(
            [
                sys.executable,
                os.path.join(HERE, "check_metric_names.py"),
                "--require-all-used",
            ],
            capture_output=True,
            text=True,
        )
        self.assertEqual(proc.returncode, 0, proc.stderr)

    def test_bad_fixtures_fail_with_each_violation(self):
        proc = subprocess.run(
            [
                sys.executable,
                os.path.join(HERE, "check_metric_names.py"),
                "--dashboard",
                os.path.join(TESTDATA, "bad_dashboard.json"),
                "--rules",
                os.path.join(TESTDATA, "bad_rules.yml"),
            ],
            capture_output=True,
            text=True,
        )
        self.assertEqual(proc.returncode, 1, proc.stderr)
        for name in (
            "kvdepot_lookup_hits_total",
            "kvdepot_up",
            "kvdepot_request_duration_seconds ",
            "kvdepot_requests_total_bucket",
            "kvdepot_nvme_used_bytes",
            "kvdepot:hit_ratio:rate1h",
        ):
            self.assertIn(name, proc.stderr)
        self.assertIn("6 violation(s)", proc.stderr)

    def test_names_inside_strings_and_matchers_are_not_metrics(self):
        self.assertEqual(
            cmn.metric_names(
                'sum by (tier) (rate(kvdepot_bytes_total{job="kvdepot_x", '
                'tier=~"kvdepot_y"}[$__rate_interval]))'
            ),
            {"kvdepot_bytes_total"},
        )
        self.assertEqual(
            cmn.metric_names("kvdepot:hit_ratio:rate5m > 0.5"),
            {"kvdepot:hit_ratio:rate5m"},
        )

    def test_histogram_series_resolve_to_their_family(self):
        family = "kvdepot_request_duration_seconds"
        for suffix in ("_bucket", "_sum", "_count"):
            self.assertEqual(cmn.resolve(family + suffix, self.contract), family)
        self.assertIsNone(cmn.resolve(family, self.contract))
        self.assertIsNone(cmn.resolve("kvdepot_pins_active_count", self.contract))

    def test_unused_family_fails_when_all_must_be_used(self):
        with tempfile.NamedTemporaryFile("w", suffix=".yml") as rules:
            rules.write(
                "groups:\n- name: g\n  rules:\n"
                "  - record: kvdepot:pins:max\n"
                "    expr: max(kvdepot_pins_active)\n"
            )
            rules.flush()
            errors = cmn.check_static(self.contract, [], [rules.name], True)
        self.assertEqual(len(errors), len(self.contract) - 1)
        self.assertFalse(any("kvdepot_pins_active " in e for e in errors))

    def test_exposition_with_the_contract_passes(self):
        proc = subprocess.run(
            [
                sys.executable,
                os.path.join(HERE, "check_metric_names.py"),
                "--metrics-url",
                "file://" + os.path.join(TESTDATA, "metrics_ok.txt"),
            ],
            capture_output=True,
            text=True,
        )
        self.assertEqual(proc.returncode, 0, proc.stderr)

    def test_exposition_missing_extra_or_mistyped_family_fails(self):
        with open(os.path.join(TESTDATA, "metrics_ok.txt")) as f:
            text = f.read()
        text = text.replace("# TYPE kvdepot_promotions_total counter\n", "")
        text = text.replace(
            "# TYPE kvdepot_pins_active gauge", "# TYPE kvdepot_pins_active counter"
        )
        text += "# TYPE kvdepot_surprise_total counter\nkvdepot_surprise_total 1\n"
        errors = cmn.check_exposition(self.contract, text)
        self.assertEqual(len(errors), 3, errors)
        self.assertIn("kvdepot_promotions_total (counter) is missing", errors[1])
        self.assertIn("kvdepot_pins_active is a counter", errors[0])
        self.assertIn(
            "kvdepot_surprise_total is exported but not in the contract", errors[2]
        )

    def test_unreadable_input_exits_2(self):
        proc = subprocess.run(
            [
                sys.executable,
                os.path.join(HERE, "check_metric_names.py"),
                "--contract",
                os.path.join(TESTDATA, "no-such-file"),
            ],
            capture_output=True,
            text=True,
        )
        self.assertEqual(proc.returncode, 2)


if __name__ == "__main__":
    unittest.main()
