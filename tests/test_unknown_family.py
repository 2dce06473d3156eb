"""A config of a family memcalc has no block model for (OPT here): the CLI answers with the trace, exact, rather
than a heuristic off by up to several times; --method analytic says what to use instead."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memcalc_gui.cli import main as cli_main

pytest.importorskip("torch")
pytest.importorskip("transformers")

OPT = {"model_type": "opt", "hidden_size": 64, "ffn_dim": 128, "num_attention_heads": 4, "num_hidden_layers": 2,
       "vocab_size": 256, "max_position_embeddings": 512, "word_embed_proj_dim": 64}


@pytest.fixture()
def opt_config(tmp_path: Path) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(OPT))
    return str(path)


def test_an_unknown_family_is_fitted_by_default(opt_config: str, capsys: pytest.CaptureFixture[str],
                                                tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from memcalc_gui.measure.cpu_step import measure_training_step

    args = ["estimate", "--config", opt_config, "--batch", "2", "--seq", "64", "--optimizer-impl", "single-tensor",
            "--cuda-context", "0", "--allocator-reserve", "0", "--json"]
    monkeypatch.setenv("MEMCALC_CACHE_DIR", str(tmp_path / "fits"))
    assert cli_main(args) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["method"] == "fitted" and any("fake-tensor traces" in a for a in data["assumptions"])
    real = measure_training_step(OPT, batch=2, seq=64, precision="mixed", optimizer_impl="single-tensor")
    for phase in ("forward", "backward", "optimizer_step"):
        assert data["phases"][phase]["total_bytes"] == pytest.approx(real.phases[phase].peak_bytes, rel=0.005)
    assert cli_main([*args[:-1], "--method", "quick", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["method"] == "quick"


def test_analytic_on_an_unknown_family_names_the_alternatives(opt_config: str,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli_main(["estimate", "--config", opt_config, "--method", "analytic"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("memcalc: error: --method:") and "'opt' has no analytic block model" in err
    assert "--method fitted" in err and len(err.splitlines()) == 1


def test_an_unknown_family_across_gpus_falls_back_and_says_so(opt_config: str,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["estimate", "--config", opt_config, "--gpus", "4", "--strategy", "zero2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["method"] == "quick" and any("rough heuristic" in a for a in data["assumptions"])
    with pytest.raises(SystemExit) as exit_:
        cli_main(["estimate", "--config", opt_config, "--gpus", "4", "--method", "trace"])
    assert exit_.value.code == 2 and "runs one replica" in capsys.readouterr().err
