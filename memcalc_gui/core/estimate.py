"""One entry point for every front end: ``estimate(setup)`` picks the method and returns the ledger."""

from __future__ import annotations

from .analytic import estimate_analytic
from .errors import InputError
from .ledger import Estimate
from .quick import estimate_quick
from .setup import TrainingSetup


def default_method(setup: TrainingSetup) -> str:
    return "analytic" if setup.model is not None else "quick"


def estimate(setup: TrainingSetup, method: str | None = None) -> Estimate:
    """The phase ledger of ``setup`` by ``method`` (``quick`` or ``analytic``; default by the setup)."""
    method = method or default_method(setup)
    if method == "quick":
        return estimate_quick(setup)
    if method == "analytic":
        if setup.model is None:
            raise InputError("method", "analytic needs an architecture: give --preset or --config, not --params")
        return estimate_analytic(setup)
    if method == "trace":
        raise InputError("method", "the trace method runs outside the core (memcalc_gui.trace)")
    raise InputError("method", f"must be quick or analytic, got {method!r}")
