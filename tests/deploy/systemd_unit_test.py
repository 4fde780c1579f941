#!/usr/bin/env python3
"""deploy/systemd: the unit has the directives kvdepotd needs (and none it
cannot honour), its packaged kvdepot.yaml is the defaults with data_dir in
the StateDirectory, and, where systemd-analyze exists, systemd accepts the
unit without a warning."""

import os
import re
import shutil
import subprocess
import tempfile
import unittest

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
SYSTEMD = os.path.join(REPO, "deploy/systemd")
UNIT = os.path.join(SYSTEMD, "kvdepotd.service")


def parse_unit(path):
    """Returns {section: {key: [values]}}; continuation lines are joined."""
    sections, section, pending = {}, None, ""
    with open(path) as f:
        for raw in f:
            line = pending + raw.rstrip("\n")
            pending = ""
            if line.endswith("\\"):
                pending = line[:-1] + " "
                continue
            line = line.strip()
            if not line or line[0] in "#;":
                continue
            m = re.fullmatch(r"\[(\w+)\]", line)
            if m:
                section = sections.setdefault(m.group(1), {})
                continue
            key, sep, value = line.partition("=")
            if not sep or section is None:
                raise ValueError(f"{path}: cannot parse {line!r}")
            section.setdefault(key.strip(), []).append(value.strip())
    return sections


def seconds(value):
    """A systemd time span (120, 2min, 90s, 1min 30s) in seconds."""
    units = {"": 1, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600}
    total = 0
    for number, unit in re.findall(r"(\d+)\s*([a-z]*)", value):
        total += int(number) * units[unit]
    return total


def documented_stop_coverage(text):
    """From prose (comment markers and line breaks ignored) saying "N [s]
    covers [the drain and] about G GiB at the slower rate" and giving persist
    rates as "R GiB/s": (N, G, the slowest R)."""
    prose = " ".join(re.sub(r"^\s*#\s?", "", l) for l in text.splitlines())
    prose = re.sub(r"\s+", " ", prose)
    m = re.search(
        r"(\d+)(?: s)? covers (?:the drain and )?about (\d+(?:\.\d+)?) GiB "
        r"at the slower rate",
        prose,
    )
    assert m, "no 'N s covers the drain and about G GiB at the slower rate'"
    rates = [float(r) for r in re.findall(r"(\d+(?:\.\d+)?) GiB/s", prose)]
    assert rates, "no persist rate (GiB/s)"
    return int(m.group(1)), float(m.group(2)), min(rates)


def yes(value):
    return value in ("yes", "true", "on", "1")


class SystemdUnitTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.unit = parse_unit(UNIT)
        cls.service = {k: v[-1] for k, v in cls.unit["Service"].items()}
        with open(os.path.join(SYSTEMD, "kvdepot.yaml")) as f:
            cls.config = yaml.safe_load(f)

    def test_runs_kvdepotd_with_the_packaged_config(self):
        s = self.service
        self.assertEqual(s["Type"], "simple", "kvdepotd does not call sd_notify")
        self.assertEqual(
            s["ExecStart"], "/usr/bin/kvdepotd --config /etc/kvdepot/kvdepot.yaml"
        )
        self.assertEqual((s["User"], s["Group"]), ("kvdepot", "kvdepot"))
        self.assertEqual(s["Restart"], "on-failure")
        self.assertIn("multi-user.target", self.unit["Install"]["WantedBy"])

    def test_data_dir_is_the_writable_state_directory(self):
        data_dir = self.config["data_dir"]
        self.assertEqual(data_dir, "/var/lib/" + self.service["StateDirectory"])
        self.assertIn(data_dir, self.service["ReadWritePaths"].split())

    def test_hardening(self):
        s = self.service
        self.assertEqual(s["ProtectSystem"], "strict")
        for key in (
            "ProtectHome",
            "PrivateTmp",
            "NoNewPrivileges",
            "ProtectKernelTunables",
            "ProtectKernelModules",
            "LockPersonality",
        ):
            self.assertTrue(yes(s.get(key, "")), key)
        # UCX installs its mmap hooks by making code pages writable and
        # executable (mprotect W+X) when it loads; MemoryDenyWriteExecute
        # makes that fail, and with it the UCX data plane: every client
        # would fall back to gRPC without an error.
        self.assertNotIn("MemoryDenyWriteExecute", s)
        self.assertEqual(
            set(s["RestrictAddressFamilies"].split()),
            {"AF_INET", "AF_INET6", "AF_UNIX", "AF_NETLINK"},
        )

    def test_devices_stay_visible(self):
        # UCX needs /dev/infiniband (RDMA) and /dev/nvidia* (GPU memory).
        # ProtectClock=yes on systemd 245-251 adds DeviceAllow=char-rtc,
        # which makes the device policy an allow-list of the clock only.
        for key in ("ProtectClock", "PrivateDevices", "DeviceAllow", "DevicePolicy"):
            self.assertNotIn(key, self.service, key)
        # The clock is protected anyway: no capabilities, no way to gain any.
        self.assertEqual(self.service["CapabilityBoundingSet"], "")
        self.assertTrue(yes(self.service["NoNewPrivileges"]))

    def test_limits(self):
        self.assertEqual(self.service["LimitMEMLOCK"], "infinity")
        self.assertGreaterEqual(int(self.service["LimitNOFILE"]), 1 << 20)

    def test_stop_leaves_time_to_drain_and_persist(self):
        s = self.service
        self.assertEqual(s["KillSignal"], "SIGTERM")
        drain = seconds(self.config["drain_timeout"])
        self.assertGreaterEqual(seconds(s["TimeoutStopSec"]), drain + 60)

    def test_documented_stop_coverage_follows_the_formula(self):
        # The budget the unit and deploy/README.md give is drain_timeout +
        # 60 s + dram_capacity / rate; the DRAM tier they say TimeoutStopSec
        # covers must be what that formula gives. (It said 25 GiB for 120 s
        # at 0.25 GiB/s, which needs 168 s.)
        stop = seconds(self.service["TimeoutStopSec"])
        drain = seconds(self.config["drain_timeout"])
        for path in (UNIT, os.path.join(REPO, "deploy/README.md")):
            with open(path) as f:
                said, gib, rate = documented_stop_coverage(f.read())
            self.assertEqual(said, stop, path)
            self.assertAlmostEqual(gib, (stop - drain - 60) * rate, delta=0.5,
                                   msg=path)

    def test_reload_only_if_the_daemon_handles_sighup(self):
        with open(os.path.join(REPO, "server/main.cc")) as f:
            handles_hup = "SIGHUP" in f.read()
        if not handles_hup:
            self.assertNotIn(
                "ExecReload",
                self.service,
                "SIGHUP terminates kvdepotd (server/main.cc)",
            )
        else:
            self.assertIn("-HUP", self.service.get("ExecReload", ""))

    def test_packaged_config_is_the_defaults_but_data_dir(self):
        with open(os.path.join(REPO, "deploy/kvdepot.yaml")) as f:
            defaults = yaml.safe_load(f)
        self.assertEqual(set(self.config), set(defaults))
        for key, value in defaults.items():
            if key != "data_dir":
                self.assertEqual(self.config[key], value, key)

    def test_sysusers_creates_the_user(self):
        with open(os.path.join(SYSTEMD, "kvdepot.sysusers")) as f:
            entries = [l.split() for l in f if l.strip() and not l.startswith("#")]
        self.assertEqual(entries[0][:3], ["u", "kvdepot", "-"])
        self.assertIn(self.config["data_dir"], entries[0])

    def test_systemd_sysusers_accepts_the_file(self):
        sysusers = shutil.which("systemd-sysusers")
        if sysusers is None:
            self.skipTest("systemd-sysusers not installed")
        with tempfile.TemporaryDirectory() as root:
            os.mkdir(os.path.join(root, "etc"))
            proc = subprocess.run(
                [
                    sysusers,
                    f"--root={root}",
                    "--dry-run",
                    os.path.join(SYSTEMD, "kvdepot.sysusers"),
                ],
                capture_output=True,
                text=True,
            )
        self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
        self.assertIn("Creating user 'kvdepot'", proc.stdout + proc.stderr)

    def test_systemd_analyze_verify(self):
        analyze = shutil.which("systemd-analyze")
        if analyze is None:
            self.skipTest(
                "systemd-analyze not installed: directives checked above only"
            )
        with open(UNIT) as f:
            text = f.read()
        if not os.access("/usr/bin/kvdepotd", os.X_OK):
            # verify insists that ExecStart's binary exists.
            text = text.replace("ExecStart=/usr/bin/kvdepotd", "ExecStart=/bin/true")
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "kvdepotd.service")
            with open(path, "w") as f:
                f.write(text)
            proc = subprocess.run(
                [analyze, "verify", "--man=no", path], capture_output=True, text=True
            )
        complaints = [l for l in (proc.stdout + proc.stderr).splitlines() if path in l]
        self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
        self.assertEqual(complaints, [])


if __name__ == "__main__":
    unittest.main()
