"""A live kvdepotd for the Python tests: 127.0.0.1:0, its own data
directory, NVMe tier off. The binary is $KVDEPOT_DAEMON (set by ctest); the
tests that use it are skipped without it.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import unittest


class Daemon:
    """A kvdepotd on 127.0.0.1:0 with its own data directory, NVMe tier off."""

    def __init__(self, metrics: bool = False) -> None:
        """With ``metrics``, also serves /metrics (see ``metric``)."""
        binary = os.environ.get("KVDEPOT_DAEMON")
        if not binary or not os.path.exists(binary):
            raise unittest.SkipTest("KVDEPOT_DAEMON does not name kvdepotd")
        self.dir = tempfile.mkdtemp(prefix="kvdepot-pytest-")
        self.log_path = os.path.join(self.dir, "kvdepotd.log")
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [binary, "--listen", "127.0.0.1:0",
             "--metrics-listen", "127.0.0.1:0" if metrics else "",
             "--data-dir", os.path.join(self.dir, "data"), "--hugepages", "off",
             "--dram-capacity", "64MiB", "--nvme-capacity", "0"],
            stdout=self.log, stderr=subprocess.STDOUT)
        text = ""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with open(self.log_path, "rb") as f:
                text = f.read().decode(errors="replace")
            m = re.search(r"listening on (\S+); metrics on (\S+);", text)
            if m:
                self.address = m.group(1)
                self.metrics_address = m.group(2)
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"kvdepotd did not start:\n{text}")

    def metric(self, series: str) -> float:
        """The value of one /metrics series, written as the exposition
        writes it (``name{labels}``); 0 when absent."""
        import urllib.request

        url = f"http://{self.metrics_address}/metrics"
        with urllib.request.urlopen(url, timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(series + " "):
                    return float(line.split()[-1])
        return 0.0

    def pause(self) -> None:
        """SIGSTOPs the daemon and returns once every one of its threads has
        stopped: what it is sent now cannot complete until ``resume``."""
        pid = self.proc.pid
        os.kill(pid, signal.SIGSTOP)
        # kill() returns before every thread has stopped: wait until they have.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            states = []
            for task in os.listdir(f"/proc/{pid}/task"):
                try:
                    with open(f"/proc/{pid}/task/{task}/stat") as f:
                        states.append(f.read().rsplit(")", 1)[1].split()[0])
                except FileNotFoundError:  # a thread that just exited
                    pass
            if states and all(st in ("T", "t") for st in states):
                return
            time.sleep(0.001)
        raise RuntimeError("kvdepotd did not stop")

    def resume(self) -> None:
        """SIGCONTs the daemon if it still runs (a no-op otherwise)."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)

    def resume_after(self, seconds: float) -> subprocess.Popen:
        """SIGCONTs the daemon from another process after ``seconds``, so
        that it continues whatever this process (and its GIL) is doing.
        Wait for the returned process before the test ends."""
        return subprocess.Popen(["sh", "-c", "sleep %s; kill -CONT %d"
                                 % (seconds, self.proc.pid)])

    def terminate(self) -> None:
        """SIGTERM, and wait for the exit (the daemon may stay gone)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def stop(self) -> None:
        self.terminate()
        if not self.log.closed:
            self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)
