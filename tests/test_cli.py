"""The `memcalc` command: readable ledger, the JSON contract, and one-line errors with exit 2."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from memcalc_gui.cli import main
from memcalc_gui.core.vocab import OBJECTS, PHASES

ROOT = Path(__file__).resolve().parent.parent


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_readable_ledger_for_the_done_when_example(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "estimate", "--preset", "qwen2.5-1.5b", "--gpu", "a100-80gb")
    assert code == 0
    for label in ("Parameters", "Optimizer state", "Activations", "Total", "Verdict", "Fits",
                  "Largest micro-batch that fits", "GiB", "1,543,714,304"):
        assert label in out


def test_json_contract(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "estimate", "--preset", "llama-3.2-1b", "--batch", "4", "--seq", "2048",
                       "--gpu", "rtx-4090", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["schema"] == 1 and data["method"] == "analytic"
    assert data["params"] == 1_235_814_400
    assert list(data["phases"]) == list(PHASES)
    for phase in data["phases"].values():
        assert set(phase["objects"]) == set(OBJECTS)
        assert phase["total_bytes"] == sum(phase["objects"].values())
    assert data["peak_bytes"] == max(p["total_bytes"] for p in data["phases"].values())
    assert data["peak_phase"] in PHASES
    assert data["peak_tensor_bytes"] < data["peak_bytes"]
    assert isinstance(data["capacity_bytes"], int) and isinstance(data["fits"], bool)
    assert data["headroom_bytes"] == data["capacity_bytes"] - data["peak_bytes"]
    assert isinstance(data["max_micro_batch"], int)
    for s in data["suggestions"]:
        assert {"title", "changes", "peak_bytes", "saves_bytes", "fits"} <= set(s)


def test_json_without_capacity_has_nulls(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "estimate", "--params", "1.5B", "--json")
    data = json.loads(out)
    assert code == 0 and data["method"] == "quick" and data["params"] == 1_500_000_000
    assert data["capacity_bytes"] is None and data["fits"] is None and data["max_micro_batch"] is None


def test_max_micro_batch_is_the_boundary(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["estimate", "--preset", "gpt2", "--seq", "1024", "--capacity", "8GiB", "--json"]
    data = json.loads(run(capsys, *args)[1])
    m = data["max_micro_batch"]
    assert m > 0
    fits = json.loads(run(capsys, *args[:-1], "--batch", str(m), "--json")[1])
    over = json.loads(run(capsys, *args[:-1], "--batch", str(m + 1), "--json")[1])
    assert fits["fits"] is True and over["fits"] is False


def test_presets_lists_models_and_gpus(capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = run(capsys, "presets", "--json")
    data = json.loads(out)
    names = {m["name"] for m in data["models"]}
    assert {"gpt2", "qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b", "llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b",
            "mistral-7b", "phi-3-mini", "pythia-1b", "gemma-2b"} <= names
    gpus = {g["id"] for g in data["gpus"]}
    assert {"t4", "v100-16gb", "v100-32gb", "rtx-3090", "rtx-4090", "l4", "a10g", "a100-40gb", "a100-80gb",
            "h100-80gb", "h200", "mi300x"} <= gpus
    assert run(capsys, "presets")[0] == 0


@pytest.mark.parametrize("size,expected", [("80GiB", 80 * 2**30), ("80GB", 80 * 10**9), ("24e9", 24 * 10**9),
                                           ("512 MiB", 512 * 2**20)])
def test_capacity_units(capsys: pytest.CaptureFixture[str], size: str, expected: int) -> None:
    data = json.loads(run(capsys, "estimate", "--preset", "gpt2", "--capacity", size, "--json")[1])
    assert data["capacity_bytes"] == expected


BAD = [
    (["--batch", "0"], "--batch"),
    (["--batch", "-3"], "--batch"),
    (["--batch", "nan"], "--batch"),
    (["--batch", "inf"], "--batch"),
    (["--batch", "two"], "--batch"),
    (["--batch", "1.5"], "--batch"),
    (["--seq", "0"], "--seq"),
    (["--seq", "abc"], "--seq"),
    (["--grad-accum", "-1"], "--grad-accum"),
    (["--capacity", "80XB"], "--capacity"),
    (["--capacity", "-5GB"], "--capacity"),
    (["--capacity", "nanGB"], "--capacity"),
    (["--gpu", "voodoo5"], "--gpu"),
    (["--precision", "fp8"], "--precision"),
    (["--cuda-context", "lots"], "--cuda-context"),
    (["--allocator-reserve", "2"], "--allocator-reserve"),
]


@pytest.mark.parametrize("extra,field", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_input_one_line_exit_2(capsys: pytest.CaptureFixture[str], extra: list[str], field: str) -> None:
    code, out, err = run(capsys, "estimate", "--preset", "gpt2", *extra)
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and field in lines[0] and "Traceback" not in err


def test_bad_models(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    cases = {
        "broken.json": ("{not json", "--config"),
        "list.json": ("[1, 2]", "--config"),
        "incomplete.json": (json.dumps({"model_type": "llama", "hidden_size": 64}), "num_attention_heads"),
        "negative.json": (json.dumps({"model_type": "llama", "hidden_size": -64, "num_attention_heads": 4,
                                      "num_hidden_layers": 2, "vocab_size": 10, "intermediate_size": 8}),
                          "hidden_size"),
    }
    for name, (text, field) in cases.items():
        path = tmp_path / name
        path.write_text(text)
        code, _, err = run(capsys, "estimate", "--config", str(path))
        assert code == 2 and field in err and len(err.strip().splitlines()) == 1, (name, err)
    code, _, err = run(capsys, "estimate", "--config", str(tmp_path / "missing.json"))
    assert code == 2 and "--config" in err
    code, _, err = run(capsys, "estimate", "--preset", "nope")
    assert code == 2 and "--preset" in err and "memcalc presets" in err
    code, _, err = run(capsys, "estimate", "--params", "lots")
    assert code == 2 and "--params" in err
    code, _, err = run(capsys, "estimate")
    assert code == 2 and len(err.strip().splitlines()) == 1


@pytest.mark.full_suite
def test_unknown_family_gets_the_meta_count_and_the_fit(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    cfg = {"model_type": "olmo", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "pad_token_id": 1, "eos_token_id": 2,
           "bos_token_id": None}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    code, out, err = run(capsys, "estimate", "--config", str(path), "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["method"] == "fitted" and data["params"] > 0  # exact, where the heuristic is off by up to 8×
    assert "meta device" in " ".join(data["assumptions"])


def test_console_script_runs_as_a_process() -> None:
    proc = subprocess.run([sys.executable, "-m", "memcalc_gui.cli", "estimate", "--preset", "gpt2", "--batch", "0"],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


def test_use_cache_flag_reaches_the_json_and_the_estimate(capsys: pytest.CaptureFixture[str]) -> None:
    code, plain, _ = run(capsys, "estimate", "--preset", "gpt2", "--batch", "2", "--seq", "256", "--json")
    code2, cached, _ = run(capsys, "estimate", "--preset", "gpt2", "--batch", "2", "--seq", "256", "--json",
                           "--use-cache")
    assert code == code2 == 0
    a, b = json.loads(plain), json.loads(cached)
    assert a["setup"]["use_cache"] is False and b["setup"]["use_cache"] is True
    assert b["phases"]["forward"]["total_bytes"] > a["phases"]["forward"]["total_bytes"]


def test_qlora_on_a_4090_prints_the_same_as_the_window(capsys: pytest.CaptureFixture[str]) -> None:
    """The issue's done-when: Llama-3.1-8B, QLoRA r=16 all-linear, micro-batch 4 × 2048, checkpointing, RTX 4090."""
    from memcalc_gui.core.finetune import FineTuning
    from memcalc_gui.core.result import evaluate
    from memcalc_gui.ui.form import FormState, ModelCache, build_setup, capacity_text, gpu_by_id

    code, out, _ = run(capsys, "estimate", "--preset", "llama-3.1-8b", "--tuning", "qlora", "--lora-rank", "16",
                       "--checkpointing", "full", "--gpu", "rtx-4090", "--batch", "4", "--seq", "2048", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["setup"]["tuning"] == "qlora" and data["setup"]["trainable_params"] == 41_943_040
    assert data["setup"]["quantized_params"] > 6e9 and data["setup"]["quantized_bytes"] < 0.52 * 7e9
    state = FormState(preset="llama-3.1-8b", tuning="qlora", checkpointing="full", batch="4", seq="2048",
                      grad_accum="1", gpu="rtx-4090", capacity=capacity_text(gpu_by_id()["rtx-4090"]))
    window = evaluate(build_setup(state, ModelCache()))
    assert window.setup.tuning == FineTuning(method="qlora")
    assert data["peak_bytes"] == window.estimate.peak_bytes and data["fits"] == window.verdict.fits


@pytest.mark.parametrize(("argv", "flag"), [
    (["--tuning", "lora", "--lora-rank", "0"], "--lora-rank"),
    (["--tuning", "lora", "--lora-rank", "x"], "--lora-rank"),
    (["--tuning", "lora", "--lora-dropout", "2"], "--lora-dropout"),
    (["--tuning", "lora", "--lora-dropout", "lots"], "--lora-dropout"),
    (["--tuning", "lora", "--lora-targets", "wq"], "--lora-targets"),
    (["--tuning", "frozen"], "--trainable"),
    (["--tuning", "frozen", "--trainable", "top:3"], "--trainable"),
    (["--tuning", "lora", "--gpus", "8", "--strategy", "zero3"], "--strategy"),
])
def test_bad_fine_tuning_flags_name_the_flag(capsys: pytest.CaptureFixture[str], argv: list[str], flag: str) -> None:
    code, out, err = run(capsys, "estimate", "--preset", "llama-3.2-1b", *argv)
    assert code == 2 and out == ""
    assert err.startswith(f"memcalc: error: {flag}:") and err.count("\n") == 1, err


def test_the_method_help_describes_every_method_it_accepts() -> None:
    """``--method`` accepts fitted, and its help said only what quick, analytic and trace do."""
    from memcalc_gui.cli import build_parser

    estimate = next(a for a in build_parser()._subparsers._group_actions[0].choices["estimate"]._actions  # type: ignore
                    if "--method" in a.option_strings)
    assert estimate.choices
    for method in estimate.choices:
        assert f"{method} (" in estimate.help, method


def test_json_is_the_same_bytes_run_after_run() -> None:
    """Scripts diff the JSON of two runs: each phase's objects come in the ledger's one order, whatever order an
    estimator built them in or the interpreter's string hashing (two processes with different hash seeds)."""
    import os

    from memcalc_gui.core.ledger import PhaseLedger

    assert list(PhaseLedger("forward", {"inputs": 1, "activations": 2, "parameters": 3}).objects) == list(OBJECTS)
    argv = [sys.executable, "-m", "memcalc_gui.cli", "estimate", "--preset", "llama-3.1-70b", "--gpus", "16",
            "--tp", "4", "--pp", "2", "--strategy", "fsdp2", "--gpu", "h100-80gb", "--json"]
    outs = {subprocess.run(argv, capture_output=True, check=True, env={**os.environ, "PYTHONHASHSEED": seed},
                           timeout=120).stdout for seed in ("1", "2")}
    assert len(outs) == 1


ISSUE_62 = ("estimate", "--preset", "qwen2.5-7b", "--batch", "8", "--seq", "4096", "--gpus", "8", "--strategy", "fsdp2",
            "--gpu", "h100-80gb", "--precision", "mixed")


def _advice(out: str) -> list[str]:
    return out.split("What would change it", 1)[1].split("\nAssumptions", 1)[0].splitlines()


@pytest.mark.parametrize("extra", [(), ("--checkpointing", "full")])
def test_the_issue_62_command_offers_the_lossless_fix_first(capsys: pytest.CaptureFixture[str],
                                                              extra: tuple[str, ...]) -> None:
    """Issue 62's command: checkpointing and a chunked loss (34.57 GiB, which the CLI confirms when set by hand) are
    offered above any card that adds GPUs; cards that fit come before the heading of those still over; every size of
    the ledger, the verdict and the block is in GiB (a headroom of 328 MiB stood beside GiB values)."""
    code, out, _ = run(capsys, *ISSUE_62, *extra)
    assert code == 0
    _, by_hand, _ = run(capsys, *ISSUE_62, "--checkpointing", "full", "--loss", "chunked", "--json")
    peak = json.loads(by_hand)["peak_bytes"]
    advice = _advice(out)
    numbered = [line for line in advice if line.lstrip()[:1].isdigit()]
    chunked = next(i for i, line in enumerate(numbered) if "loss in chunks" in line and "→ fits" in line)
    assert f"peak {peak / 2**30:,.2f} GiB" in numbered[chunked]
    assert all(chunked < i for i, line in enumerate(numbered) if "GPUs of this kind" in line)
    fits = [line.endswith("→ fits") for line in numbered]
    assert fits == sorted(fits, reverse=True)
    heading = next(i for i, line in enumerate(advice) if line.strip().startswith("Still over after the change"))
    assert all(not line.endswith("→ fits") for line in advice[heading:])
    assert len([line for line in out.splitlines() if line.startswith(("Peak ", "GPU ", "Verdict "))]) == 3
    sizes = re.findall(r"\d (B|KiB|MiB|GiB|TiB)\b", out.split("\nAssumptions", 1)[0])  # the ledger's rows too
    assert len(sizes) > 40 and set(sizes) == {"GiB"}
