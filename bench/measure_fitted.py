"""`memcalc measure` of the presets without a block model: real steps against the fitted ledger of what ran.

Each preset of a family memcalc has no block model for (Gemma 2 and 3, OLMo 2, Granite, the mixtures of experts) is
measured as `memcalc measure --preset NAME` does it on this machine: scaled down to fit 60 % of the free memory
and the time budget (fewer layers, smaller micro-batch, shorter sequence, smaller vocabulary), run for real with
transformers, and compared phase by phase with the fitted method's ledger of exactly that setup (calibrated for
the measured device's step; the first run of a preset calibrates, later ones read the cache). Target: every phase
within ±2 %.

    python bench/measure_fitted.py                  # every such preset, mixed precision, 1 × 512
    python bench/measure_fitted.py gemma-2-2b olmo-2-1b --precision bf16
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from memcalc_gui.core.errors import MemcalcError, one_line
from memcalc_gui.core.model import SUPPORTED_FAMILIES, preset_config, preset_names
from memcalc_gui.core.setup import TrainingSetup
from memcalc_gui.core.vocab import PHASES
from memcalc_gui.measure.engine import measure
from memcalc_gui.trace.meta import count_params_on_meta, supports_sdpa


def fitted_presets() -> list[str]:
    return [n for n in preset_names()
            if str(preset_config(n).get("model_type", "")).lower() not in SUPPORTED_FAMILIES]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("presets", nargs="*", help="presets to measure (default: every one without a block model)")
    parser.add_argument("--precision", default="mixed")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--time-budget", type=float, default=30.0)
    args = parser.parse_args()
    names = args.presets or fitted_presets()
    print(f"{'preset':<20} {'measured':<46} {'peak':>10} " + " ".join(f"{p[:8]:>8}" for p in PHASES)
          + f" {'seconds':>8}")
    worst = 0.0
    for name in names:
        cfg = preset_config(name)
        setup = TrainingSetup(params=count_params_on_meta(cfg), batch=args.batch, seq=args.seq,
                              precision=args.precision, attention="sdpa" if supports_sdpa(cfg) else "eager")
        t0 = time.perf_counter()
        try:
            r = measure(setup, device="cpu", time_budget_s=args.time_budget, config=cfg)
        except MemcalcError as exc:
            print(f"{name:<20} not measured: {one_line(exc, 120)}")
            continue
        seconds = time.perf_counter() - t0
        scaled = r.scale_note.removeprefix("Measured a scaled-down setup: ").split(";")[0] if r.scaled else "full"
        scaled = re.sub(r" instead of [\d,]*\d", "", scaled)
        if r.oom:
            print(f"{name:<20} {r.oom}")
            continue
        err = r.error_pct
        worst = max([worst, *(abs(v) for v in err.values())])
        print(f"{name:<20} {scaled[:46]:<46} {r.measured_peak_bytes / 2**30:>6.2f} GiB "
              + " ".join(f"{err.get(p, float('nan')):>+7.2f}%" for p in PHASES) + f" {seconds:>8.1f}")
    print(f"\nworst phase error: {worst:.2f}% (target ±2 %)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
