"""The live-storage tracker: seed 001 to the byte, views, frees, resizes, the seed 004 Q5 leak."""

from __future__ import annotations

import contextlib
import itertools
import subprocess
import sys
from pathlib import Path

import pytest

from memcalc_gui.measure.tracker import LiveStorageTracker  # does not import torch

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]
LAYER = 1024 * 1024 * 4  # nn.Linear(1024, 1024, bias=False) in fp32
STEP_COUNTER = (
    4  # AdamW's per-parameter ``step`` tensor (fp32 scalar; host memory on CUDA)
)


def test_importing_measure_does_not_import_torch() -> None:
    code = (
        "import sys, memcalc_gui.measure.tracker, memcalc_gui.measure.cpu_step;"
        "assert 'torch' not in sys.modules, 'torch imported at module level'"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def _seed001(impl: dict[str, bool]) -> dict[str, int]:
    """Seed 001's walk-through; live-byte deltas and the step's transient peak."""
    out: dict[str, int] = {}
    tr = LiveStorageTracker()
    with tr:
        model = torch.nn.Linear(1024, 1024, bias=False)
        out["params"] = tr.live_bytes
        opt = torch.optim.AdamW(model.parameters(), **impl)
        inputs = torch.ones(1024)
        before = tr.live_bytes
        outputs = model(inputs)
        out["forward"] = tr.live_bytes - before
        loss = outputs.sum()
        before = tr.live_bytes
        loss.backward()
        out["backward"] = tr.live_bytes - before
        for i in (1, 2):
            before = tr.live_bytes
            with tr.phase("optimizer_step", i):
                opt.step()
            start, end = tr.windows()[("optimizer_step", i, 0)]
            out[f"step{i}"] = tr.live_bytes - before
            out[f"temp{i}"] = tr.peak(start, end).bytes - tr.live_bytes
        del outputs, loss
    tr.close()
    return out


@pytest.mark.parametrize(
    ("impl", "temporaries"),
    [
        ({"foreach": True}, LAYER),  # one temporary per parameter for the whole list
        ({"foreach": False}, 2 * LAYER),  # sqrt and div of exp_avg_sq, as in seed 001
        ({"fused": True}, 0),
    ],
    ids=["foreach", "single-tensor", "fused"],
)
def test_seed001_exact(impl: dict[str, bool], temporaries: int) -> None:
    got = _seed001(impl)
    assert got["params"] == 4_194_304
    assert got["forward"] == 4_096
    assert got["backward"] == 4_194_304
    assert got["step1"] == 8_388_608 + STEP_COUNTER
    assert got["step2"] == 0
    assert got["temp1"] == temporaries
    assert got["temp2"] == temporaries


def test_views_share_one_storage_and_free_is_logged() -> None:
    tr = LiveStorageTracker()
    with tr:
        x = torch.empty(1000)
        y = x.view(10, 100).t()
        assert tr.live_bytes == 4000
        assert len(tr.live_sids()) == 1
        del x
        assert tr.live_bytes == 4000  # the view keeps the storage alive
        del y
        assert tr.live_bytes == 0
    assert [e.kind for e in tr.events] == ["alloc", "free"]
    tr.close()


def test_a_fake_collectives_wait_is_its_output_not_a_second_tensor() -> None:
    """The real ``wait_tensor`` returns its argument; the fake one (a meta kernel) returned a new empty tensor, and a
    tensor-parallel rank's trace counted each all-reduce output twice while both lived."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memcalc_gui.trace.ranks import fake_process_group

    tr = LiveStorageTracker()
    with fake_process_group(2), FakeTensorMode(), tr:
        x = torch.empty(1000)
        y = torch.ops._c10d_functional.all_reduce(x, "sum", "0")
        z = torch.ops._c10d_functional.wait_tensor(y)
        assert z is y
        assert tr.live_bytes == 8000  # x and the all-reduce's output, once
        del x, y, z
    tr.close()


def test_meta_tensors_hold_no_memory_real_or_fake() -> None:
    """A tensor on the meta device is shapes only: a pipeline stage's example inputs and outputs are given on it, and
    the last stage's logits-sized one read as a transient of its load before (in the fake trace and the real run)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    for fake in (False, True):
        tr = LiveStorageTracker()
        with FakeTensorMode() if fake else contextlib.nullcontext(), tr:
            shapes = torch.empty(64, 1000, device="meta")
            like = torch.empty_like(shapes)
            assert tr.live_bytes == 0 and not tr.records, fake
            x = torch.empty(1000)
            assert tr.live_bytes == 4000, fake
            del shapes, like, x
        tr.close()


def test_storage_owned_only_by_autograd_is_seen_until_graph_dies() -> None:
    tr = LiveStorageTracker()
    a = torch.randn(256, requires_grad=True)
    with tr:
        tr.track(a, "parameters")
        b = (a * 2).sin()  # a*2 is saved for sin's backward; no Python reference to it
        assert tr.live_bytes == 3 * 1024
        del b
        assert tr.live_bytes == 1024
    tr.close()


def test_resize_of_an_out_tensor_is_counted() -> None:
    tr = LiveStorageTracker()
    with tr:
        a = torch.ones(100)
        out = torch.empty(0)
        torch.add(a, a, out=out)
        assert tr.live_bytes == 800
        assert "resize" in [e.kind for e in tr.events]
        del out
        assert tr.live_bytes == 400
    tr.close()


def test_existing_tensors_tracked_explicitly_and_tags() -> None:
    w = torch.zeros(64, 64)
    tr = LiveStorageTracker()
    with tr:
        sid = tr.track(w, "parameters")
        assert tr.track(w[0], "other") == sid  # same storage, one record
        assert tr.live_bytes == 64 * 64 * 4
    assert tr.records[sid].tags == {"parameters", "other"}
    tr.close()


def test_phase_windows_peak_and_composition() -> None:
    tr = LiveStorageTracker()
    with tr:
        keep = torch.ones(256)  # 1 KiB
        with tr.phase("forward", 1):
            t = torch.ones(512)  # 2 KiB transient
            del t
            u = torch.ones(128)  # 512 B survives the phase
    start, end = tr.windows()[("forward", 1, 0)]
    peak = tr.peak(start, end)
    assert peak.bytes == 1024 + 2048
    comp = tr.composition_at(peak.index, lambda r: r.phase or "outside")
    assert comp == {"outside": 1024, "forward": 2048}
    assert sum(comp.values()) == peak.bytes
    assert tr.events[end].live_bytes == 1024 + 512
    top = tr.top_live(peak.index, 1)
    assert top[0][1] == 2048 and top[0][0].op == "aten.ones.default"
    del keep, u
    tr.close()


def _q5_live_per_iteration(keep_tensor: bool) -> list[int]:
    """Seed 004 Q5: append the loss (with its graph) or its ``item()`` to a list."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    x = torch.randn(8, 4)
    y = torch.randint(0, 2, (8,))
    tr = LiveStorageTracker()
    bucket: list[object] = []
    live: list[int] = []
    with tr:
        for p in model.parameters():
            tr.track(p, "parameters")
        tr.track(x, "inputs")
        tr.track(y, "inputs")
        for _ in range(4):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            bucket.append(loss if keep_tensor else loss.item())
            del loss
            live.append(tr.live_bytes)
    tr.close()
    return live


def test_q5_keeping_loss_tensors_grows_and_item_does_not() -> None:
    kept = _q5_live_per_iteration(keep_tensor=True)
    assert all(b > a for a, b in itertools.pairwise(kept))
    scalars = _q5_live_per_iteration(keep_tensor=False)
    assert len(set(scalars)) == 1
