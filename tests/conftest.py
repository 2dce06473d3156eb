"""Shared test settings: offscreen Qt, no network, never the user's real settings."""

from __future__ import annotations

import os
import sys
from pathlib import Path

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


# ---- the slowest tests first ----------------------------------------------------------------------------------
#: Test functions of 15 s or more on a 2-core machine (``--durations=0``, 2026-12-05), slowest first. xdist hands
#: tests out in collection order, so one of them collected last (the soak is in test_soak.py) ran alone while the
#: other worker had finished: started first, they share the two workers and the short tests fill the end.
SLOWEST_FIRST = (
    "test_soak.py::test_real_window_survives_scripted_use",
    "test_pipeline.py::test_each_stage_ledger_matches_the_rank_traced_under_pytorchs_schedule",
    "test_unknown_family.py::test_the_ranks_of_a_fitted_family_are_measured_against_its_fitted_ledger",
    "test_pipeline.py::test_the_done_when_layout_traced_agrees_with_its_ledger",
    "test_expert.py::test_the_fitted_fsdp2_ledger_is_the_traced_ranks_fit_and_the_rule_answers_other_layouts",
    "test_pipeline_fitted.py::test_each_fitted_rank_equals_its_schedule_traced_with_every_micro_batch",
    "test_selective_checkpointing.py::test_analytic_and_trace_agree_with_real_steps",
    "test_fitted.py::test_layer_patterns_and_dense_prefixes_fit",
    "test_hostile.py::test_no_code_a_config_names_ever_runs",
    "test_ui.py::test_a_mixture_of_experts_across_gpus_in_the_window",
    "test_expert.py::test_the_fitted_tensor_parallel_rank_matches_the_traced_one",
    "test_ui_measure.py::test_a_family_without_a_block_model_is_measured_against_its_fitted_ledger",
    "test_expert.py::test_the_fitted_ddp_ledger_with_expert_parallelism_matches_the_traced_rank",
    "test_loss.py::test_analytic_and_trace_agree_with_real_chunked_steps",
    "test_pipeline.py::test_a_sequence_parallel_rank_matches_the_rank_traced_with_torchtitans_plan",
    "test_hostile.py::test_measure_answers_every_config",
    "test_pipeline.py::test_a_real_zero_bubble_pipeline_matches_the_trace_and_the_ledger",
    "test_ui.py::test_a_family_without_a_block_model_is_fitted_in_the_window",
    "test_fitted.py::test_fit_equals_the_full_trace_and_a_real_step",
    "test_unknown_family.py::test_a_lever_is_calibrated_only_when_the_setup_does_not_fit",
    "test_hub.py::test_the_issue_command_answers_from_the_bundled_config_without_network",
    "test_pipeline_fitted.py::test_the_cli_fits_and_traces_pipeline_ranks_with_the_experts_split",
    "test_pipeline.py::test_interleaved_fsdp2_follows_each_stage_through_the_schedule",
    "test_measure_ranks.py::test_a_rank_ends_with_the_process_that_started_it",
    "test_packing.py::test_analytic_matches_a_real_packed_step",
    "test_optimizer_in_backward.py::test_analytic_and_trace_agree_with_real_steps",
    "test_pipeline_fitted.py::test_the_pipeline_stages_of_a_fitted_family_are_measured_for_real",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Move the :data:`SLOWEST_FIRST` tests to the front, in that order; the rest keep theirs."""
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}

    def key(item: pytest.Item) -> int:
        name = item.nodeid.split("[", 1)[0].rsplit("/", 1)[-1]
        return rank.get(name, len(rank))

    items.sort(key=key)  # stable: the others stay in collection order


# ---- a stuck run ends, and says where ------------------------------------------------------------------------
#: Past pytest-timeout's 300 s a test is stuck where Python's own timer thread cannot run (a C call holding the
#: interpreter lock): faulthandler's C watchdog then writes every thread's stack to this process's log and ends the
#: process; xdist names the test and starts another worker, and the controller prints the log's tail.
STUCK_TEST_S = 420
#: The controller ends the run when no test has reported for this long (a worker stuck outside any test, in its
#: start or its exit): it prints what each process ran last and exits with 3, well inside CI's time.
STALLED_RUN_S = 1200

_LOG = pytest.StashKey[object]()
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
    """The controller, under xdist: a worker ended abnormally; print the end of its log (the stacks, if stuck)."""
    if not error:
        return
    reporter = node.config.pluginmanager.get_plugin("terminalreporter")
    for path in _logs():
        if path.name.startswith(f"{node.gateway.id}-") and reporter is not None:
            reporter.write_line(f"---- {node.gateway.id}: the end of its log {path} ----")
            reporter.write_line(_tail(path, 80))
            reporter.flush()


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
