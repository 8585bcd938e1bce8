"""A pytest plugin: a line on the terminal once a minute while one test runs long.

A test (or the fixture set-up before it, such as an end-to-end training run) that runs for
longer than ``MUON_TEST_HEARTBEAT_S`` seconds (default 60) gets a line ``[tests] still
running: <test> (<n> s)`` every that many seconds, so the test command never sits silent for
minutes. Loaded by ``tests/conftest.py``.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

HEARTBEAT_S = float(os.environ.get("MUON_TEST_HEARTBEAT_S", "60"))


class Heartbeat:
    """Tracks the running test; a daemon thread reports it every ``HEARTBEAT_S`` seconds."""

    def __init__(self, reporter, capture) -> None:
        self.reporter, self.capture = reporter, capture
        self.current: tuple[str, float] | None = None
        self.lock = threading.Lock()
        threading.Thread(target=self._beat, daemon=True).start()

    def start(self, nodeid: str) -> None:
        with self.lock:
            self.current = (nodeid, time.monotonic())

    def _beat(self) -> None:
        while True:
            time.sleep(HEARTBEAT_S)
            with self.lock:
                if self.current is None:
                    continue
                nodeid, since = self.current
                running = time.monotonic() - since
            if running >= 0.99 * HEARTBEAT_S:
                self._say(f"[tests] still running: {nodeid} ({running:.0f} s)")

    def _say(self, line: str) -> None:
        # The test's output is being captured: let this line through to the terminal.
        if self.capture is None:
            self.reporter.write_line(line)
            return
        with self.capture.global_and_fixture_disabled():
            self.reporter.write_line(line)


_heartbeat: Heartbeat | None = None


@pytest.hookimpl(trylast=True)  # after the terminal reporter is registered
def pytest_configure(config: pytest.Config) -> None:
    global _heartbeat
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and _heartbeat is None:
        _heartbeat = Heartbeat(reporter, config.pluginmanager.get_plugin("capturemanager"))


def pytest_runtest_logstart(nodeid: str, location: object) -> None:
    if _heartbeat is not None:
        _heartbeat.start(nodeid)
