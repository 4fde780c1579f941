#!/usr/bin/env python3
"""deploy/container without a container engine: the Containerfile builds the
right targets with the repository's scripts, its runtime stage installs
Debian 12 packages that exist and that provide every shared library the built
kvdepotd and kvdepotctl load (when a build exists here), and its ports,
volume, health check and entrypoint agree with the container's kvdepot.yaml.

The build checked is $KVDEPOT_BUILD_DIR, else ./build of the repository."""

import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import unittest

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
CONTAINER = os.path.join(REPO, "deploy/container")
BUILD = os.environ.get("KVDEPOT_BUILD_DIR") or os.path.join(REPO, "build")
BINARIES = ("server/kvdepotd", "client/kvdepotctl")


def parse_containerfile(path):
    """Returns the stages: [[(INSTRUCTION, argument)]]."""
    stages, logical = [], ""
    with open(path) as f:
        lines = f.read().splitlines()
    for line in lines:
        if line.lstrip().startswith("#"):
            continue
        logical += line
        if logical.endswith("\\"):
            logical = logical[:-1] + " "
            continue
        if logical.strip():
            word, _, arg = logical.strip().partition(" ")
            if word.upper() == "FROM":
                stages.append([])
            stages[-1].append((word.upper(), " ".join(arg.split())))
        logical = ""
    return stages


def args_of(stage, instruction):
    return [arg for word, arg in stage if word == instruction]


def apt_packages(stage):
    """Packages that the stage's apt-get install commands name."""
    packages = []
    for run in args_of(stage, "RUN"):
        for command in run.split("&&"):
            words = shlex.split(command)
            if "apt-get" in words and "install" in words:
                rest = words[words.index("install") + 1 :]
                packages += [w for w in rest if not w.startswith("-")]
    return packages


def is_debian_12():
    try:
        with open("/etc/os-release") as f:
            info = dict(l.strip().split("=", 1) for l in f if "=" in l)
    except OSError:
        return False
    return info.get("ID") == "debian" and info.get("VERSION_ID", "").strip('"') == "12"


def owning_packages(libraries):
    """{library: Debian package owning it, or None}, usrmerge-aware."""
    candidates = {}
    for library in libraries:
        paths = []
        for p in (library, os.path.realpath(library)):
            paths += [p, p[4:] if p.startswith("/usr/") else "/usr" + p]
        candidates[library] = paths
    everything = sorted({p for paths in candidates.values() for p in paths})
    # One dpkg call; paths no package owns only add "no path found" errors.
    out = subprocess.run(
        ["dpkg", "-S", *everything], capture_output=True, text=True
    ).stdout
    owner = {}
    for line in out.splitlines():
        packages, sep, path = line.partition(": ")
        if sep:
            owner[path.strip()] = packages.split(",")[0].split(":")[0].strip()
    return {
        library: next((owner[p] for p in paths if p in owner), None)
        for library, paths in candidates.items()
    }


class ContainerfileTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.stages = parse_containerfile(os.path.join(CONTAINER, "Containerfile"))
        cls.build, cls.runtime = cls.stages[0], cls.stages[-1]
        with open(os.path.join(CONTAINER, "kvdepot.yaml")) as f:
            cls.config = yaml.safe_load(f)

    def test_two_debian_12_stages(self):
        self.assertEqual(len(self.stages), 2)
        self.assertEqual(self.build[0], ("FROM", "debian:12 AS build"))
        self.assertEqual(self.runtime[0], ("FROM", "debian:12"))

    def test_build_stage_uses_the_repository_scripts_and_targets(self):
        runs = " ".join(args_of(self.build, "RUN"))
        self.assertIn("./scripts/deps.sh", runs)
        self.assertTrue(os.access(os.path.join(REPO, "scripts/deps.sh"), os.X_OK))
        self.assertRegex(runs, r"cmake -S \. -B /build -G Ninja")
        self.assertRegex(runs, r"ninja -C /build kvdepotd kvdepotctl")

    def test_copied_binaries_are_the_targets_cmake_builds(self):
        copies = [
            a for a in args_of(self.runtime, "COPY") if a.startswith("--from=build")
        ]
        sources = " ".join(copies).split()
        for binary in BINARIES:
            self.assertIn(f"/build/{binary}", sources)
            folder, target = binary.split("/")
            with open(os.path.join(REPO, folder, "CMakeLists.txt")) as f:
                self.assertRegex(f.read(), rf"kvdepot_cc_binary\(NAME {target}\b")
        self.assertTrue(any(c.endswith(" /usr/bin/") for c in copies))

    def test_context_sources_exist_and_are_not_ignored(self):
        with open(os.path.join(CONTAINER, "Containerfile.dockerignore")) as f:
            patterns = [l.strip() for l in f if l.strip() and not l.startswith("#")]

        def ignored(rel):
            return any(
                fnmatch.fnmatch(rel + "/", p)
                or fnmatch.fnmatch(rel, p)
                or fnmatch.fnmatch(rel, p.rstrip("/") + "/*")
                for p in patterns
            )

        for stage in self.stages:
            for arg in args_of(stage, "COPY"):
                if arg.startswith("--from="):
                    continue
                for source in arg.split()[:-1]:
                    if source != ".":
                        self.assertTrue(
                            os.path.exists(os.path.join(REPO, source)), source
                        )
                        self.assertFalse(ignored(source), source)
        self.assertTrue(ignored("build"), "the 400 MB build dir must stay out")
        self.assertFalse(ignored(".git"), "CMake stamps the commit from .git")

    def test_runs_as_non_root(self):
        users = args_of(self.runtime, "USER")
        self.assertTrue(users)
        self.assertNotIn(users[-1].split(":")[0], ("root", "0"))

    def test_ports_volume_healthcheck_and_entrypoint_match_the_config(self):
        grpc_host, grpc_port = self.config["listen"].rsplit(":", 1)
        metrics_host, metrics_port = self.config["metrics_listen"].rsplit(":", 1)
        self.assertEqual((grpc_host, metrics_host), ("0.0.0.0", "0.0.0.0"))
        exposed = " ".join(args_of(self.runtime, "EXPOSE")).split()
        self.assertEqual(sorted(exposed), sorted([grpc_port, metrics_port]))
        self.assertEqual(args_of(self.runtime, "VOLUME"), [self.config["data_dir"]])

        health = args_of(self.runtime, "HEALTHCHECK")[0]
        command = json.loads(health.split(" CMD ", 1)[1])
        self.assertEqual(os.path.basename(command[0]), "kvdepotctl")
        self.assertEqual(command[-1], "health")
        self.assertEqual(
            command[command.index("--server") + 1], f"127.0.0.1:{grpc_port}"
        )

        entrypoint = json.loads(args_of(self.runtime, "ENTRYPOINT")[-1])
        self.assertEqual(entrypoint[:2], ["/usr/bin/kvdepotd", "--config"])
        self.assertIn(
            f"deploy/container/kvdepot.yaml {entrypoint[2]}",
            args_of(self.runtime, "COPY"),
        )
        self.assertEqual(args_of(self.runtime, "STOPSIGNAL"), ["SIGTERM"])

    def test_config_is_the_defaults_but_addresses_and_data_dir(self):
        with open(os.path.join(REPO, "deploy/kvdepot.yaml")) as f:
            defaults = yaml.safe_load(f)
        self.assertEqual(set(self.config), set(defaults))
        for key, value in defaults.items():
            if key not in ("listen", "metrics_listen", "data_dir"):
                self.assertEqual(self.config[key], value, key)
            elif key != "data_dir":
                self.assertEqual(
                    self.config[key].rsplit(":", 1)[1], value.rsplit(":", 1)[1], key
                )

    def test_runtime_packages_exist_in_debian_12(self):
        packages = apt_packages(self.runtime)
        self.assertTrue(packages)
        if not (is_debian_12() and shutil.which("apt-cache")):
            self.skipTest("needs Debian 12's apt-cache")
        out = subprocess.run(
            ["apt-cache", "show", "--no-all-versions", *packages],
            capture_output=True,
            text=True,
        ).stdout
        known = set(re.findall(r"^Package: (\S+)$", out, re.M))
        self.assertEqual(set(packages) - known, set(), "not Debian 12 packages")

    def test_runtime_packages_provide_every_linked_library(self):
        binaries = [os.path.join(BUILD, b) for b in BINARIES]
        binaries = [b for b in binaries if os.access(b, os.X_OK)]
        if not binaries:
            self.skipTest(f"no kvdepotd or kvdepotctl built in {BUILD}")
        if not (is_debian_12() and shutil.which("dpkg") and shutil.which("apt-cache")):
            self.skipTest("needs Debian 12's dpkg and apt-cache")
        libraries = set()
        for binary in binaries:
            out = subprocess.run(
                ["ldd", binary], capture_output=True, text=True, check=True
            ).stdout
            libraries |= set(re.findall(r"=> (/\S+)", out))
            libraries |= set(re.findall(r"^\s*(/\S+) \(", out, re.M))
        if any(re.search(r"lib(a|ub|t)san", l) for l in libraries):
            self.skipTest("sanitizer build: its runtimes are not shipped")
        proc = subprocess.run(
            [
                "apt-cache",
                "depends",
                "--recurse",
                "--no-recommends",
                "--no-suggests",
                "--no-conflicts",
                "--no-breaks",
                "--no-replaces",
                "--no-enhances",
                *apt_packages(self.runtime),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        installed = {
            l.strip()
            for l in proc.stdout.splitlines()
            if l and not l.startswith(" ") and not l.startswith("<")
        }
        missing = {
            library: package
            for library, package in owning_packages(libraries).items()
            if package not in installed
        }
        self.assertEqual(
            missing,
            {},
            "libraries the runtime stage does not install " "(library: owning package)",
        )


if __name__ == "__main__":
    unittest.main()
