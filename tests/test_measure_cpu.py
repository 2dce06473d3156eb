"""Measured training steps of tiny HF models on CPU: composition, gradients, state, leak check."""

from __future__ import annotations

from typing import Any

import pytest
from tiers import sample

from bench.probe import FAMILIES, tiny_config
from memcalc_gui.core.vocab import PHASES, TENSOR_OBJECTS
from memcalc_gui.measure.cpu_step import (  # does not import torch
    TRANSIENT,
    StepMeasurement,
    UnsupportedOptimizerError,
    build_model,
    format_measurement,
    measure_training_step,
    top_storages,
)

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

LLAMA = tiny_config("llama")
ROPE_BUFFERS = 2 * 32 * 4  # inv_freq and original_inv_freq, fp32 (head_dim 64)


def _counts(config: dict[str, Any], precision: str = "fp32") -> tuple[int, int, int]:
    """(parameter count, parameter tensors, numel of nn.Linear weights) — the oracle."""
    model = build_model(config, precision=precision)
    params = list(model.parameters())
    linear = sum(
        m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)
    )
    return sum(p.numel() for p in params), len(params), linear


@pytest.fixture(scope="module")
def fp32() -> StepMeasurement:
    return measure_training_step(LLAMA, batch=2, seq=64, precision="fp32", iterations=3)


@pytest.fixture(scope="module")
def oracle() -> tuple[int, int, int]:
    return _counts(LLAMA)


def _assert_consistent(m: StepMeasurement) -> None:
    assert m.device == "cpu"
    assert list(m.phases) == list(PHASES)
    for ph in m.phases.values():
        assert set(ph.objects) == set(TENSOR_OBJECTS)
        assert sum(ph.objects.values()) == ph.peak_bytes
        assert ph.live_bytes <= ph.peak_bytes


def test_llama_fp32_ledger(fp32: StepMeasurement, oracle: tuple[int, int, int]) -> None:
    n, n_tensors, _ = oracle
    _assert_consistent(fp32)
    assert fp32.params == n
    ph = fp32.phases
    assert ph["load"].objects["parameters"] == 4 * n + ROPE_BUFFERS
    assert ph["forward"].objects["activations"] > 0
    assert ph["forward"].objects["gradients"] == 0  # set_to_none: no grads in forward
    assert 0 < ph["backward"].objects["gradients"] <= 4 * n
    assert ph["optimizer_step"].objects["gradients"] == 4 * n
    state = 8 * n + 4 * n_tensors  # exp_avg + exp_avg_sq + a 4-byte step per tensor
    assert all(p.objects["optimizer_state"] == state for p in list(ph.values())[1:])
    assert ph["optimizer_step"].objects["optimizer_temporaries"] > 0
    assert ph["optimizer_step"].live_bytes == 4 * n + ROPE_BUFFERS + state + 2 * 64 * 8
    assert ph["forward"].objects["inputs"] == 2 * 64 * 8


def test_leak_check_flat_after_first_step(fp32: StepMeasurement) -> None:
    ends = [r.live_bytes_end for r in fp32.iterations]
    assert len(ends) == 3
    assert ends[0] == ends[1] == ends[2]
    assert fp32.iterations[-1].phase_peaks == {
        k: v.peak_bytes for k, v in fp32.phases.items() if k != "load"
    }


def test_top_storages_debug_helper(fp32: StepMeasurement) -> None:
    top = top_storages(fp32, "backward", 10, TRANSIENT)
    assert len(top) == 10
    assert [s.nbytes for s in top] == sorted((s.nbytes for s in top), reverse=True)
    assert all(s.category in TRANSIENT for s in top)
    text = format_measurement(fp32, top=5, categories=TRANSIENT)
    assert "optimizer_step" in text and "mm.default" in text


def test_mixed_precision_weight_copies() -> None:
    m = measure_training_step(LLAMA, batch=2, seq=64, precision="mixed")
    _assert_consistent(m)
    n, _, linear = _counts(LLAMA)
    fwd = m.phases["forward"]
    assert fwd.compute_copy_bytes == 2 * linear  # bf16 copy of every nn.Linear weight
    assert fwd.objects["parameters"] == 4 * n + ROPE_BUFFERS + 2 * linear
    assert m.phases["optimizer_step"].objects["gradients"] == 4 * n  # fp32 grads
    assert m.phases["optimizer_step"].compute_copy_bytes == 0
    copies = top_storages(m, "forward", 50, ["compute_copy"])
    assert copies and all(
        s.dtype == "bfloat16" and s.op == "_to_copy.default" for s in copies
    )


def test_bf16_model_halves_weights_grads_state() -> None:
    m = measure_training_step(LLAMA, batch=1, seq=32, precision="bf16")
    _assert_consistent(m)
    n, n_tensors, _ = _counts(LLAMA)
    step = m.phases["optimizer_step"].objects
    assert (
        m.phases["load"].peak_bytes == 2 * n + ROPE_BUFFERS
    )  # built in bf16, no fp32 detour
    assert step["gradients"] == 2 * n
    assert step["optimizer_state"] == 4 * n + 4 * n_tensors


@pytest.mark.parametrize(
    ("impl", "factor"), [("foreach", 1.0), ("fused", 0.0)], ids=["foreach", "fused"]
)
def test_optimizer_impl_temporaries(impl: str, factor: float) -> None:
    m = measure_training_step(
        LLAMA, batch=1, seq=16, precision="fp32", optimizer_impl=impl
    )
    assert (
        m.phases["optimizer_step"].objects["optimizer_temporaries"]
        == factor * 4 * m.params
    )


def test_single_tensor_temporaries_are_two_largest_params(
    fp32: StepMeasurement,
) -> None:
    # size[i-1] + 2*size[i]: the previous param's denom is still bound while sqrt/div run
    mlp = 256 * 688 * 4
    assert fp32.phases["optimizer_step"].objects["optimizer_temporaries"] == 3 * mlp


def test_grad_accum_keeps_grads_through_second_micro_batch() -> None:
    m = measure_training_step(LLAMA, batch=1, seq=16, precision="fp32", grad_accum=2)
    _assert_consistent(m)
    assert m.phases["forward"].objects["gradients"] == 4 * m.params  # micro-batch 2
    ends = [r.live_bytes_end for r in m.iterations]
    assert ends[0] == ends[1]


def test_checkpointing_cuts_forward_activations(fp32: StepMeasurement) -> None:
    m = measure_training_step(
        LLAMA, batch=2, seq=64, precision="fp32", checkpointing="full"
    )
    _assert_consistent(m)
    assert (
        m.phases["forward"].objects["activations"]
        < fp32.phases["forward"].objects["activations"] / 2
    )


@pytest.mark.parametrize("optimizer", ["sgd", "sgd-momentum", "adam", "adafactor"])
def test_other_optimizers_state(optimizer: str) -> None:
    m = measure_training_step(
        LLAMA, batch=1, seq=16, precision="fp32", optimizer=optimizer
    )
    _assert_consistent(m)
    state = m.phases["optimizer_step"].objects["optimizer_state"]
    n = m.params
    if optimizer == "sgd":
        assert state == 0
    elif optimizer == "sgd-momentum":
        assert state == 4 * n
    elif optimizer == "adam":
        assert state > 8 * n
    else:  # factored second moments: far below one copy of the weights
        assert 0 < state < n


@pytest.mark.parametrize("optimizer", ["lion", "adamw-8bit"])
def test_unsupported_optimizers_raise(optimizer: str) -> None:
    """Lion has no torch optimizer; 8-bit AdamW needs bitsandbytes (an optional extra): without it, the run says so."""
    import importlib.util

    if optimizer == "adamw-8bit" and importlib.util.find_spec("bitsandbytes") is not None:
        m = measure_training_step(LLAMA, batch=1, seq=8, precision="fp32", optimizer=optimizer)
        assert m.phases["optimizer_step"].objects.get("optimizer_state", 0) > 0
        return
    with pytest.raises(NotImplementedError):
        measure_training_step(
            LLAMA, batch=1, seq=8, precision="fp32", optimizer=optimizer
        )
    assert issubclass(UnsupportedOptimizerError, NotImplementedError)


def test_bad_arguments_raise() -> None:
    with pytest.raises(ValueError, match="precision"):
        measure_training_step(LLAMA, batch=1, seq=8, precision="fp8")
    with pytest.raises(ValueError, match="grad_accum"):
        measure_training_step(LLAMA, batch=1, seq=8, precision="fp32", grad_accum=0)


@pytest.mark.parametrize("family", sample(list(FAMILIES), (0, 1, 2), single=True))
def test_every_family_measures(family: str) -> None:
    config = tiny_config(family, hidden=64, heads=4, kv_heads=2, intermediate=128)
    m = measure_training_step(config, batch=1, seq=16, precision="fp32")
    _assert_consistent(m)
    n, _, _ = _counts(config)
    assert m.params == n
    assert m.phases["optimizer_step"].objects["gradients"] == 4 * n
    assert m.iterations[0].live_bytes_end == m.iterations[1].live_bytes_end


def test_a_frozen_heap_outlives_the_steps_and_blocks_inside_it() -> None:
    """A calibration freezes the heap once for its traces (memcalc_gui.measure.frozen_heap): neither a step's own
    freeze nor a block inside ends it early (gc.unfreeze undoes every freeze at once), and its end unfreezes."""
    import gc

    from memcalc_gui.measure import frozen_heap, heap_frozen

    assert gc.get_freeze_count() == 0 and not heap_frozen()
    with frozen_heap():
        frozen = gc.get_freeze_count()
        assert frozen > 0 and heap_frozen()
        with frozen_heap():
            pass
        assert heap_frozen()
        measure_training_step(tiny_config("llama"), batch=1, seq=8, precision="fp32", iterations=2)
        assert gc.get_freeze_count() > frozen // 2  # frozen objects that died leave it; an unfreeze empties it
        assert heap_frozen()
    assert gc.get_freeze_count() == 0 and not heap_frozen()
    measure_training_step(tiny_config("llama"), batch=1, seq=8, precision="fp32", iterations=2)
    assert gc.get_freeze_count() == 0 and not heap_frozen()  # a step's own freeze ends with it


def test_a_fake_step_freezes_its_model_inside_the_calibrations_block_and_a_real_one_does_not() -> None:
    """Inside a block, ``frozen_heap(again=True)`` freezes what was made since (a fake step's model, modules imported
    for it) so the step's collections skip it; a real step leaves its model collectable; the outer end unfreezes all."""
    import gc

    from memcalc_gui.measure import frozen_heap

    with frozen_heap(collect=False):
        before = gc.get_freeze_count()
        made = [[i] for i in range(5000)]
        with frozen_heap(again=False):  # nothing newly frozen (a frozen object that died meanwhile leaves the count)
            assert gc.get_freeze_count() <= before
        with frozen_heap(again=True):
            assert gc.get_freeze_count() >= before + len(made) - 100
        del made
        for fake in (False, True):
            counts: dict[str, int] = {}

            def seen(phase: str, it: int, micro: int = 0, counts: dict[str, int] = counts) -> None:
                counts.setdefault(phase, gc.get_freeze_count())  # the load starts the step; its forward is frozen

            measure_training_step(tiny_config("llama"), batch=1, seq=8, precision="fp32", iterations=1, fake=fake,
                                  on_phase=seen)
            grown = counts["forward"] - counts["load"]
            # the fake model's modules and parameters (~500 for this one); the real one's stay collectable
            assert grown > 200 if fake else grown <= 0, (fake, grown)
    assert gc.get_freeze_count() == 0


def test_a_torch_job_runs_with_the_interpreters_import_and_gives_pyside6_its_own_back() -> None:
    """PySide6 wraps ``__import__`` in a Python function (its ``__feature__`` switch) that every import statement
    of PyTorch's fake-tensor dispatch then runs through: a torch job takes it out while it runs
    (memcalc_gui.measure.plain_imports), nested jobs included, and puts it back after, also when the job fails."""
    import builtins

    import PySide6.QtCore  # noqa: F401  (pytest-qt has loaded it already; the window does too)

    from memcalc_gui.measure import exclusive_torch_job

    qt_import = builtins.__import__
    assert qt_import.__name__ == "__feature_import__"
    with exclusive_torch_job():
        inside = builtins.__import__
        assert inside is not qt_import and inside.__name__ in ("__import__", "__lazy_import__")
        from torch.utils._pytree import tree_flatten  # imports work as before

        assert callable(tree_flatten)
        with exclusive_torch_job():
            assert builtins.__import__ is inside
        assert builtins.__import__ is inside
    assert builtins.__import__ is qt_import
    with pytest.raises(ZeroDivisionError), exclusive_torch_job():
        assert builtins.__import__ is not qt_import
        _ = 1 / 0
    assert builtins.__import__ is qt_import


def test_a_settled_step_takes_each_phase_from_its_lowest_steady_iteration() -> None:
    """A real rank's gloo threads now and then free a buffer late, inside one iteration's phase: ``settled`` takes
    each phase's peak from the steady iteration lowest in it, where the default takes the last iteration's. Here a
    1 MiB tensor stands in for such a buffer, alive through the third iteration's forward only."""
    import torch

    held: list[Any] = []
    extra = 2**20

    def late(phase: str, it: int, micro: int) -> None:
        held.clear()
        if phase == "forward" and it == 3:
            held.append(torch.empty(extra, dtype=torch.uint8))

    kw = dict(batch=1, seq=16, precision="fp32", iterations=3, on_phase=late)
    last = measure_training_step(LLAMA, **kw)
    settled = measure_training_step(LLAMA, **kw, settled=True)
    assert last.phases["forward"].peak_bytes - settled.phases["forward"].peak_bytes == extra
    for phase in ("backward", "optimizer_step"):  # the steady iterations agree there: the same peak either way
        assert last.phases[phase].peak_bytes == settled.phases[phase].peak_bytes
    assert settled.iterations[2].phase_peaks["forward"] - settled.iterations[1].phase_peaks["forward"] == extra
