#!/usr/bin/env python3
"""Structure of deploy/grafana/kvdepot-dashboard.json: it imports into Grafana
10+ (schema 39) with any Prometheus data source, filters by instance and
namespace, and has the panels operators need. (PromQL syntax of its queries
is checked by promtool_test.py; metric names by check_metric_names.py.)"""

import json
import os
import re
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
DASHBOARD = os.path.join(REPO, "deploy/grafana/kvdepot-dashboard.json")

REQUIRED_PANELS = [
    "Hit ratio by tier",
    "Prefix hit ratio",
    "Hit ratio by namespace (top 10 by lookups)",
    "Throughput in / out",
    "Request rate by op and code",
    "Latency by op (p50 / p90 / p99)",
    "Tier used vs capacity",
    "Tier blocks",
    "Evictions by tier and reason",
    "Demotions and promotions",
    "Pins, sessions, reservations",
    "Integrity errors",
    "NVMe write bytes",
]
DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
GRAFANA_VARIABLES = {"__rate_interval", "__interval", "__range"}


def all_panels(panels):
    for panel in panels:
        yield panel
        yield from all_panels(panel.get("panels", []))


class DashboardTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        with open(DASHBOARD) as f:
            cls.dash = json.load(f)
        cls.panels = list(all_panels(cls.dash["panels"]))
        cls.variables = {v["name"]: v for v in cls.dash["templating"]["list"]}

    def test_identity(self):
        self.assertGreaterEqual(self.dash["schemaVersion"], 36)
        self.assertEqual(self.dash["uid"], "kvdepot-overview")
        self.assertNotIn("id", self.dash, "exported dashboards carry no database id")
        self.assertNotIn("__inputs", self.dash, "the data source is a variable")

    def test_variables(self):
        ds = self.variables["DS_PROMETHEUS"]
        self.assertEqual((ds["type"], ds["query"]), ("datasource", "prometheus"))
        for name in ("instance", "namespace"):
            var = self.variables[name]
            self.assertEqual(var["type"], "query")
            self.assertEqual(var["datasource"], DATASOURCE)
            self.assertTrue(var["multi"] and var["includeAll"])
            self.assertEqual(var["allValue"], ".*")
        self.assertIn("$instance", self.variables["namespace"]["query"]["query"])

    def test_required_panels_present(self):
        titles = [p["title"] for p in self.panels]
        for title in REQUIRED_PANELS:
            self.assertIn(title, titles)
        self.assertEqual(len(titles), len(set(titles)), "duplicate panel titles")

    def test_panel_ids_unique(self):
        ids = [p["id"] for p in self.panels]
        self.assertEqual(len(ids), len(set(ids)))

    def test_layout_fits_and_does_not_overlap(self):
        cells = {}
        for p in self.panels:
            g = p["gridPos"]
            self.assertGreaterEqual(g["x"], 0)
            self.assertLessEqual(g["x"] + g["w"], 24, p["title"])
            for x in range(g["x"], g["x"] + g["w"]):
                for y in range(g["y"], g["y"] + g["h"]):
                    self.assertNotIn(
                        (x, y), cells, f"{p['title']} overlaps {cells.get((x, y))}"
                    )
                    cells[(x, y)] = p["title"]

    def test_queries_use_the_variables(self):
        defined = set(self.variables) | GRAFANA_VARIABLES
        for p in self.panels:
            if p["type"] == "row":
                continue
            self.assertEqual(p["datasource"], DATASOURCE, p["title"])
            self.assertTrue(p["targets"], p["title"])
            ref_ids = [t["refId"] for t in p["targets"]]
            self.assertEqual(len(ref_ids), len(set(ref_ids)), p["title"])
            for t in p["targets"]:
                expr = t["expr"]
                self.assertEqual(t["datasource"], DATASOURCE, p["title"])
                self.assertIn('instance=~"$instance"', expr, p["title"])
                for var in re.findall(r"\$\{?(\w+)", expr):
                    self.assertIn(var, defined, f"{p['title']}: ${var}")
                self.assertEqual(expr.count("("), expr.count(")"), p["title"])
                self.assertEqual(expr.count("{"), expr.count("}"), p["title"])

    def test_lookup_panels_filter_by_namespace(self):
        for p in self.panels:
            for t in p.get("targets", []):
                if "kvdepot_lookup_" in t["expr"]:
                    self.assertIn('namespace=~"$namespace"', t["expr"], p["title"])

    def test_daemons_up_shows_the_lost_ones_in_red(self):
        # sum(up) green from 1 hid partial loss: 3 of 4 daemons looked fine.
        panel = next(p for p in self.panels if p["title"] == "Daemons up")
        exprs = {t["legendFormat"]: t["expr"] for t in panel["targets"]}
        self.assertIn("== 1", exprs["up"])
        self.assertIn("== 0", exprs["down"])
        for expr in exprs.values():
            self.assertIn("or vector(0)", expr)  # 0, not "no data"
        down = next(
            o for o in panel["fieldConfig"]["overrides"]
            if o["matcher"] == {"id": "byName", "options": "down"}
        )
        steps = down["properties"][0]["value"]["steps"]
        self.assertEqual(steps[0]["color"], "green")
        self.assertEqual((steps[1]["color"], steps[1]["value"]), ("red", 1))

    def test_units(self):
        units = {
            p["title"]: p["fieldConfig"]["defaults"].get("unit")
            for p in self.panels
            if p["type"] != "row"
        }
        self.assertEqual(units["Hit ratio by tier"], "percentunit")
        self.assertEqual(units["Throughput in / out"], "Bps")
        self.assertEqual(units["Latency by op (p50 / p90 / p99)"], "s")
        self.assertEqual(units["Tier used vs capacity"], "bytes")


if __name__ == "__main__":
    unittest.main()
