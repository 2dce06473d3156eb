"""Shared test settings: offscreen Qt, no network, never the user's real settings."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# The xdist workers inherit these folders of the run: MEMCALC_CACHE_DIR holds its fitted-method calibrations, never
# the user's cache (a fit two tests share is calibrated once a run; tests of a cold fit set their own), and
# MEMCALC_TEST_WATCHDOG_DIR each process's log of its tests and a stuck one's stacks (below).
for _name, _prefix in (("MEMCALC_CACHE_DIR", "memcalc-test-fits-"),
                       ("MEMCALC_TEST_WATCHDOG_DIR", "memcalc-test-watchdog-")):
    if _name not in os.environ:
        import tempfile

        os.environ[_name] = tempfile.mkdtemp(prefix=_prefix)

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


import pytest  # noqa: E402


@pytest.fixture
def quiet_panels(tmp_path, monkeypatch):
    """A window of its own: private settings, no delayed GPU probe, a short trace delay."""
    from memcalc_gui.ui import measure_panel, trace_panel
    from memcalc_gui.ui.settings import SETTINGS_ENV

    monkeypatch.setenv(SETTINGS_ENV, str(tmp_path / "settings"))
    monkeypatch.setattr(measure_panel, "DETECT_DELAY_MS", None)
    monkeypatch.setattr(trace_panel, "TRACE_DELAY_MS", 30)


#: How long a test's parked worker threads may run on after it (a calibration between two of its small traces).
ORPHAN_WAIT_S = 120


@pytest.fixture(autouse=True)
def no_job_outlives_its_test():
    """A worker thread a closed window left running (workers.running_orphans: it did not stop within the window's
    close timeout) ends before the next test starts: it would otherwise run its torch job beside that test's."""
    yield
    workers = sys.modules.get("memcalc_gui.ui.workers")
    if workers is None:  # no window in this process yet
        return
    import time

    from PySide6.QtCore import QCoreApplication

    deadline = time.monotonic() + ORPHAN_WAIT_S
    while workers.running_orphans() and time.monotonic() < deadline:
        QCoreApplication.processEvents()  # a worker's collections run on this thread (workers._collect_on_gui_thread)
        time.sleep(0.02)
    left = workers.running_orphans()
    assert not left, f"{len(left)} worker thread(s) still running {ORPHAN_WAIT_S} s after the test"


# ---- a stuck run ends, and says where ------------------------------------------------------------------------
#: Past pytest-timeout's 300 s a test is stuck where Python's own timer thread cannot run (a C call holding the
#: interpreter lock): faulthandler's C watchdog then writes every thread's stack to this process's log and ends the
#: process; xdist names the test and starts another worker, and the controller prints the log's tail.
STUCK_TEST_S = 420
#: The controller ends the run when no test has reported for this long (a worker stuck outside any test, in its
#: start or its exit): it prints what each process ran last and exits with 3, well inside CI's time.
STALLED_RUN_S = 1200

_LOG = pytest.StashKey[object]()
#: How many tests and further matrix cases this run left to the full suite (tests/tiers.py).
_LEFT_TO_FULL = pytest.StashKey[int]()
_LAST_REPORT = [0.0]


def _logs() -> list[Path]:
    return sorted(Path(os.environ["MEMCALC_TEST_WATCHDOG_DIR"]).glob("*.log"))


def _tail(path: Path, lines: int) -> str:
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"({exc})"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Log the test's start and end, and arm the C watchdog for it (setup, call and teardown)."""
    import faulthandler
    import time

    log = item.config.stash.get(_LOG, None)
    if log is None:
        worker = getattr(item.config, "workerinput", {}).get("workerid", "main")
        path = Path(os.environ["MEMCALC_TEST_WATCHDOG_DIR"]) / f"{worker}-{os.getpid()}.log"
        log = item.config.stash[_LOG] = path.open("a", buffering=1, encoding="utf-8")
    log.write(f"{time.strftime('%H:%M:%S')} start {item.nodeid}\n")
    faulthandler.dump_traceback_later(STUCK_TEST_S, exit=True, file=log)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
        log.write(f"{time.strftime('%H:%M:%S')} end\n")


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    """The controller, under xdist: a worker ended abnormally; print the end of its log (the stacks, if stuck). A
    worker that ended well says how many tests it left to the full suite (the summary's line)."""
    if not error:
        left = getattr(node, "workeroutput", {}).get("memcalc_left_to_full", 0)
        node.config.stash[_LEFT_TO_FULL] = max(node.config.stash.get(_LEFT_TO_FULL, 0), left)
        return
    reporter = node.config.pluginmanager.get_plugin("terminalreporter")
    for path in _logs():
        if path.name.startswith(f"{node.gateway.id}-") and reporter is not None:
            reporter.write_line(f"---- {node.gateway.id}: the end of its log {path} ----")
            reporter.write_line(_tail(path, 80))
            reporter.flush()


# ---- the default run and the full one (tests/tiers.py) --------------------------------------------------------
@pytest.hookimpl(tryfirst=True)  # before -k and -m: every case is still there to be counted
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Leave the matrices' further cases and the full suite's functions out unless MEMCALC_FULL_TESTS=1, or unless
    named on the command line (pytest counts them as deselected). A test function whose every case is a further case
    is a usage error: the default suite keeps a case of each matrix."""
    from tiers import FULL_ENV, bare_functions, left_to_full, named_on_the_command_line

    bare = bare_functions(items)
    if bare:
        raise pytest.UsageError(f"the default suite would run no case of {', '.join(bare)} (tests/tiers.py)")
    if os.environ.get(FULL_ENV) == "1":
        return
    left = left_to_full(items, named_on_the_command_line(config.args, config.rootpath, config.invocation_params.dir))
    if left:
        out = set(map(id, left))
        items[:] = [item for item in items if id(item) not in out]
        config.hook.pytest_deselected(items=left)
        config.stash[_LEFT_TO_FULL] = len(left)
        if hasattr(config, "workeroutput"):  # an xdist worker: the controller, which collects nothing, prints it
            config.workeroutput["memcalc_left_to_full"] = len(left)


def pytest_report_header(config: pytest.Config) -> str:
    from tiers import FULL_ENV

    if os.environ.get(FULL_ENV) == "1":
        return "memcalc: the full suite (every test, every case of every matrix)"
    return (f"memcalc: the default suite; {FULL_ENV}=1 also runs the full suite's tests and the further cases of the "
            "matrices (tests/tiers.py, docs/testing.md)")


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    from tiers import FULL_ENV

    left = config.stash.get(_LEFT_TO_FULL, 0)
    if left:
        terminalreporter.write_line(f"memcalc: {left} tests and further matrix cases left to the full suite "
                                    f"({FULL_ENV}=1)")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    import time

    _LAST_REPORT[0] = time.monotonic()


def pytest_configure(config: pytest.Config) -> None:
    """The controller under xdist watches for a run in which no test reports any more."""
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
        return  # a worker, or a run without xdist: pytest-timeout and the C watchdog cover it
    import threading
    import time

    _LAST_REPORT[0] = time.monotonic()

    def watch() -> None:
        while time.monotonic() - _LAST_REPORT[0] < STALLED_RUN_S:
            time.sleep(10)
        lines = [f"no test reported for {STALLED_RUN_S} s: the run ends here. What each process ran last:"]
        for path in _logs():
            lines += [f"---- {path} ----", _tail(path, 12)]
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line("\n".join(lines))
            reporter.flush()
        os._exit(3)

    threading.Thread(target=watch, name="stalled-run-watchdog", daemon=True).start()
