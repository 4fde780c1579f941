#!/usr/bin/env python3
"""deploy/helm/kvdepot rendered by render_helm.py (helm itself is not needed):
every manifest parses, and the pieces agree with each other and with the
daemon: selectors and labels, ports, probes, the config kvdepotd reads, the
volume, hugepages and memory sizes, the ServiceMonitor's job label. Also
tests the renderer on the template features the chart relies on."""

import os
import re
import unittest

import yaml

import render_helm
from render_helm import ChartFailure, TemplateError, render_string
from systemd_unit_test import documented_stop_coverage

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
CHART = os.path.join(REPO, "deploy/helm/kvdepot")

_KVDEPOT_UNITS = {
    "B": 1,
    "KiB": 1 << 10,
    "MiB": 1 << 20,
    "GiB": 1 << 30,
    "TiB": 1 << 40,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
}
_K8S_UNITS = {
    "": 1,
    "Ki": 1 << 10,
    "Mi": 1 << 20,
    "Gi": 1 << 30,
    "Ti": 1 << 40,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
}


def kvdepot_size(text):
    m = re.fullmatch(r"(\d+)\s*([A-Za-z]*)", str(text))
    return int(m.group(1)) * _KVDEPOT_UNITS[m.group(2) or "B"]


def k8s_quantity(text):
    m = re.fullmatch(r"(\d+)([A-Za-z]*)", str(text))
    return int(m.group(1)) * _K8S_UNITS[m.group(2)]


def seconds(text):
    m = re.fullmatch(r"(\d+)(ms|s|m)", text)
    return int(m.group(1)) * {"ms": 0.001, "s": 1, "m": 60}[m.group(2)]


def render(values=None, release="kvdepot", namespace="kv"):
    """Returns ({kind: manifest}, notes text)."""
    out = render_helm.render_chart(CHART, values or {}, release, namespace)
    manifests = {}
    for name, text in out.items():
        if name.endswith(".txt"):
            continue
        docs = [d for d in yaml.safe_load_all(text) if d]
        for doc in docs:
            assert doc["kind"] not in manifests, f"two {doc['kind']}s"
            manifests[doc["kind"]] = doc
    return manifests, out["templates/NOTES.txt"]


VARIANT = {
    "serviceMonitor": {"enabled": True, "labels": {"release": "prom"}},
    "hugepages": {"enabled": True, "size": "4Gi"},
    "config": {"dram_capacity": "4GiB"},
    "podAntiAffinity": "hard",
    "persistence": {"enabled": False},
    "ports": {"grpc": 6000, "metrics": 7000},
    "imagePullSecrets": [{"name": "registry"}],
    "nodeSelector": {"kvdepot/nvme": "true"},
    "tolerations": [{"key": "dedicated", "value": "kvdepot", "effect": "NoSchedule"}],
    "podAnnotations": {"example.com/team": "inference"},
    "image": {"tag": "0.2.0"},
}


class ChartTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        with open(os.path.join(REPO, "deploy/kvdepot.yaml")) as f:
            cls.daemon_keys = set(yaml.safe_load(f))
        with open(os.path.join(REPO, "deploy/prometheus/alert_rules.yml")) as f:
            cls.alert_rules = f.read()
        cls.default, cls.default_notes = render()
        cls.variant, cls.variant_notes = render(VARIANT)

    def each(self):
        return (("default", self.default), ("variant", self.variant))

    def test_manifest_kinds(self):
        kinds = {"ConfigMap": "v1", "Service": "v1", "StatefulSet": "apps/v1"}
        self.assertEqual({k: m["apiVersion"] for k, m in self.default.items()}, kinds)
        kinds["ServiceMonitor"] = "monitoring.coreos.com/v1"
        self.assertEqual({k: m["apiVersion"] for k, m in self.variant.items()}, kinds)

    def test_names_and_labels(self):
        for label, m in self.each():
            selector = m["StatefulSet"]["spec"]["selector"]["matchLabels"]
            for kind, manifest in m.items():
                self.assertEqual(manifest["metadata"]["name"], "kvdepot", kind)
                labels = manifest["metadata"]["labels"]
                self.assertLessEqual(selector.items(), labels.items(), (label, kind))
                self.assertEqual(labels["app.kubernetes.io/version"], "0.1.0")

    def test_fullname(self):
        manifests, _ = render(release="cache")
        self.assertEqual(manifests["StatefulSet"]["metadata"]["name"], "cache-kvdepot")
        manifests, _ = render({"fullnameOverride": "kv"}, release="cache")
        self.assertEqual(manifests["Service"]["metadata"]["name"], "kv")

    def test_statefulset_selects_its_pods_and_uses_the_headless_service(self):
        for label, m in self.each():
            sts, svc = m["StatefulSet"], m["Service"]
            selector = sts["spec"]["selector"]["matchLabels"]
            pod_labels = sts["spec"]["template"]["metadata"]["labels"]
            self.assertLessEqual(selector.items(), pod_labels.items(), label)
            self.assertEqual(svc["spec"]["selector"], selector, label)
            self.assertEqual(svc["spec"]["clusterIP"], "None", label)
            self.assertEqual(sts["spec"]["serviceName"], svc["metadata"]["name"], label)

    def container(self, m):
        return m["StatefulSet"]["spec"]["template"]["spec"]["containers"][0]

    def config(self, m):
        return yaml.safe_load(m["ConfigMap"]["data"]["kvdepot.yaml"])

    def test_ports_agree_with_service_probes_and_config(self):
        for label, m in self.each():
            c = self.container(m)
            ports = {p["name"]: p["containerPort"] for p in c["ports"]}
            svc_ports = {p["name"]: p for p in m["Service"]["spec"]["ports"]}
            self.assertEqual(set(ports), {"grpc", "metrics"}, label)
            for name, port in ports.items():
                self.assertEqual(svc_ports[name]["targetPort"], name, label)
                self.assertEqual(svc_ports[name]["port"], port, label)
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                self.assertEqual(
                    c[probe]["grpc"]["port"], ports["grpc"], (label, probe)
                )
            config = self.config(m)
            self.assertEqual(config["listen"], f"0.0.0.0:{ports['grpc']}", label)
            self.assertEqual(
                config["metrics_listen"], f"0.0.0.0:{ports['metrics']}", label
            )
        self.assertEqual(
            self.container(self.variant)["ports"][0]["containerPort"], 6000
        )

    def test_config_has_exactly_the_daemon_keys(self):
        for label, m in self.each():
            # kvdepotd rejects unknown keys; the chart must not drop any either.
            self.assertEqual(set(self.config(m)), self.daemon_keys, label)
        with open(os.path.join(CHART, "values.yaml")) as f:
            values = yaml.safe_load(f)
        owned = {"listen", "metrics_listen", "data_dir", "hugepages"}
        self.assertEqual(set(values["config"]) & owned, set())

    def test_config_mounted_where_the_image_reads_it(self):
        for label, m in self.each():
            pod = m["StatefulSet"]["spec"]["template"]["spec"]
            mounts = {
                v["name"]: v["mountPath"] for v in self.container(m)["volumeMounts"]
            }
            volumes = {v["name"]: v for v in pod["volumes"]}
            self.assertEqual(
                volumes["config"]["configMap"]["name"],
                m["ConfigMap"]["metadata"]["name"],
                label,
            )
            self.assertEqual(mounts["config"], "/etc/kvdepot", label)
            self.assertEqual(mounts["data"], self.config(m)["data_dir"], label)
        with open(os.path.join(REPO, "deploy/container/Containerfile")) as f:
            self.assertIn('"--config", "/etc/kvdepot/kvdepot.yaml"', f.read())

    def test_config_checksum_follows_the_config(self):
        def checksum(m):
            return m["StatefulSet"]["spec"]["template"]["metadata"]["annotations"][
                "checksum/config"
            ]

        self.assertRegex(checksum(self.default), r"^[0-9a-f]{64}$")
        changed, _ = render({"config": {"log_level": "debug"}})
        self.assertNotEqual(checksum(changed), checksum(self.default))
        self.assertEqual(checksum(render({"replicas": 3})[0]), checksum(self.default))

    def test_nvme_volume(self):
        sts = self.default["StatefulSet"]
        claim = sts["spec"]["volumeClaimTemplates"][0]
        self.assertEqual(claim["metadata"]["name"], "data")
        self.assertEqual(claim["spec"]["accessModes"], ["ReadWriteOnce"])
        self.assertNotIn("storageClassName", claim["spec"])
        size = k8s_quantity(claim["spec"]["resources"]["requests"]["storage"])
        self.assertGreaterEqual(
            size, kvdepot_size(self.config(self.default)["nvme_capacity"])
        )
        classed, _ = render({"persistence": {"storageClassName": "local-nvme"}})
        self.assertEqual(
            classed["StatefulSet"]["spec"]["volumeClaimTemplates"][0]["spec"][
                "storageClassName"
            ],
            "local-nvme",
        )
        pod = self.variant["StatefulSet"]["spec"]["template"]["spec"]
        self.assertNotIn("volumeClaimTemplates", self.variant["StatefulSet"]["spec"])
        self.assertIn({"name": "data", "emptyDir": {}}, pod["volumes"])

    def test_memory_without_hugepages(self):
        resources = self.container(self.default)["resources"]
        self.assertNotIn("hugepages-2Mi", resources["limits"])
        self.assertEqual(self.config(self.default)["hugepages"], "off")
        config = self.config(self.default)
        # The DRAM tier is prefaulted: all of it is resident from the start.
        self.assertGreater(
            k8s_quantity(resources["limits"]["memory"]),
            kvdepot_size(config["dram_capacity"])
            + kvdepot_size(config["grpc_memory_limit"]),
        )

    def test_shared_memory_for_ucx(self):
        for label, m in self.each():
            pod = m["StatefulSet"]["spec"]["template"]["spec"]
            mounts = {v["name"]: v["mountPath"] for v in pod["containers"][0]["volumeMounts"]}
            self.assertEqual(mounts["dshm"], "/dev/shm", label)
            volume = next(v for v in pod["volumes"] if v["name"] == "dshm")
            self.assertEqual(volume["emptyDir"]["medium"], "Memory", label)
            # Above the runtimes' 64 MiB, below the memory limit's slack.
            self.assertGreater(k8s_quantity(volume["emptyDir"]["sizeLimit"]), 64 << 20)
            self.assertLessEqual(k8s_quantity(volume["emptyDir"]["sizeLimit"]), 1 << 30)

    def assert_refused(self, values, *words):
        with self.assertRaises(ChartFailure, msg=values) as caught:
            render(values)
        for word in words:
            self.assertIn(word, str(caught.exception), values)

    def test_memory_limit_must_hold_the_dram_tier(self):
        mem = lambda dram, limit, **config: {
            "config": {"dram_capacity": dram, **config},
            "resources": {"limits": {"memory": limit}},
        }
        # dram + grpc_memory_limit (1GiB) + 1Gi.
        render(mem("64GiB", "66Gi"))
        render(mem("64GiB", "72Gi"))
        render(mem("1.5GiB", "3.5Gi"))
        render(mem("1536MiB", "3584Mi"))
        render(mem("1gb", "3.15G"))  # 1e9 + 2^31 = 3.147e9
        render(mem("4GiB", "5Gi", grpc_memory_limit="0"))
        render(mem("4GiB", "6442450944"))
        self.assert_refused(mem("64GiB", "64Gi"), "resources.limits.memory 64Gi",
                            "dram_capacity 64GiB")
        self.assert_refused(mem("64GiB", "65.99Gi"), "65.99Gi")
        self.assert_refused(mem("1.5GiB", "3.49Gi"), "3.49Gi")
        self.assert_refused(mem("1gb", "3.14G"), "3.14G")
        self.assert_refused(mem("4GiB", "6Gi", grpc_memory_limit="2GiB"),
                            "grpc_memory_limit 2GiB")
        # Units: kvdepotd's K/M/G/T are powers of 1024, Kubernetes' of 1000.
        render(mem("1G", "3Gi"))
        self.assert_refused(mem("1G", "3G"), "3G")
        # No limit (or no limits at all): nothing to check against.
        render({"config": {"dram_capacity": "64GiB"}, "resources": {"limits": {"memory": None}}})
        render({"config": {"dram_capacity": "64GiB"}, "resources": {"limits": None}})
        # Plain numbers (float64 in Helm) are bytes, as kvdepotd and
        # Kubernetes read them.
        render(mem(1073741824, 6442450944))
        render(mem(1073741824, "3Gi", grpc_memory_limit=1073741824))
        self.assert_refused(mem(4294967296, 4294967296), "memory 4294967296",
                            "dram_capacity 4294967296")
        # kvdepotd's defaults where config does not say.
        self.assert_refused({"config": {"dram_capacity": None},
                             "resources": {"limits": {"memory": "2Gi"}}},
                            "dram_capacity 1GiB", "grpc_memory_limit 1GiB")
        # Past int64 the product wraps around in Helm (negative): refused.
        self.assert_refused(mem("64GiB", "10000Pi"), "10000Pi")

    def test_hugepages_must_hold_the_dram_tier(self):
        huge = lambda size, dram, limit="3Gi": {
            "hugepages": {"enabled": True, "size": size},
            "config": {"dram_capacity": dram},
            "resources": {"limits": {"memory": limit}},
        }
        render(huge("64Gi", "64GiB", "2Gi"))
        self.assert_refused(huge("63Gi", "64GiB"), "hugepages.size 63Gi")
        self.assert_refused(huge("64Gi", "64GiB", "1.9Gi"), "1.9Gi")
        # Without a memory limit the hugepages still must hold the tier.
        self.assert_refused(huge("2Gi", "64GiB", None), "hugepages.size 2Gi")

    def test_volume_must_hold_the_nvme_tier(self):
        # nvme_capacity x 1.25 (blob garbage before GC) + 256Mi (the room the
        # tier leaves free): a smaller volume fills and the tier stops.
        vol = lambda nvme, size, enabled=True: {
            "config": {"nvme_capacity": nvme},
            "persistence": {"enabled": enabled, "size": size},
        }
        self.assert_refused(
            {"config": {"nvme_capacity": "100GiB"}},
            "persistence.size 12Gi is less than config.nvme_capacity 100GiB x 1.25 + 256Mi",
        )
        render(vol("100GiB", "150Gi"))
        render(vol("8GiB", "10.25Gi"))
        self.assert_refused(vol("8GiB", "10.24Gi"), "persistence.size 10.24Gi")
        self.assert_refused(vol("8GiB", "8Gi"), "nvme_capacity 8GiB")
        render(vol("1TiB", "1.5Ti"))
        self.assert_refused(vol(1099511627776, "1Ti"), "nvme_capacity 1099511627776")
        # kvdepotd's default (8GiB) where config does not say.
        self.assert_refused({"config": {"nvme_capacity": None},
                             "persistence": {"size": "9Gi"}}, "nvme_capacity 8GiB")
        # No tier, or no volume (an emptyDir): nothing to check.
        render(vol("0", "1Gi"))
        render(vol(0, "1Gi"))
        render(vol("100GiB", "12Gi", enabled=False))
        # The defaults hold: values.yaml's size is its own 1.5x.
        with open(os.path.join(CHART, "values.yaml")) as f:
            values = yaml.safe_load(f)
        self.assertGreaterEqual(
            k8s_quantity(values["persistence"]["size"]),
            kvdepot_size(values["config"]["nvme_capacity"]) * 3 // 2,
        )

    def test_unreadable_sizes_are_refused(self):
        for dram in ("lots", "-1GiB", "01GiB", "1e9", "1.5.1GiB"):
            self.assert_refused({"config": {"dram_capacity": dram}}, "cannot read")
        self.assert_refused({"config": {"dram_capacity": "1.5 GiBs"}}, 'unit "gibs"')
        for limit in ("3GiB", "3 Gi", "3gi", "0x10"):
            self.assert_refused(
                {"resources": {"limits": {"memory": limit}}}, "cannot read", limit
            )

    def test_keys_the_chart_sets_cannot_be_in_config(self):
        for key in ("listen", "metrics_listen", "data_dir", "hugepages"):
            self.assert_refused({"config": {key: "x"}}, f"config.{key}", "set by the chart")

    def test_hugepages(self):
        resources = self.container(self.variant)["resources"]
        requested = resources["requests"]["hugepages-2Mi"]
        self.assertEqual(resources["limits"]["hugepages-2Mi"], requested)
        self.assertGreaterEqual(
            k8s_quantity(requested),
            kvdepot_size(self.config(self.variant)["dram_capacity"]),
        )
        self.assertEqual(self.config(self.variant)["hugepages"], "on")
        self.assertIn("memory", resources["requests"])

    def test_pod_security(self):
        for label, m in self.each():
            pod = m["StatefulSet"]["spec"]["template"]["spec"]
            self.assertTrue(pod["securityContext"]["runAsNonRoot"], label)
            self.assertNotEqual(pod["securityContext"]["runAsUser"], 0, label)
            sc = self.container(m)["securityContext"]
            self.assertFalse(sc["allowPrivilegeEscalation"], label)
            self.assertTrue(sc["readOnlyRootFilesystem"], label)
            self.assertEqual(sc["capabilities"], {"drop": ["ALL"], "add": ["IPC_LOCK"]})

    def test_grace_period_covers_drain_and_persist(self):
        pod = self.default["StatefulSet"]["spec"]["template"]["spec"]
        drain = seconds(self.config(self.default)["drain_timeout"])
        self.assertGreaterEqual(pod["terminationGracePeriodSeconds"], drain + 60)
        # values.yaml's comment: the tier the default covers is what its
        # formula (drain_timeout + 60 + dram_capacity / rate) gives.
        with open(os.path.join(CHART, "values.yaml")) as f:
            text = f.read()
        said, gib, rate = documented_stop_coverage(text)
        self.assertEqual(said, pod["terminationGracePeriodSeconds"])
        self.assertAlmostEqual(gib, (said - drain - 60) * rate, delta=0.5)

    def test_anti_affinity(self):
        def affinity(m):
            return m["StatefulSet"]["spec"]["template"]["spec"].get("affinity")

        selector = self.default["StatefulSet"]["spec"]["selector"]["matchLabels"]
        soft = affinity(self.default)["podAntiAffinity"][
            "preferredDuringSchedulingIgnoredDuringExecution"
        ][0]["podAffinityTerm"]
        self.assertEqual(soft["labelSelector"]["matchLabels"], selector)
        hard = affinity(self.variant)["podAntiAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"
        ][0]
        self.assertEqual(hard["labelSelector"]["matchLabels"], selector)
        self.assertEqual(hard["topologyKey"], "kubernetes.io/hostname")
        self.assertIsNone(affinity(render({"podAntiAffinity": ""})[0]))

    def test_optional_pod_fields(self):
        pod = self.variant["StatefulSet"]["spec"]["template"]["spec"]
        self.assertEqual(pod["imagePullSecrets"], [{"name": "registry"}])
        self.assertEqual(pod["nodeSelector"], {"kvdepot/nvme": "true"})
        self.assertEqual(pod["tolerations"][0]["effect"], "NoSchedule")
        annotations = self.variant["StatefulSet"]["spec"]["template"]["metadata"][
            "annotations"
        ]
        self.assertEqual(annotations["example.com/team"], "inference")
        self.assertEqual(self.container(self.variant)["image"], "kvdepot:0.2.0")
        self.assertEqual(self.container(self.default)["image"], "kvdepot:0.1.0")
        default_pod = self.default["StatefulSet"]["spec"]["template"]["spec"]
        for key in ("imagePullSecrets", "nodeSelector", "tolerations"):
            self.assertNotIn(key, default_pod)

    def test_service_monitor_scrapes_the_metrics_port_as_job_kvdepot(self):
        sm, svc = self.variant["ServiceMonitor"], self.variant["Service"]
        self.assertEqual(sm["metadata"]["labels"]["release"], "prom")
        self.assertLessEqual(
            sm["spec"]["selector"]["matchLabels"].items(),
            svc["metadata"]["labels"].items(),
        )
        self.assertEqual(sm["spec"]["namespaceSelector"]["matchNames"], ["kv"])
        endpoint = sm["spec"]["endpoints"][0]
        self.assertIn(endpoint["port"], [p["name"] for p in svc["spec"]["ports"]])
        self.assertEqual(endpoint["path"], "/metrics")
        # The operator adds a namespace target label (the Kubernetes one);
        # kvdepotd's own namespace label (the cache namespace) must win, or
        # it arrives as exported_namespace and the per-namespace rules and
        # the dashboard see nothing.
        self.assertIs(endpoint.get("honorLabels"), True)
        job = svc["metadata"]["labels"][sm["spec"]["jobLabel"]]
        self.assertIn(f'job="{job}"', self.alert_rules)
        # The job stays "kvdepot" whatever the chart's names are.
        renamed, _ = render(
            {**VARIANT, "nameOverride": "kvcache", "fullnameOverride": "cache"}
        )
        sm, svc = renamed["ServiceMonitor"], renamed["Service"]
        self.assertEqual(svc["metadata"]["labels"]["app.kubernetes.io/name"], "kvcache")
        self.assertEqual(svc["metadata"]["labels"][sm["spec"]["jobLabel"]], "kvdepot")

    def test_notes(self):
        self.assertIn("kvdepot-N.kvdepot.kv.svc:50551", self.default_notes)
        self.assertIn("serviceMonitor.enabled=true", self.default_notes)
        self.assertIn("--server 127.0.0.1:6000", self.variant_notes)
        self.assertIn('job="kvdepot"', self.variant_notes)


class RendererTest(unittest.TestCase):
    CONTEXT = {
        "Values": {
            "a": {
                "b": "x",
                "n": 3,
                "f": 0.9,
                "big": 1048576,
                "t": True,
                "empty": "",
                "list": [1, 2],
                "map": {"k2": "v2", "k1": "v1"},
            }
        },
        "Release": {"Name": "r"},
    }

    def r(self, template, **defines):
        templates = {"t": template}
        for name, body in defines.items():
            templates[name] = body
        return render_string(templates, self.CONTEXT, "t")

    def test_fields_and_trimming(self):
        self.assertEqual(
            self.r("a: {{ .Values.a.b }}\n  {{- .Values.a.n -}}  \n!"), "a: x3!"
        )
        self.assertEqual(
            self.r("{{ .Values.a.f }} {{ .Values.a.t }} {{ .Values.a.nope }}."),
            "0.9 true .",
        )
        self.assertEqual(self.r("{{/* note */}}x{{- /* trimmed */ -}} y"), "xy")

    def test_control_flow(self):
        t = (
            '{{ if eq .Values.a.b "y" }}1{{ else if .Values.a.t }}2{{ else }}3{{ end }}'
            "{{ with .Values.a.map }}{{ .k1 }}{{ end }}"
            "{{ with .Values.a.empty }}no{{ else }}-{{ end }}"
            "{{ range .Values.a.list }}[{{ . }}]{{ end }}"
            "{{ range .Values.a.map }}{{ . }}{{ $.Release.Name }}{{ end }}"
        )
        self.assertEqual(self.r(t), "2v1-[1][2]v1rv2r")

    def test_functions(self):
        self.assertEqual(self.r('{{ .Values.a.empty | default "d" | quote }}'), '"d"')
        self.assertEqual(self.r('{{ .Values.a.b | default "d" }}'), "x")
        self.assertEqual(
            self.r("k:{{ toYaml .Values.a.map | nindent 2 }}"), "k:\n  k1: v1\n  k2: v2"
        )
        self.assertEqual(self.r("{{ toYaml .Values.a.list | indent 1 }}"), " - 1\n - 2")
        self.assertEqual(
            self.r('{{ printf "%s-%v" .Release.Name .Values.a.n }}'), "r-3"
        )
        self.assertEqual(self.r('{{ "abcdef-" | trunc 7 | trimSuffix "-" }}'), "abcdef")
        self.assertEqual(
            self.r("{{ if and .Values.a.t (not .Values.a.empty) }}y{{ end }}"), "y"
        )
        self.assertEqual(
            self.r(
                '{{ include "h" . | quote }}',
                h='{{ define "h" }}{{ .Release.Name }}-h{{ end }}',
            ),
            '"r-h"',
        )
        self.assertEqual(self.r("{{ toYaml .Values.a.big }}"), "1048576")

    def test_sprig_functions(self):
        self.assertEqual(self.r('{{ if hasKey .Values.a "b" }}y{{ end }}'), "y")
        self.assertEqual(self.r('{{ if hasKey .Values.a "z" }}y{{ end }}'), "")
        self.assertEqual(self.r('{{ lower "AbC" }} {{ toString .Values.a.n }}'), "abc 3")
        self.assertEqual(self.r('{{ trimPrefix "ab" "abcab" }}'), "cab")
        self.assertEqual(self.r('{{ regexFind "[0-9]+" "ab12c3" }}|'), "12|")
        self.assertEqual(self.r('{{ regexFind "[0-9]+" "abc" }}|'), "|")
        self.assertEqual(self.r('{{ if regexMatch "^a" "ab" }}y{{ end }}'), "y")
        # int64 arithmetic prints in full (values, float64 in Helm, do not).
        self.assertEqual(self.r('{{ mul "1048576" 1024 }}'), "1073741824")
        self.assertEqual(self.r('{{ add 1 "2" 3 }} {{ sub 10 "4" }} {{ div 7 2 }}'), "6 6 3")
        # Sprig's toInt64: a leading 0 is octal, what it cannot read is 0.
        self.assertEqual(self.r('{{ int64 "010" }} {{ int64 "x" }} {{ int64 "0x10" }}'),
                         "8 0 16")
        self.assertEqual(self.r('{{ if lt (int64 "2") (add 1 2) }}y{{ end }}'), "y")
        # int64 wraps; a string past its range reads as 0.
        self.assertEqual(self.r('{{ mul 4611686018427387904 2 }}'), "-9223372036854775808")
        self.assertEqual(self.r('{{ int64 "99999999999999999999" }}'), "0")
        self.assertEqual(
            self.r('{{ kindIs "float64" .Values.a.n }} {{ kindIs "int64" (int64 .Values.a.n) }}'
                   ' {{ kindIs "string" .Values.a.b }} {{ kindIs "float64" .Values.a.b }}'),
            "true true true false")
        with self.assertRaises(ChartFailure) as caught:
            self.r('{{ fail (printf "no %s" "way") }}')
        self.assertEqual(str(caught.exception), "no way")

    def test_errors(self):
        for template in (
            "{{ .Values.a.nope.deeper }}",  # nil pointer
            "{{ .Values.a.big }}",  # helm prints 1.048576e+06
            "{{ .Values.a.map }}",  # printing a map
            "{{ upper .Values.a.b }}",  # outside the subset
            "{{ if lt 1 0.5 }}{{ end }}",  # int against float64
            "{{ $x := 1 }}",  # variables
            "{{ if .Values.a.t }}open",  # missing end
            "{{ end }}",  # stray end
            '{{ include "missing" . }}',
        ):
            with self.assertRaises(TemplateError, msg=template):
                self.r(template)


if __name__ == "__main__":
    unittest.main()
