"""Issue 61: `measure` refuses any setup whose planned resident size exceeds this machine's available memory,
`--full-size` included, before it builds anything (a 70B full-size run built for 66 s to 21.5 GB before "out of
memory"; on a machine without swap the kernel's OOM killer picks a victim). The reproducer through the real CLI, the
plan with the available memory replaced, the reading of it (/proc/meminfo, cgroups, vm_stat), and the window."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import childmem
import pytest

from memcalc_gui.cli import main as cli_main
from memcalc_gui.core.distributed import Parallelism
from memcalc_gui.core.errors import InputError
from memcalc_gui.core.model import preset_spec, spec_from_config
from memcalc_gui.core.result import evaluate
from memcalc_gui.core.setup import TrainingSetup
from memcalc_gui.measure import hostmem

pytest.importorskip("torch")
pytest.importorskip("transformers")

from memcalc_gui.measure import cpu_step, distributed, engine

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30
TINY = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=1024, hidden_size=128,
            intermediate_size=344, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def tiny_setup(**kw: object) -> TrainingSetup:
    base = dict(model=spec_from_config(TINY), batch=2, seq=64, precision="mixed", optimizer_impl="foreach")
    base.update(kw)
    return TrainingSetup(**base)  # type: ignore[arg-type]


@pytest.fixture
def nothing_runs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record any model build or step (none may happen on a refusal); a step that is reached ends as out of memory
    at once, so an accepted setup costs nothing either."""
    calls: list[str] = []

    def build(*_a: object, **_k: object) -> None:
        calls.append("build_model")
        raise AssertionError("a model was built")

    def step(*_a: object, **_k: object) -> None:
        calls.append("step")
        raise MemoryError

    def ranks(*_a: object, **_k: object) -> None:
        calls.append("ranks")
        raise RuntimeError("out of memory")

    monkeypatch.setattr(cpu_step, "build_model", build)
    monkeypatch.setattr(cpu_step, "measure_training_step", step)
    monkeypatch.setattr(distributed, "measure_sharded_step", ranks)
    monkeypatch.setattr(distributed, "uses_fork_server", lambda: False)  # no fork server process to count
    return calls


def available(monkeypatch: pytest.MonkeyPatch, value: int | None) -> None:
    monkeypatch.setattr(hostmem, "available_bytes", lambda: value)


def need_of(setup: TrainingSetup, kind: str = "cpu") -> int:
    est = evaluate(setup.with_changes(target_device=kind))
    return engine.host_need(setup, kind, est.estimate.peak_tensor_bytes, engine._host_bytes(est))[0]


# ---- the reproducer, for real -------------------------------------------------------------------------------------
def _max_rss(args: list[str], tmp_path: Path, name: str) -> tuple[int, float, str, int]:
    """Run ``python -m args…`` and return its exit code, its wall time, its stderr and its own peak resident size
    (bytes; tests/childmem.py: a child's ``ru_maxrss`` would count this pytest worker's peak too)."""
    err = tmp_path / f"{name}.err"
    peak = tmp_path / f"{name}.peak"
    env = dict(os.environ, PYTHONPATH=str(ROOT), QT_QPA_PLATFORM="offscreen", **{childmem.PEAK_ENV: str(peak)})
    t0 = time.monotonic()
    with open(err, "wb") as fh:
        proc = subprocess.run(childmem.command(*args), stdout=subprocess.DEVNULL, stderr=fh, cwd=ROOT, env=env,
                              timeout=120)
    seconds = time.monotonic() - t0
    return proc.returncode, seconds, err.read_text(encoding="utf-8"), childmem.read_peak(peak) or 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a process's own peak is read from /proc")
def test_full_size_70b_is_refused_by_the_real_cli_in_seconds_and_little_memory(tmp_path: Path) -> None:
    """`memcalc measure --preset llama-3.1-70b --full-size`: exit 2 and one line naming --full-size within 10 s,
    resident under 1 GB beyond what importing torch takes. No monkeypatching: 70B needs over 1 TiB."""
    free = hostmem.available_bytes()
    if free is None or free > 1024 * GIB:
        pytest.skip("this machine's available memory is unknown, or would hold a full-size 70B step")
    _, _, _, torch_rss = _max_rss(["torch.version"], tmp_path, "torch")  # python -m torch.version imports torch
    code, seconds, stderr, rss = _max_rss(["memcalc_gui.cli", "measure", "--preset", "llama-3.1-70b",
                                           "--full-size"], tmp_path, "measure")
    lines = stderr.strip().splitlines()
    assert code == 2, stderr
    assert len(lines) == 1 and lines[0].startswith("memcalc: error: --full-size: "), stderr
    assert "TiB of this machine's memory" in lines[0] and "is available" in lines[0]
    assert "drop --full-size" in lines[0]
    assert seconds < 10, seconds
    assert torch_rss > 0 and rss < torch_rss + 2**30, (rss, torch_rss)


# ---- full size, with the available memory replaced ---------------------------------------------------------------
def test_a_small_full_size_setup_is_refused_when_little_is_available(monkeypatch, nothing_runs, capsys) -> None:
    available(monkeypatch, 100 * 2**20)  # less than the process itself
    with pytest.raises(InputError) as info:
        engine.measure(tiny_setup(), device="cpu", full_size=True)
    assert info.value.field == "full_size" and "\n" not in str(info.value)
    assert "is available" in info.value.reason and "drop --full-size" in info.value.reason
    assert nothing_runs == []
    # the CLI: one line naming the flag, exit 2
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["measure", "--preset", "gpt2", "--device", "cpu", "--full-size"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("memcalc: error: --full-size: measuring this setup at full size")
    assert nothing_runs == []


def test_a_full_size_setup_is_accepted_when_enough_is_available(monkeypatch, nothing_runs) -> None:
    available(monkeypatch, 64 * GIB)
    r = engine.measure(tiny_setup(), device="cpu", full_size=True)
    assert nothing_runs == ["step"] and r.oom  # it went ahead (the stand-in step runs out of memory at once)
    assert not r.scaled


def test_the_margin_is_eighty_percent_of_what_is_available(monkeypatch) -> None:
    """gpt2 at full size: refused one byte below need / 0.8, accepted at it."""
    setup = TrainingSetup(model=preset_spec("gpt2"), batch=1, seq=128)
    need = need_of(setup)
    est = evaluate(setup.with_changes(target_device="cpu"))
    at = int(need / engine.HOST_MARGIN) + 1
    engine.check_host_memory(setup, est, engine.DeviceInfo("cpu", "CPU", 2 * at, at, at))
    with pytest.raises(InputError, match="full_size"):
        engine.check_host_memory(setup, est, engine.DeviceInfo("cpu", "CPU", 2 * at, at, at - 2))
    # what it counts: the tensors (and the allocator's share) and the process
    peak = est.estimate.peak_tensor_bytes
    assert need == int(peak * engine.RESIDENT_FACTOR) + engine.PROCESS_BYTES


def test_unknown_available_memory_refuses_nothing(monkeypatch, nothing_runs) -> None:
    available(monkeypatch, None)
    monkeypatch.setattr(engine, "_cpu_memory", lambda: (8 * GIB, 4 * GIB))  # the device budget's guess
    setup = TrainingSetup(model=preset_spec("llama-3.1-70b"), batch=1, seq=512)
    assert engine.detect_device("cpu").host_free_bytes is None
    est = evaluate(setup.with_changes(target_device="cpu"))
    engine.check_host_memory(setup, est, engine.DeviceInfo("cpu", "CPU", 8 * GIB, 4 * GIB, None))
    r = engine.measure(tiny_setup(), device="cpu", full_size=True)
    assert nothing_runs == ["step"] and r.oom


def test_the_device_found_carries_the_available_memory(monkeypatch) -> None:
    available(monkeypatch, 5 * GIB)
    info = engine.detect_device("cpu")
    assert info.host_free_bytes == 5 * GIB and info.free_bytes == 5 * GIB


def test_multi_rank_plans_the_sum_of_its_rank_processes(monkeypatch, nothing_runs) -> None:
    one = need_of(tiny_setup())
    ddp = tiny_setup(parallel=Parallelism(gpus=4, strategy="ddp"))
    rank_peak = evaluate(ddp.with_changes(target_device="cpu")).estimate.peak_tensor_bytes
    four = need_of(ddp)
    # four DDP ranks, each its step (the single one and DDP's buckets) and a process
    assert four == 4 * (int(rank_peak * engine.RESIDENT_FACTOR) + engine.PROCESS_BYTES) and four > 4 * one
    monkeypatch.setattr(distributed, "uses_fork_server", lambda: True)
    monkeypatch.setattr(distributed, "fork_server_started", lambda: False)
    assert need_of(ddp) == four + engine.PROCESS_BYTES  # the fork server about to start
    monkeypatch.setattr(distributed, "uses_fork_server", lambda: False)
    # every rank builds its whole model before FSDP2 shards it: a rank holds at least that
    fsdp = TrainingSetup(model=preset_spec("qwen2.5-0.5b"), batch=1, seq=64, precision="mixed",
                         parallel=Parallelism(gpus=4, strategy="fsdp2"))
    est = evaluate(fsdp.with_changes(target_device="cpu"))
    need, what = engine.host_need(fsdp, "cpu", est.estimate.peak_tensor_bytes)
    built = fsdp.num_params * 4
    assert need >= 4 * (int(built * engine.RESIDENT_FACTOR) + engine.PROCESS_BYTES) and "4 rank processes" in what
    # room for one rank's process but not for four: refused before any rank starts
    available(monkeypatch, int(2 * one / engine.HOST_MARGIN))
    with pytest.raises(InputError) as info:
        engine.measure(ddp, device="cpu", full_size=True)
    assert info.value.field == "full_size" and "4 rank processes" in info.value.reason
    assert nothing_runs == []


def test_a_cuda_measurement_plans_the_host_side_only() -> None:
    """On CUDA the model is built on the GPU: the host holds the process and the offloaded activations."""
    setup = TrainingSetup(model=preset_spec("llama-3.1-70b"), batch=1, seq=512)
    assert engine.host_need(setup, "cuda", 10**12)[0] == engine.CUDA_PROCESS_BYTES
    offloaded = setup.with_changes(activation_offload="all")
    est = evaluate(offloaded)
    assert engine._host_bytes(est) > 0
    assert need_of(offloaded, "cuda") == engine.CUDA_PROCESS_BYTES + int(engine._host_bytes(est) *
                                                                         engine.RESIDENT_FACTOR)


# ---- scaled down (no --full-size) ---------------------------------------------------------------------------------
@pytest.mark.parametrize("gib", [2, 6, 12])
def test_a_scaled_down_plan_never_plans_above_what_is_available(gib: int) -> None:
    setup = TrainingSetup(model=preset_spec("qwen2.5-0.5b"), batch=4, seq=1024)
    room = gib * GIB
    device = engine.DeviceInfo("cpu", "CPU", 64 * GIB, 64 * GIB, room)  # the device budget alone would allow more
    measured, note = engine.plan(setup, device, time_budget_s=1e9)
    assert need_of(measured) <= room * engine.HOST_MARGIN
    assert "scaled-down" in note


def test_a_scaled_down_plan_refuses_when_even_the_smallest_does_not_fit() -> None:
    setup = TrainingSetup(model=preset_spec("llama-3.1-70b"), batch=1, seq=512)
    device = engine.DeviceInfo("cpu", "CPU", 64 * GIB, 64 * GIB, 8 * GIB)
    with pytest.raises(InputError) as info:
        engine.plan(setup, device, time_budget_s=30)
    assert info.value.field == "model" and "even the smallest scaled-down setup (1 of 80 layers" in info.value.reason
    assert "8.00 GiB is available" in info.value.reason and "smaller setup" in info.value.reason
    # a GPU with room does not help a host that cannot hold the CUDA process
    gpu = engine.DeviceInfo("cuda", "NVIDIA Test GPU 80GB", 80 * GIB, 79 * GIB, GIB)
    with pytest.raises(InputError, match="the CUDA process"):
        engine.plan(TrainingSetup(model=preset_spec("gpt2"), batch=1, seq=128), gpu, time_budget_s=30)


# ---- reading the available memory ---------------------------------------------------------------------------------
def test_meminfo_available(tmp_path: Path) -> None:
    path = tmp_path / "meminfo"
    path.write_text("MemTotal:       24683772 kB\nMemFree:         1000 kB\nMemAvailable:   2048 kB\n")
    assert hostmem.meminfo_available(path) == 2048 * 1024
    path.write_text("MemTotal:       24683772 kB\nMemFree:         1000 kB\n")  # before Linux 3.14
    assert hostmem.meminfo_available(path) == 1000 * 1024
    assert hostmem.meminfo_available(tmp_path / "missing") is None


def _proc(tmp_path: Path, cgroup: str, mountinfo: str) -> Path:
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text(cgroup)
    (proc / "mountinfo").write_text(mountinfo)
    return proc


def test_cgroup_v2_room_is_the_least_of_this_cgroup_and_those_above(tmp_path: Path) -> None:
    mount = tmp_path / "cg2"
    own = mount / "user.slice" / "job"
    own.mkdir(parents=True)
    (mount / "user.slice" / "memory.max").write_text("max\n")
    (mount / "user.slice" / "memory.current").write_text("5\n")
    (own / "memory.max").write_text(f"{4 * GIB}\n")
    (own / "memory.current").write_text(f"{3 * GIB}\n")
    (own / "memory.stat").write_text(f"anon 1\ninactive_file {GIB // 2}\n")
    proc = _proc(tmp_path, "0::/user.slice/job\n",
                 f"30 23 0:26 / {mount} rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n")
    assert hostmem.cgroup_room(proc) == GIB + GIB // 2  # 4 GiB − (3 GiB − the reclaimable 0.5 GiB)
    (mount / "user.slice" / "memory.max").write_text(f"{GIB}\n")  # a tighter parent
    assert hostmem.cgroup_room(proc) == GIB - 5


def test_cgroup_v1_room_and_no_limit(tmp_path: Path) -> None:
    mount = tmp_path / "memory"
    own = mount / "docker" / "abc"
    own.mkdir(parents=True)
    (own / "memory.limit_in_bytes").write_text(f"{2 * GIB}\n")
    (own / "memory.usage_in_bytes").write_text(f"{GIB}\n")
    (own / "memory.stat").write_text("cache 9\ntotal_inactive_file 0\n")
    (mount / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    (mount / "memory.usage_in_bytes").write_text("1\n")
    proc = _proc(tmp_path, "4:memory:/docker/abc\n1:cpu:/\n",
                 f"35 31 0:32 / {mount} rw,relatime - cgroup cgroup rw,memory\n")
    assert hostmem.cgroup_room(proc) == GIB
    (own / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert hostmem.cgroup_room(proc) is None


def test_the_smaller_of_meminfo_and_the_cgroup_is_available(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(hostmem, "meminfo_available", lambda: 8 * GIB)
    monkeypatch.setattr(hostmem, "cgroup_room", lambda: 3 * GIB)
    assert hostmem.available_bytes() == 3 * GIB
    monkeypatch.setattr(hostmem, "cgroup_room", lambda: None)
    assert hostmem.available_bytes() == 8 * GIB


def test_vm_stat_of_macos() -> None:
    text = ("Mach Virtual Memory Statistics: (page size of 16384 bytes)\nPages free:                 1000.\n"
            "Pages active:               5000.\nPages inactive:             2000.\nPages speculative:            10.\n"
            "Pages wired down:           3000.\n")
    assert hostmem.vm_stat_available(text) == 16384 * 3010
    assert hostmem.vm_stat_available("nothing") is None


# ---- the window -----------------------------------------------------------------------------------------------------
def test_the_window_refuses_a_70b_setup_in_one_line_without_building(qtbot, monkeypatch, nothing_runs,
                                                                     tmp_path) -> None:
    """The Measure panel (which scales down; it has no full-size switch) on Llama-3.1-70B with 8 GiB available: one
    line saying what even the smallest scaled-down setup would hold, and nothing built."""
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from memcalc_gui.ui import measure_panel
    from memcalc_gui.ui.form import default_state
    from memcalc_gui.ui.main_window import MainWindow
    from memcalc_gui.ui.settings import SETTINGS_ENV

    monkeypatch.setenv(SETTINGS_ENV, str(tmp_path / "settings"))
    monkeypatch.setattr(measure_panel, "DETECT_DELAY_MS", None)
    available(monkeypatch, 8 * GIB)
    detect = engine.detect_device
    monkeypatch.setattr(engine, "detect_device", lambda device="auto": detect("cpu"))  # a GPU here would take it
    w = MainWindow(initial_state=default_state().replace(preset="llama-3.1-70b", batch="1", seq="512",
                                                         grad_accum="1"), persist=False)
    qtbot.addWidget(w)
    w.show()
    panel = w.measure_panel
    t0 = time.monotonic()
    with qtbot.waitSignal(panel.failed, timeout=10000) as blocker:
        panel.start()
    message = blocker.args[0]
    assert time.monotonic() - t0 < 10
    assert "\n" not in message and message.startswith("model: even the smallest scaled-down setup"), message
    assert "8.00 GiB is available" in message and "smaller setup" in message
    assert message in panel.view.message.text()
    assert nothing_runs == []
    assert panel.button.isEnabled() and not panel.is_running()
