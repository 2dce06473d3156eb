"""Measuring a family without a block model: what the measured step is compared with, and how it is scaled down.

Such a family (Mixtral, Gemma 2, OLMo 2, a DeepSeek…) is estimated by the fitted method (:mod:`memcalc_gui.core.fitted`:
a few fake-tensor traces of the real transformers model). A measurement runs the same transformers model for real,
on the setup of the device it runs on, and compares it with the fitted ledger of exactly what it ran:

* the fit is calibrated for the measured step's signature (its precision, optimizer… and the device: a CPU step's
  dropout masks differ), from the cache when it was calibrated before;
* a scaled-down setup keeps the config's widths and cuts its layers: the fit's moments are traced at a few layer
  counts of the full config and extrapolated linearly, so the fit of the full config evaluated at the measured count
  is the fitted method's estimate of the shorter model (the count stays at or above the fit's first traced count, in
  step with the checkpointing period). Where the vocabulary must shrink too, that config is calibrated on its own.

torch and transformers are imported inside functions only.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from typing import Any

from ..core.configfile import LAYER_KEYS, transformers_kwargs, with_layers
from ..core.fitted import FitModel, estimate_fitted, evaluate_fitted, rank_signature, signature
from ..core.result import Result
from ..core.setup import TrainingSetup, checkpoint_every

#: Setup extras of a scaled-down fitted setup: the config the step runs, its layer count and vocabulary.
CONFIG_KEY = "measured_config"
#: Token ids a config names that a smaller vocabulary would not hold (transformers' embeddings check a padding id).
_TOKEN_KEYS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id")


def _count(cfg: dict[str, Any], keys: tuple[str, ...]) -> int:
    return next((int(cfg[k]) for k in keys if isinstance(cfg.get(k), int) and not isinstance(cfg.get(k), bool)), 0)


class FittedScaling:
    """A family without a block model as a measurement plans it: the config at a layer count and vocabulary, its
    parameter counts (transformers on the meta device), and the fitted estimate of each setup the plan weighs. Fits
    come from :func:`memcalc_gui.trace.fit.calibrate` (the cache first), ``progress`` told when one is traced."""

    def __init__(self, config: dict[str, Any], setup: TrainingSetup,
                 progress: Callable[[str], None] | None = None) -> None:
        model_type, kwargs = transformers_kwargs(config)  # no auto_map or location keys: nothing a config names runs
        self.config: dict[str, Any] = {"model_type": model_type, **kwargs}
        self.model_type = model_type
        self.layers = _count(self.config, LAYER_KEYS)
        self.vocab = _count(self.config, ("vocab_size",))
        if self.layers < 1 or self.vocab < 1:
            from ..core.errors import ConfigError

            raise ConfigError("num_hidden_layers" if self.layers < 1 else "vocab_size",
                              "the config needs a layer count and a vocabulary size to be measured")
        self.period = checkpoint_every(setup.checkpointing) or 1
        #: pipeline stages split the layers evenly: a scaled-down step keeps a multiple of the stage-chunks (of the
        #: layout measured, which :meth:`min_layers` is asked with)
        self.stages = setup.parallel.pp * setup.parallel.virtual_stages
        self._progress = progress
        self._fits: dict[tuple[int, str], FitModel] = {}
        self._structures: dict[tuple[int, int], dict[str, int]] = {}
        self._min_layers: int | None = None
        self.traced = False  # the fit does not apply (too few layers to extrapolate from): each setup is traced

    # ---- configs and counts ------------------------------------------------------------------------------------
    def config_for(self, layers: int, vocab: int) -> dict[str, Any]:
        """The config cut to ``layers`` layers (with its per-layer lists) and ``vocab`` tokens; token ids the
        smaller vocabulary does not hold are dropped (random weights: no id means anything)."""
        cfg = with_layers(self.config, layers) if layers != self.layers else dict(self.config)
        if vocab != self.vocab:
            cfg["vocab_size"] = vocab
            for key in _TOKEN_KEYS:
                value = cfg.get(key)
                if isinstance(value, int) and value >= vocab:
                    cfg[key] = None
                elif isinstance(value, list):
                    kept = [v for v in value if isinstance(v, int) and v < vocab]
                    cfg[key] = kept or None
        return cfg

    def structure(self, layers: int, vocab: int) -> dict[str, int]:
        """The counts of the config at ``layers`` and ``vocab`` (transformers on the meta device): its parameters,
        those one token uses, and the unit sizes a per-GPU budget needs."""
        key = (layers, vocab)
        if key not in self._structures:
            from ..trace.meta import structure_on_meta

            self._structures[key] = structure_on_meta(self.config_for(layers, vocab))
        return self._structures[key]

    def counts(self, layers: int, vocab: int) -> tuple[int, int]:
        """(parameters, those one token uses) of the config at ``layers`` and ``vocab``."""
        st = self.structure(layers, vocab)
        return st["num_params"], st["active_params"]

    def setup(self, base: TrainingSetup, layers: int, vocab: int) -> TrainingSetup:
        """``base`` (its shape and choices) for the config at ``layers`` and ``vocab``: its parameter count, and the
        config in its extras (a new dict: a setup's extras are shared by its copies)."""
        n, active = self.counts(layers, vocab)
        extras = {**base.extras, CONFIG_KEY: self.config_for(layers, vocab), "measured_layers": layers,
                  "measured_vocab": vocab, "active_params": active}
        return base.with_changes(params=n, extras=extras)

    @staticmethod
    def scaled(setup: TrainingSetup) -> tuple[int, int] | None:
        """(layers, vocab) of a setup :meth:`setup` made, ``None`` for another."""
        layers, vocab = setup.extras.get("measured_layers"), setup.extras.get("measured_vocab")
        return (layers, vocab) if isinstance(layers, int) and isinstance(vocab, int) else None

    def min_layers(self, setup: TrainingSetup) -> int:
        """The fewest layers a scaled-down step keeps: the fit's first traced count (past DeepSeek's dense layers,
        a whole checkpointing period; an FSDP2 rank's fit's, deeper), or the config's own count when it has fewer."""
        if self._min_layers is None:
            self.stages = setup.parallel.pp * setup.parallel.virtual_stages
            fit = self._fit_or_none(setup, self.vocab)
            if fit is not None and fit.stages:
                # a pipeline rank's fit traces stage-chunks of its first count on (a chunk shallower than
                # trace.fit.PIPELINE_LAYERS at its own depth only): that many layers in every chunk
                first = self.stages * max(st.layers[0] for st in fit.stages.values())
            else:
                # one FSDP2 rank's fit traces deeper models (trace.fit.rank_layer_counts): below them it would not hold
                first = 0 if fit is None else max(fit.layers[0], fit.rank.layers[0] if fit.rank is not None else 0)
            self._min_layers = self.layers if fit is None else min(self.layers, first)
        return self._min_layers

    def fewer_layers(self, layers: int, floor: int) -> int:
        """Half of ``layers``, at least ``floor``, with the full count's remainder modulo the checkpointing period
        (the fit extrapolates by whole periods)."""
        target = max(floor, layers // 2)
        step = math.lcm(self.period, self.stages)  # (a pipeline's fit refuses checkpointing every N-th layer)
        return max(floor, target - (target - floor) % step)

    # ---- the fitted estimate ----------------------------------------------------------------------------------
    def fit(self, setup: TrainingSetup, vocab: int) -> FitModel:
        """The fit of the full-depth config at ``vocab`` for ``setup``'s signature (calibrated once per vocabulary)."""
        key = (vocab, json.dumps([signature(setup), rank_signature(setup)], sort_keys=True, default=str))
        if key not in self._fits:
            cfg = self.config_for(self.layers, vocab)
            probe = setup.with_changes(params=self.counts(self.layers, vocab)[0])
            self._fits[key] = _calibrate(cfg, probe, self._progress)
        return self._fits[key]

    def _fit_or_none(self, setup: TrainingSetup, vocab: int) -> FitModel | None:
        """:meth:`fit`, or ``None`` where the fitted method does not apply (a config too short to extrapolate from,
        a fit its check refused): the setup is then traced whole, as ``memcalc estimate`` does."""
        from ..trace.fit import FitError

        try:
            return self.fit(setup, vocab)
        except FitError:
            self.traced = True
            return None

    def _fit_at(self, setup: TrainingSetup) -> FitModel | None:
        scaled = self.scaled(setup)
        layers, vocab = scaled if scaled is not None else (self.layers, self.vocab)
        fit = self._fit_or_none(setup, vocab)
        if fit is None:
            return None
        # the shorter model: the same moments at its layer count, its own unit sizes for a per-GPU budget (the fit of
        # one FSDP2 rank, when there is one, likewise)
        structure = self.structure(layers, vocab)

        def shorter(f: FitModel, depth: int = layers) -> FitModel:
            return dataclasses.replace(f, num_layers=depth, num_params=setup.num_params, structure=structure)

        # a pipeline rank's fit at the shorter model's stage-chunks
        chunks = setup.parallel.pp * setup.parallel.virtual_stages
        stages = {r: shorter(st, layers // chunks) for r, st in fit.stages.items()}
        return dataclasses.replace(shorter(fit), rank=shorter(fit.rank) if fit.rank is not None else None,
                                   stages=stages)

    def _traced(self, setup: TrainingSetup) -> Result:
        from ..trace.fake import trace_estimate

        config = setup.extras.get(CONFIG_KEY)
        return trace_estimate(setup, config=config if isinstance(config, dict) else self.config).result(None)

    def peak_bytes(self, setup: TrainingSetup) -> int:
        """The fitted tensor peak of ``setup`` (a plan's candidate)."""
        unbounded = setup.with_changes(capacity_bytes=None)
        fit = self._fit_at(setup)
        if fit is None:
            return self._traced(unbounded).estimate.peak_tensor_bytes
        return estimate_fitted(unbounded, fit).peak_tensor_bytes

    def result(self, setup: TrainingSetup) -> Result:
        """The fitted result of ``setup`` (what the measurement is compared with): its ledger from the fit at the
        measured layer count, the what-ifs weighing that fit alone; or the trace of the setup where no fit applies."""
        fit = self._fit_at(setup)
        if fit is None:
            return self._traced(setup)
        return evaluate_fitted(setup.with_changes(extras=dict(setup.extras)), fit)


def _calibrate(config: dict[str, Any], setup: TrainingSetup, progress: Callable[[str], None] | None = None) -> FitModel:
    """:func:`memcalc_gui.trace.fit.calibrate`, saying first what it fits when it will trace."""
    from ..trace.fit import cached_fit, calibrate

    if progress is not None and cached_fit(config, setup) is None:
        device = "GPU" if setup.target_device == "cuda" else "CPU"
        vocab = config.get("vocab_size")
        progress(f"fitting the estimate of the {device} step at a vocabulary of {vocab:,}" if isinstance(vocab, int)
                 else f"fitting the estimate of the {device} step")
    # one rank of an FSDP2 layout is fitted from traces of that rank (core.fitted.rank_layout), DDP's by rule
    return calibrate(config, setup, setup.num_params, progress=progress, rank=setup.parallel.is_distributed)
