"""The ``memcalc`` command: the same engine as the window, as text or JSON.

Every invalid input prints one line naming the field and exits with status 2 (no traceback).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from . import __version__, install_hint
from .core.configfile import code_keys, routed_experts
from .core.distributed import (
    MAX_PARALLEL_GPUS,
    OFFLOADS,
    SCHEDULES,
    STRATEGIES,
    Parallelism,
    chosen_loss_parallel,
)
from .core.errors import InputError, MemcalcError, UnsupportedFamilyError, one_line
from .core.files import check_output
from .core.finetune import ADAPTER_DTYPES, MAX_RANK, QUANTS, TUNINGS, FineTuning
from .core.model import (
    LITE_NOTE,
    ModelSpec,
    load_config_file,
    preset_config,
    preset_info,
    preset_names,
    preset_source,
    spec_from_config,
    stored_count,
)
from .core.result import Result, evaluate
from .core.setup import (
    ACTIVATION_OFFLOADS,
    ATTENTIONS,
    DEFAULT_ALLOCATOR_RESERVE,
    DEFAULT_CUDA_CONTEXT_BYTES,
    LIMITS,
    LOSSES,
    OPTIMIZER_IMPLS,
    OPTIMIZERS,
    PRECISIONS,
    TARGET_DEVICES,
    TrainingSetup,
    find_gpu,
    gpu_presets,
)
from .core.units import format_bytes, format_count, parse_count, parse_positive_int, parse_size
from .core.vocab import OBJECT_LABELS, OBJECTS, PHASE_LABELS, PHASES
from .measure.engine import MAX_ITERATIONS
from .view.plan_text import (
    ADVICE_ORDER,
    STILL_OVER_HEADING,
    first_still_over,
    plan_sentences,
    suggestion_figures,
    suggestions_note,
)

EXIT_INPUT = 2
EXIT_INTERRUPTED = 130
#: Set to 1 to let unexpected errors raise with their traceback (for debugging memcalc itself).
DEBUG_ENV = "MEMCALC_DEBUG"

#: Setup field → the flag a user typed (errors name what the user can change).
FLAGS = {
    "batch": "--batch",
    "seq": "--seq",
    "grad_accum": "--grad-accum",
    "precision": "--precision",
    "optimizer": "--optimizer",
    "optimizer_impl": "--optimizer-impl",
    "attention": "--attention",
    "checkpointing": "--checkpointing",
    "loss": "--loss",
    "loss_chunk": "--loss-chunk-size",
    "optimizer_in_backward": "--optimizer-in-backward",
    "activation_offload": "--activation-offload",
    "packing": "--packing",
    "tokens_per_batch": "--tokens-per-batch",
    "galore_rank": "--galore-rank",
    "snapshot": "--snapshot",
    "snapshot_out": "--snapshot-out",
    "capacity": "--capacity",
    "gpu": "--gpu",
    "params": "--params",
    "preset": "--preset",
    "config": "--config",
    "cuda_context": "--cuda-context",
    "allocator_reserve": "--allocator-reserve",
    "method": "--method",
    "iterations": "--iterations",
    "device": "--device",
    "time_budget": "--time-budget",
    "full_size": "--full-size",
    "model": "--preset/--config",
    "out": "--out",
    "page": "--page",
    "gpus": "--gpus",
    "strategy": "--strategy",
    "node_size": "--node-size",
    "offload": "--offload",
    "ep": "--ep",
    "etp": "--etp",
    "tp": "--tp",
    "pp": "--pp",
    "cp": "--cp",
    "schedule": "--schedule",
    "virtual_stages": "--virtual-stages",
    "sp": "--sp",
    "loss_parallel": "--loss-parallel",
    "stage": "--stage",
    "top": "--top",
    "reshard_after_forward": "--reshard-after-forward",
    "dp_replicate": "--dp-replicate",
    "tuning": "--tuning",
    "lora_rank": "--lora-rank",
    "lora_targets": "--lora-targets",
    "lora_dropout": "--lora-dropout",
    "adapter_dtype": "--adapter-dtype",
    "quant": "--quant",
    "double_quant": "--double-quant",
    "prepare_kbit": "--prepare-kbit",
    "trainable": "--trainable",
    "target_device": "--target-device",
    "model_id": "--model",
    "revision": "--revision",
    "router_logits": "--router-logits",
}


class _Parser(argparse.ArgumentParser):
    """argparse that reports errors in one line and exits 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_INPUT, f"memcalc: error: {one_line(message)}\n")


def _add_model_args(p: argparse.ArgumentParser, *, params: bool = True) -> None:
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--preset", metavar="NAME", help="built-in model preset (see `memcalc presets`)")
    group.add_argument("--config", metavar="PATH", help="a Hugging Face config.json")
    group.add_argument("--model", metavar="ORG/NAME",
                       help="a Hugging Face Hub id (or a local model folder): config.json from the local cache, "
                            "else from the Hub")
    p.add_argument("--revision", metavar="REV", help="with --model: a branch, tag or commit (default main)")
    p.add_argument("--router-logits", choices=("on", "off"), default=None,
                   help="mixture of experts: output_router_logits (router logits kept and the auxiliary load-balancing "
                        "loss computed, as transformers does when it is on; default: the config's)")
    if params:
        group.add_argument("--params", metavar="N", help="parameters only (1.5B, 350M, 1.5e9): rough heuristic")


def _add_setup_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch", default="1", metavar="N", help="micro-batch size (default 1)")
    p.add_argument("--seq", default="512", metavar="N", help="sequence length in tokens (default 512)")
    p.add_argument("--grad-accum", default="1", metavar="N", help="gradient accumulation steps (default 1)")
    p.add_argument("--precision", default="mixed", choices=PRECISIONS, help="default mixed")
    p.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS, type=lambda v: v.strip().replace("_", "-"),
                   help="default adamw (Transformers' spellings such as paged_adamw_8bit work too)")
    p.add_argument("--galore-rank", metavar="R", default=None,
                   help="with --optimizer galore-adamw: GaLore's projection rank (default 128, Trainer's)")
    p.add_argument("--optimizer-impl", default="foreach", choices=OPTIMIZER_IMPLS,
                   help="step implementation (default foreach, as torch on CUDA)")
    p.add_argument("--attention", default=None, choices=ATTENTIONS,
                   help="default sdpa (eager for a family transformers runs without SDPA); flash: transformers' "
                        "flash_attention_2 (FlashAttention-2, variable-length over packed documents; 16-bit only)")
    p.add_argument("--checkpointing", default="none", metavar="none|full|selective|every:N",
                   help="gradient checkpointing: none, every decoder layer (full), every layer keeping its matmul and "
                        "attention outputs (selective: torchtitan's per-op policy), or every N-th layer (every:2 keeps "
                        "every other layer's activations: torchtitan's selective layer checkpointing)")
    p.add_argument("--loss", default="full", choices=LOSSES,
                   help="full: transformers' loss over the whole logits; chunked: a fused linear cross-entropy "
                        "(Liger-Kernel's), the logits made a chunk of tokens at a time")
    p.add_argument("--optimizer-in-backward", action="store_true",
                   help="step each parameter in backward as soon as its gradient is ready, and free the gradient "
                        "(PyTorch's recipe, torchtune's optimizer_in_bwd; no gradient accumulation)")
    p.add_argument("--activation-offload", default="none", choices=ACTIVATION_OFFLOADS,
                   help="keep saved activations in host memory: checkpoint-inputs (with --checkpointing full: each "
                        "layer's input, torchtune's OffloadActivations) or all (every saved tensor, weights "
                        "included: torch.autograd.graph.save_on_cpu)")
    p.add_argument("--packing", action="store_true",
                   help="padding-free packing (transformers' DataCollatorWithFlattening, TRL's padding_free): the "
                        "micro-batch's documents of at most --seq tokens in one row, positions restarting at each, "
                        "attention within each document")
    p.add_argument("--tokens-per-batch", metavar="N", default=None,
                   help="with --packing: real tokens per micro-batch (default batch × seq; e.g. batch × your mean "
                        "document length)")
    p.add_argument("--loss-chunk-size", metavar="ROWS", default=None,
                   help="with --loss chunked: tokens per chunk (default Liger's rule, about T·H/V)")
    ft = p.add_argument_group("fine-tuning (peft LoRA, QLoRA with bitsandbytes, frozen parts)")
    ft.add_argument("--tuning", default="full", choices=TUNINGS,
                    help="full (default), lora, qlora (LoRA on a 4-/8-bit base) or frozen (only --trainable trains)")
    ft.add_argument("--lora-rank", metavar="R", default="16", help="LoRA rank r (default 16)")
    ft.add_argument("--lora-targets", metavar="LIST", default="all-linear",
                    help="all-linear (default; not the output head, as peft), attention, mlp, or modules: "
                         "q,k,v,o,gate,up,down or names such as q_proj,v_proj")
    ft.add_argument("--lora-dropout", metavar="P", default="0.05", help="LoRA dropout (default 0.05)")
    ft.add_argument("--adapter-dtype", default="fp32", choices=ADAPTER_DTYPES,
                    help="adapter weights (peft keeps fp32 by default)")
    ft.add_argument("--quant", default="nf4", choices=QUANTS, help="QLoRA base quantization (default nf4)")
    ft.add_argument("--no-double-quant", dest="double_quant", action="store_false",
                    help="QLoRA without double quantization of the 4-bit scales")
    ft.add_argument("--prepare-kbit", default=True, action=argparse.BooleanOptionalAction,
                    help="QLoRA: peft's prepare_model_for_kbit_training casts embeddings, norms and the output head "
                         "to fp32 (default on; --no-prepare-kbit keeps the precision's dtype)")
    ft.add_argument("--trainable", metavar="LIST", default="",
                    help="with --tuning frozen: what trains, e.g. last:4,norms,lm_head,embeddings")
    p.add_argument("--target-device", default="cuda", choices=TARGET_DEVICES,
                   help="the device the ledger models (cpu: dropout masks in the input dtype; default cuda)")
    p.add_argument("--use-cache", action="store_true",
                   help="the loop leaves the config's use_cache=True (transformers' DynamicCache copies k/v in "
                        "forward); default: use_cache=False, as Trainer passes")
    cap = p.add_mutually_exclusive_group()
    cap.add_argument("--gpu", metavar="NAME", help="GPU preset (see `memcalc presets`)")
    cap.add_argument("--capacity", metavar="SIZE", help="GPU memory: 80GiB, 80GB or 24e9 bytes")
    p.add_argument("--cuda-context", metavar="SIZE", default=None,
                   help=f"CUDA context outside PyTorch (default {format_bytes(DEFAULT_CUDA_CONTEXT_BYTES)})")
    p.add_argument("--allocator-reserve", metavar="FRACTION", default=None,
                   help="cached-but-unusable memory as a fraction of tensor bytes "
                        f"(default {DEFAULT_ALLOCATOR_RESERVE})")
    p.add_argument("--gpus", default="1", metavar="N",
                   help="GPUs in all (default 1): tp × data-parallel replicas; the ledger is per GPU")
    p.add_argument("--strategy", default="ddp", choices=STRATEGIES, help="how the model state is sharded")
    p.add_argument("--node-size", default="8", metavar="N", help="GPUs per node (fsdp-hybrid, host memory)")
    p.add_argument("--offload", default="none", choices=OFFLOADS, help="offload to CPU (ZeRO-Offload, FSDP CPUOffload)")
    p.add_argument("--reshard-after-forward", default="on", choices=("on", "off"),
                   help="with --strategy fsdp2: free each layer's gathered weights after its forward (on, the "
                        "default) or keep them until its backward (off: less communication, more memory)")
    p.add_argument("--dp-replicate", default="1", metavar="N",
                   help="with --strategy fsdp2: hybrid sharding (HSDP, torchtitan's data_parallel_replicate_degree): "
                        "the data-parallel GPUs form N replicas, each fully_shard-ed over its share (default 1: one "
                        "group over all of them)")
    p.add_argument("--ep", default="1", metavar="N",
                   help="expert parallelism: a mixture of experts' routed experts split over N of the GPUs (default 1)")
    p.add_argument("--etp", default="1", metavar="N",
                   help="expert tensor parallelism, Megatron-LM's --expert-tensor-parallel-size: each routed expert's "
                        "weights split over N GPUs besides --ep (with --strategy megatron or megatron-distopt; "
                        "default 1, every expert whole)")
    p.add_argument("--tp", default="1", metavar="N",
                   help="tensor parallelism: each layer's heads and MLP split over N GPUs as transformers' plans split "
                        "them (default 1); the strategy runs over the GPUs / N data-parallel replicas")
    p.add_argument("--sp", action="store_true",
                   help="sequence parallelism beside --tp: norms and the residual stream split along the sequence "
                        "(Korthikanti et al. 2022, as Megatron-LM runs it)")
    p.add_argument("--loss-parallel", action=argparse.BooleanOptionalAction, default=None,
                   help="beside --tp: the embedding's rows, the head's columns and the loss split over the tensor-"
                        "parallel GPUs (torchtitan's loss parallel, Megatron-LM's vocab-parallel cross-entropy). "
                        "Default: always under megatron and megatron-distopt (Megatron-LM has no other way), on under "
                        "fsdp2 (torchtitan's default), off under ddp, zero and fsdp1 (transformers' plans); "
                        "--no-loss-parallel keeps the embedding and head whole on every GPU (transformers' plan)")
    p.add_argument("--cp", default="1", metavar="N",
                   help="context parallelism: each sequence split over N GPUs, attention as ring attention "
                        "(torchtitan's context_parallel; default 1); the state is sharded over data × context ranks")
    p.add_argument("--pp", default="1", metavar="N",
                   help="pipeline parallelism: the decoder layers split into N stages on as many GPUs (default 1); "
                        "the step's micro-batches are --grad-accum; the ledger is the most loaded stage's")
    p.add_argument("--schedule", default="1f1b", choices=SCHEDULES,
                   help="pipeline schedule with --pp (torch.distributed.pipelining's ScheduleGPipe, Schedule1F1B, "
                        "ScheduleInterleaved1F1B, and the zero-bubble ScheduleInterleavedZeroBubble and "
                        "ScheduleZBVZeroBubble; default 1f1b)")
    p.add_argument("--virtual-stages", default="1", metavar="V",
                   help="stages per GPU under --schedule interleaved-1f1b (2 or more), interleaved-zb (1 or more) "
                        "or zbv (exactly 2)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="memcalc", description="GPU memory of one training step, phase by phase.")
    parser.add_argument("--version", action="version", version=f"memcalc {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    est = sub.add_parser("estimate", help="estimate the memory of one training step")
    _add_model_args(est)
    _add_setup_args(est)
    est.add_argument("--method", choices=("quick", "analytic", "fitted", "trace"), default=None,
                     help="quick (seed heuristic), analytic (default for an architecture), fitted (default for a "
                          "family without a block model: small fake-tensor traces of the real model, evaluated for "
                          "this shape) or trace (the real step on fake tensors); fitted and trace need torch and "
                          "transformers")
    est.add_argument("--json", action="store_true", help="print one JSON object (schema 1)")
    est.add_argument("--snapshot-out", metavar="FILE",
                     help="with --method trace: write the predicted allocations and frees as a memory snapshot "
                          "pickle (open it at pytorch.org/memory_viz, or with python -m torch.cuda._memory_viz)")

    rec = sub.add_parser("reconcile", help="compare a real CUDA memory snapshot with the estimate, phase by phase")
    _add_model_args(rec, params=False)
    _add_setup_args(rec)
    rec.add_argument("--snapshot", required=True, metavar="FILE",
                     help="a torch.cuda.memory._dump_snapshot pickle (read without running any code), or a "
                          "torch.profiler memory timeline (export_memory_timeline JSON)")
    rec.add_argument("--device", type=int, default=None, metavar="N",
                     help="the device trace to read (default: the one with the most events)")
    rec.add_argument("--json", action="store_true", help="print one JSON object")

    mea = sub.add_parser("measure", help="run a real training step on this machine and compare with the estimate")
    _add_model_args(mea, params=False)
    _add_setup_args(mea)
    mea.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    mea.add_argument("--iterations", default="3", metavar="N",
                     help=f"training iterations (2–{MAX_ITERATIONS}; default 3)")
    mea.add_argument("--snapshot", metavar="PATH", help="CUDA memory snapshot pickle (opens at pytorch.org/memory_viz)")
    mea.add_argument("--full-size", action="store_true", help="never scale the setup down")
    mea.add_argument("--time-budget", default="30", metavar="SECONDS", help="plan a measurement this long at most")
    mea.add_argument("--json", action="store_true")

    rep = sub.add_parser("report", help="write the estimate as a PDF or PNG report")
    _add_model_args(rep)
    _add_setup_args(rep)
    rep.add_argument("--method", choices=("quick", "analytic"), default=None,
                     help="quick (seed heuristic) or analytic (default: analytic for an architecture, the fitted "
                          "method for a family memcalc has no block model of, as `estimate` does)")
    rep.add_argument("--out", required=True, metavar="FILE",
                     help="report.pdf (A4/Letter, selectable text) or report.png (1600×1000, for a slide or chat)")
    rep.add_argument("--snapshot", metavar="FILE", default=None,
                     help="a memory snapshot or profiler timeline (or memcalc's --snapshot-out) drawn as a "
                          "\"Memory over time\" figure (in a PDF, or a strip below a PNG's 1600×1000)")
    rep.add_argument("--page", choices=("a4", "letter"), default=None,
                     help="PDF paper size (default from the locale: Letter in the US, Canada, Mexico, …; else A4)")

    lay = sub.add_parser("layouts", help="every tensor × pipeline × data-parallel split of --gpus, the most loaded "
                                         "GPU's peak and whether it fits, ranked (docs/parallelism.md)")
    _add_model_args(lay, params=False)
    _add_setup_args(lay)
    lay.add_argument("--top", default="15", metavar="N", help="print the best N layouts (default 15; 0: all)")
    lay.add_argument("--cached-only", action="store_true",
                     help="a family memcalc has no block model of: search only the layouts whose calibrations are "
                          "cached (at once), rather than calibrating each tensor-parallel degree and step precision "
                          "first (seconds to minutes, once)")
    lay.add_argument("--json", action="store_true", help="print one JSON object")

    pre = sub.add_parser("presets", help="list model and GPU presets")
    pre.add_argument("--json", action="store_true")
    return parser


def _fail(message: str) -> NoReturn:
    _say(f"memcalc: error: {one_line(message)}")
    raise SystemExit(EXIT_INPUT)


def _say(line: str) -> None:
    """One line on stderr; a closed or full stderr is not worth a traceback."""
    with contextlib.suppress(OSError, ValueError):
        print(line, file=sys.stderr, flush=True)


class _OutputError(Exception):
    """Writing to stdout failed (a full disk, a closed pipe)."""


def _out(text: str = "") -> None:
    """Print ``text`` to stdout; failures become :class:`_OutputError` (one line, exit 2)."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        raise
    except OSError as exc:
        raise _OutputError(exc.strerror or str(exc)) from None


def _field_error(exc: InputError) -> NoReturn:
    _fail(f"{FLAGS.get(exc.field, exc.field)}: {exc.reason}")


def resolve_model(args: argparse.Namespace) -> tuple[ModelSpec | None, int | None, list[str]]:
    """The model from --preset/--config/--params; unknown families fall back to a meta-device count."""
    notes: list[str] = []
    if getattr(args, "params", None) is not None:
        return None, parse_count(args.params, "params"), notes
    name = ""
    if args.preset is not None:
        name = args.preset.strip().lower()
        cfg = preset_config(name)
        source = preset_source(name, cfg)
    elif getattr(args, "model", None) is not None:
        from .hub import resolve_config

        found = resolve_config(args.model, getattr(args, "revision", None))
        cfg, source, name = found.config, found.source, found.repo_id
    else:
        cfg, source = load_config_file(args.config), str(Path(args.config))
    router = getattr(args, "router_logits", None)
    if router is not None:
        if not routed_experts(cfg):
            raise InputError("router_logits", f"model_type {str(cfg.get('model_type'))[:40]!r} has no router (not a "
                                              "mixture of experts)")
        cfg = dict(cfg, output_router_logits=router == "on")
    dropped = code_keys(cfg)
    if dropped:
        notes.append(f"{', '.join(dropped)} ignored: memcalc builds the model classes transformers ships for "
                     f"model_type {str(cfg.get('model_type'))[:40]!r} and never runs code a config names")
    try:
        return spec_from_config(cfg, name=name, source=source), None, notes
    except UnsupportedFamilyError:
        from .trace.meta import count_params_and_active_on_meta, supports_sdpa, transformers_available

        if not transformers_available():
            stored = stored_count(cfg)
            if stored is None:
                raise
            notes.append(LITE_NOTE.format(family=str(cfg.get("model_type"))[:40]))
            return None, stored, notes
        n, active = count_params_and_active_on_meta(cfg)
        if active != n:
            args.active_params = active
            notes.append(f"mixture of experts: {active:,} of the {n:,} parameters are used per token (the routed "
                         "experts count top-k / experts of their size)")
        args.unknown_config = cfg  # the trace runs this config (setup.model stays None: no analytic block model)
        if getattr(args, "attention", "sdpa") is None and not supports_sdpa(cfg):
            args.attention = "eager"
            notes.append(f"eager attention: transformers has no SDPA attention for model_type "
                         f"{str(cfg.get('model_type'))[:40]!r}")
        notes.append(f"model_type {cfg.get('model_type')!r} has no analytic block model: exact parameter "
                     "count from transformers on the meta device")
        return None, n, notes


def setup_from_args(args: argparse.Namespace) -> tuple[TrainingSetup, list[str]]:
    """Validate every flag into a :class:`TrainingSetup` (InputError names the field)."""
    model, params, notes = resolve_model(args)
    kw: dict[str, Any] = dict(
        model=model,
        params=params,
        batch=parse_positive_int(args.batch, "batch", LIMITS["batch"]),
        seq=parse_positive_int(args.seq, "seq", LIMITS["seq"], tokens=True),
        grad_accum=parse_positive_int(args.grad_accum, "grad_accum", LIMITS["grad_accum"]),
        precision=args.precision,
        optimizer=args.optimizer,
        optimizer_impl=args.optimizer_impl,
        attention=args.attention or "sdpa",
        checkpointing=args.checkpointing,
        use_cache=bool(getattr(args, "use_cache", False)),
        loss=getattr(args, "loss", "full"),
        optimizer_in_backward=bool(getattr(args, "optimizer_in_backward", False)),
        activation_offload=getattr(args, "activation_offload", "none"),
        loss_chunk=None if getattr(args, "loss_chunk_size", None) is None
        else parse_positive_int(args.loss_chunk_size, "loss_chunk", LIMITS["seq"] * LIMITS["batch"]),
        packing=bool(getattr(args, "packing", False)),
        galore_rank=128 if getattr(args, "galore_rank", None) is None
        else parse_positive_int(args.galore_rank, "galore_rank", 65_536),
        tokens_per_batch=None if getattr(args, "tokens_per_batch", None) is None
        else parse_positive_int(args.tokens_per_batch, "tokens_per_batch", LIMITS["seq"] * LIMITS["batch"],
                                tokens=True),
        tuning=tuning_from_args(args),
        target_device=getattr(args, "target_device", "cuda"),
    )
    if getattr(args, "galore_rank", None) is not None and args.optimizer != "galore-adamw":
        raise InputError("galore_rank", "a GaLore rank needs the GaLore optimizer (--optimizer galore-adamw)")
    if args.gpu:
        gpu = find_gpu(args.gpu)
        kw.update(gpu=gpu.id, capacity_bytes=gpu.capacity_bytes)
    elif args.capacity:
        kw.update(capacity_bytes=parse_size(args.capacity, "capacity"))
    gpus = parse_positive_int(args.gpus, "gpus", MAX_PARALLEL_GPUS)  # (each field checked in the flags' order)
    node_size = parse_positive_int(args.node_size, "node_size", MAX_PARALLEL_GPUS)
    ep = parse_positive_int(getattr(args, "ep", "1"), "ep", MAX_PARALLEL_GPUS)
    etp = parse_positive_int(getattr(args, "etp", "1"), "etp", MAX_PARALLEL_GPUS)
    tp = parse_positive_int(getattr(args, "tp", "1"), "tp", MAX_PARALLEL_GPUS)
    # the vocabulary split: as said, else the strategy's default (always under Megatron-LM, on under FSDP2)
    loss_parallel = chosen_loss_parallel(getattr(args, "loss_parallel", None), args.strategy, tp,
                                         block_model=model is not None)
    kw["parallel"] = Parallelism(gpus=gpus, strategy=args.strategy, offload=args.offload, node_size=node_size,
                                 ep=ep, etp=etp, tp=tp,
                                 pp=parse_positive_int(getattr(args, "pp", "1"), "pp", MAX_PARALLEL_GPUS),
                                 cp=parse_positive_int(getattr(args, "cp", "1"), "cp", MAX_PARALLEL_GPUS),
                                 schedule=getattr(args, "schedule", "1f1b"),
                                 virtual_stages=parse_positive_int(getattr(args, "virtual_stages", "1"),
                                                                   "virtual_stages", MAX_PARALLEL_GPUS),
                                 sp=bool(getattr(args, "sp", False)),
                                 loss_parallel=loss_parallel,
                                 reshard_after_forward=getattr(args, "reshard_after_forward", "on") == "on",
                                 dp_replicate=parse_positive_int(getattr(args, "dp_replicate", "1"), "dp_replicate",
                                                                 MAX_PARALLEL_GPUS))
    if args.cuda_context is not None:
        kw["cuda_context_bytes"] = parse_size(args.cuda_context, "cuda_context", allow_zero=True)
    if args.allocator_reserve is not None:
        try:
            kw["allocator_reserve"] = float(str(args.allocator_reserve))
        except ValueError:
            raise InputError("allocator_reserve",
                             f"must be a fraction such as 0.1, got {args.allocator_reserve!r}") from None
    return TrainingSetup(**kw), notes


def tuning_from_args(args: argparse.Namespace) -> FineTuning:
    """The ``--tuning`` group as a FineTuning (errors name the flag's field)."""
    method = getattr(args, "tuning", "full")
    if method == "full":
        return FineTuning()
    try:
        dropout = float(str(args.lora_dropout))
    except ValueError:
        raise InputError("lora_dropout", f"must be a probability such as 0.05, got {args.lora_dropout!r}") from None
    targets = tuple(t.strip() for t in str(args.lora_targets).split(",") if t.strip())
    trainable = tuple(t.strip() for t in str(args.trainable).split(",") if t.strip())
    return FineTuning(method=method, rank=parse_positive_int(args.lora_rank, "lora_rank", MAX_RANK),
                      targets=targets, dropout=dropout, adapter_dtype=args.adapter_dtype, quant=args.quant,
                      double_quant=bool(args.double_quant), trainable=trainable,
                      prepare_kbit=bool(getattr(args, "prepare_kbit", True)))


def format_ledger(result: Result) -> str:
    """The ledger as a readable table, with the verdict and what to change: every size in the result's one unit
    (``Result.unit``: the window's ledger, chart and cards use the same)."""
    est, verdict, setup = result.estimate, result.verdict, result.setup
    size = result.size
    lines: list[str] = []
    if setup.model is not None:
        m = setup.model
        lines.append(f"Model      {m.name} — {m.family}, {m.num_params:,} parameters ({format_count(m.num_params)})")
        lines.append(f"Source     {m.source or 'config.json'}")
    else:
        kind = setup.extras.get("model_type")
        what = f"model_type {kind!r} (no analytic block model)" if kind else "no architecture"
        if "active_params" in setup.extras:
            what += f"; {setup.extras['active_params']:,} active per token"
        lines.append(f"Model      {setup.num_params:,} parameters ({format_count(setup.num_params)}), {what}")
    lines.append(f"Setup      micro-batch {setup.batch} × seq {setup.seq} × accumulation {setup.grad_accum} "
                 f"(effective batch {setup.effective_batch}); {setup.precision}; {setup.optimizer} "
                 f"({setup.optimizer_impl}); {setup.attention} attention; checkpointing {setup.checkpointing}"
                 + ("; use_cache=True" if setup.use_cache else ""))
    if setup.packing:
        lines.append(f"Packing    {setup.packing_text()} (padding-free)")
    if setup.tuning.method != "full":
        lines.append(f"Tuning     {setup.tuning_text()}")
    par = setup.parallel
    if par.is_distributed:
        lines.append(f"GPUs       {par.gpus} × {par.strategy}" + (f", offload {par.offload}" if par.offload != "none"
                                                                 else "")
                     + ("" if par.reshard_after_forward else ", not resharded after forward")
                     + (f", experts split over {par.ep} (expert parallelism)" if par.ep > 1 else "")
                     + (f", each expert's weights over {par.etp} (expert tensor parallelism)" if par.etp > 1 else "")
                     + (f", tensor parallel {par.tp}" + (" with sequence parallelism" if par.sp else "")
                        + (", loss parallel" if par.loss_parallel else "")
                        if par.tp > 1 else "")
                     + (f", pipeline {par.pp} stages ({par.schedule}"
                        + (f", {par.virtual_stages} per GPU" if par.virtual_stages > 1 else "") + ")"
                        if par.pp > 1 else "")
                     + (f", context parallel {par.cp}" if par.cp > 1 else "")
                     + (f" × data parallel {par.dp}" if par.tp > 1 or par.pp > 1 or par.cp > 1 else "")
                     + (f" as {par.dp_replicate} replicas of {par.dp // par.dp_replicate} sharded GPUs (hybrid "
                        "sharding)" if par.dp_replicate > 1 else "")
                     + " — the ledger is per GPU")
    for row in est.details.get("pipeline_ranks", ()):
        lines.append(f"Stage      pipeline rank {row['rank'] + 1} of {par.pp}: peak {size(row['peak_bytes'])}"
                     f" ({row['in_flight']} micro-batch chunk(s) in flight)"
                     + ("  ← the most loaded, shown below" if row["rank"] == est.details.get("pipeline_rank") else ""))
    label = {"quick": "quick (rough Hugging Face blog heuristic)", "analytic": "analytic (tensor by tensor)",
             "trace": "trace (the real step on fake tensors)",
             "fitted": "fitted (small fake-tensor traces of the real model, evaluated for this shape)"}
    lines.append(f"Method     {label.get(est.method, est.method)}")
    lines.append("")
    width = 22
    header = f"{'object':<{width}}" + "".join(f"{PHASE_LABELS[p]:>16}" for p in PHASES)
    lines.append(header)
    lines.append("-" * len(header))
    for obj in OBJECTS:
        row = est.object_bytes(obj)
        if not any(row.values()):
            continue
        cells = "".join(f"{size(row[p]) if row[p] else '—':>16}" for p in PHASES)
        lines.append(f"{OBJECT_LABELS[obj]:<{width}}{cells}")
    lines.append("-" * len(header))
    lines.append(f"{'Total':<{width}}" + "".join(f"{size(est.phases[p].total_bytes):>16}" for p in PHASES))
    lines.append("")
    lines.append(f"Peak       {size(est.peak_bytes)} in {PHASE_LABELS[est.peak_phase].lower()} "
                 f"(largest object: {OBJECT_LABELS[est.dominant_object].lower()}); tensors alone "
                 f"{size(est.peak_tensor_bytes)} (what max_memory_allocated shows)")
    if verdict.capacity_bytes is not None:
        gpu = next((g for g in gpu_presets() if g.id == setup.gpu), None)
        name = f"{gpu.name} " if gpu else ""
        lines.append(f"GPU        {name}{size(verdict.capacity_bytes)}")
    lines.append(f"Verdict    {result.headline()}")
    lines += [f"Warning    {w}" for w in result.warnings]
    if verdict.max_micro_batch is not None:
        lines.append(f"Largest micro-batch that fits: {verdict.max_micro_batch or 'none (micro-batch 1 is over)'}")
    host = int(est.details.get("host_bytes", 0))
    if host:
        lines.append(f"Host memory for offload: {size(host)} per node")
    if result.plan is not None:  # the window's and the report's words: "never", "not modelled for this layout"…
        lines.extend(plan_sentences(result))
    if verdict.suggestions:
        lines.append("")
        each = ", per GPU" if par.is_distributed else ""
        if verdict.fits is False:
            lines += [f"What would change it (after the change{each}):",
                      *textwrap.wrap(ADVICE_ORDER, 116, initial_indent="  ", subsequent_indent="  ")]
        else:
            lines.append(f"What would change it (after the change{each}; largest saving first):")
        heading = first_still_over(result)
        for i, s in enumerate(verdict.suggestions, 1):
            if i - 1 == heading:
                lines.append(f"  {STILL_OVER_HEADING}")
            fit = "  → fits" if s.fits else ""  # (one that does not says "still over by", under its heading)
            lines.append(f"  {i}. {s.title}: {suggestion_figures(s, result, saves=True)}{fit}")
    if verdict.uncalibrated or (not verdict.suggestions and verdict.fits is False):
        lines += ["", suggestions_note(result)]
    lines.append("")
    lines.append("Assumptions:")
    lines += [f"  - {a}" for a in est.assumptions]
    return "\n".join(lines)


def cmd_estimate(args: argparse.Namespace) -> int:
    setup, notes = setup_from_args(args)
    modules: list[tuple[str, int]] = []
    unknown = getattr(args, "unknown_config", None)  # a config of a family without an analytic block model
    if unknown is not None:
        family = str(unknown.get("model_type"))[:40]
        if args.method == "analytic":
            raise InputError("method", f"model_type {family!r} has no analytic block model: --method fitted (the "
                                       "default) or trace run the real model on fake tensors (exact, seconds); "
                                       "--method quick is the rough heuristic")
        setup.extras["model_type"] = family
        if getattr(args, "active_params", None) is not None:
            setup.extras["active_params"] = args.active_params
        if args.method is None:  # exact, rather than a heuristic that is off by up to several times
            args.method = "fitted"
    elif args.method is None and setup.model is None:
        args.method = "quick"
    config = setup.model.raw if setup.model is not None else unknown
    result: Result | None = None
    fitted_failed = False
    if args.method == "fitted":
        if config is None:
            raise InputError("method", "fitted needs an architecture: give --preset, --config or --model")
        result, note = _fitted_result(setup, config)
        if note:
            notes.append(note)
        if result is None:
            args.method, fitted_failed = "trace", True
    snapshot_out = getattr(args, "snapshot_out", None)
    if snapshot_out and args.method != "trace":
        raise InputError("snapshot_out", "the predicted events come from the trace: add --method trace")
    if snapshot_out:  # a path that cannot be written fails before the trace, not after it
        check_output(snapshot_out, field="snapshot_out")
    if args.method == "trace":
        from .trace.fake import trace_estimate

        if config is None:
            raise InputError("method", "trace needs an architecture: give --preset, --config or --model")
        traced = trace_estimate(setup, config=config)
        basis = None
        if unknown is not None and not fitted_failed:
            # no block model: the largest micro-batch and the suggestions are the fitted method's what-ifs
            with contextlib.suppress(InputError):
                basis, _ = _fitted_result(setup, config)
        if unknown is not None and basis is None and not fitted_failed:
            notes.append("the largest micro-batch and the suggestions come from the fitted method, which does not "
                         "apply here: the traced verdict alone")
        result = traced.result(basis)
        modules = traced.modules
        if snapshot_out and traced.timeline is not None:
            traced.timeline.write_snapshot(snapshot_out, field="snapshot_out")
            notes.append(f"predicted memory snapshot written to {snapshot_out} ({len(traced.timeline.events):,} "
                         "events; open it at pytorch.org/memory_viz)")
    elif result is None:
        result = evaluate(setup, args.method)
    if args.json:
        data = result.to_json()
        if getattr(args, "active_params", None) is not None:
            data["active_params"] = args.active_params
        if notes:
            data["assumptions"] = notes + data["assumptions"]
        if args.method == "trace":
            data["modules"] = [{"module": name, "bytes": nbytes} for name, nbytes in modules]
        _out(json.dumps(data, indent=2))
    else:
        for note in notes:
            _out(f"Note: {note}")
        _out(format_ledger(result))
        if modules:
            _out("\nActivations at the forward peak by module (top 10):")
            for name, nbytes in modules:
                _out(f"  {format_bytes(nbytes):>12}  {name}")
    return 0


def _fitted_result(setup: TrainingSetup, config: dict[str, Any]) -> tuple[Result | None, str]:
    """The fitted method's result (calibrated once per config and setup, then cached), or ``None`` and why not
    (the caller traces the full model).

    A what-if that changes more than the shape needs a calibration of its own. As in the window, one is run only
    where it is worth its seconds (:func:`~memcalc_gui.core.fitted.worth_calibrating`): a precision what-if (the
    step of a strategy that computes in bf16), and a checkpointing one once the setup does not fit its GPU. The
    others come from fits already in the cache, or are named in the verdict as not weighed yet."""
    from .core.fitted import FitModel, estimate_fitted, evaluate_fitted, signature, worth_calibrating
    from .trace.fake import TraceError, trace_available
    from .trace.fit import FitError, calibrate

    if not trace_available():
        raise InputError("method", f"the fitted method traces the model: {install_hint()}")
    try:
        fit = calibrate(config, setup, setup.num_params)
    except (FitError, TraceError) as exc:
        if setup.parallel.is_distributed:
            raise InputError("method", f"the fitted method does not apply here ({exc}); --method trace traces one "
                                       "rank of a DDP or FSDP2 layout") from None
        return None, f"the fitted method does not apply here ({exc}); traced the full model instead"
    base = signature(setup)
    cap = setup.capacity_bytes
    over = cap is not None and estimate_fitted(setup, fit).peak_bytes > cap  # then checkpointing is weighed

    def more(changed: TrainingSetup) -> FitModel | None:
        precision = signature(changed)["precision"] != base["precision"]
        worth = worth_calibrating(base, changed) and (over or precision)
        try:
            return calibrate(config, changed, changed.num_params, cached_only=not worth)
        except (FitError, TraceError):
            return None

    return evaluate_fitted(setup, fit, more), ""


def cmd_reconcile(args: argparse.Namespace) -> int:
    """A real snapshot's timeline beside the estimate of the stated setup: each phase's peak, the difference, the
    object that differs most, and the reconciliation signals (estimate difference, allocator retained space,
    capacity pressure)."""
    from .core.reconcile import reconcile
    from .core.timeline import compare_phases, read_timeline_file

    setup, notes = setup_from_args(args)
    timeline = read_timeline_file(args.snapshot, args.device)
    if not timeline.events:
        raise InputError("snapshot", "the snapshot's trace holds no allocations (record with "
                                     "torch.cuda.memory._record_memory_history() before the step)")
    fitted = _unknown_family_result(setup, args)  # no block model: the fitted ledger, as `memcalc estimate`
    if fitted is not None and fitted[1]:
        notes = [*notes, fitted[1]]
    result = fitted[0] if fitted is not None else evaluate(setup, "analytic" if setup.model is not None else "quick")
    rows = compare_phases(timeline, {p: dict(ph.objects) for p, ph in result.estimate.phases.items()})
    _, peak = timeline.peak()
    signals = None
    capacity = setup.capacity_bytes
    reserved = max(timeline.reserved_bytes, peak)
    if capacity and reserved <= capacity:
        signals = reconcile(result.estimate.peak_tensor_bytes, peak, reserved, capacity)
    if args.json:
        _out(json.dumps({"snapshot": str(args.snapshot), "events": len(timeline.events), "peak_bytes": peak,
                         "reserved_bytes": timeline.reserved_bytes, "phases": [r.to_json() for r in rows],
                         "reconciliation": signals.to_json() if signals else None,
                         "setup": setup.describe(), "method": result.estimate.method, "notes": notes}, indent=2))
        return 0
    events = len(timeline.events)
    _out(f"Snapshot   {args.snapshot}: {events:,} event{'s' if events != 1 else ''}, peak {format_bytes(peak)}"
         + (f", {format_bytes(timeline.reserved_bytes)} reserved at the end" if timeline.reserved_bytes else ""))
    _out(f"Estimate   {setup.summary()} ({result.estimate.method} method)")
    if not rows:
        _out("No phase of the step was found in the snapshot's frames (record the history with stacks: "
             "torch.cuda.memory._record_memory_history(stacks='python')).")
    else:
        _out(f"\n{'phase':<16}{'snapshot':>14}{'estimate':>14}{'difference':>14}  where they part")
        for r in rows:
            obj, gap = r.largest_gap
            _out(f"{r.phase.replace('_', ' '):<16}{format_bytes(r.timeline_bytes):>14}"
                 f"{format_bytes(r.estimate_bytes):>14}{_signed(r.difference_bytes):>14}  "
                 f"{obj.replace('_', ' ')} {_signed(gap)}")
    if signals is not None:
        _out(f"\nSignals    {', '.join(signals.signals) or 'none'} (estimate difference "
             f"{_signed(signals.estimate_difference_bytes)}, allocator retained "
             f"{format_bytes(signals.allocator_gap_bytes)}, margin {format_bytes(signals.budget_margin_bytes)})")
    return 0


def _signed(n: int) -> str:
    return ("+" if n >= 0 else "−") + format_bytes(abs(n))


def cmd_measure(args: argparse.Namespace) -> int:
    from .measure.engine import Cancelled, format_measurement, measure

    setup, _notes = setup_from_args(args)
    unknown = getattr(args, "unknown_config", None)  # no block model: compared with the fitted method's ledger
    if unknown is not None:
        _name_unknown(setup, args, unknown)
    iterations = parse_positive_int(args.iterations, "iterations", MAX_ITERATIONS)
    try:
        budget = float(str(args.time_budget))
    except ValueError:
        raise InputError("time_budget", f"must be a number of seconds, got {args.time_budget!r}") from None
    if not budget > 0 or budget != budget or budget == float("inf"):
        raise InputError("time_budget", f"must be a positive number of seconds, got {args.time_budget!r}")
    if args.snapshot:  # a snapshot that could not be written is known before the step runs
        check_output(args.snapshot, field="snapshot")

    def progress(text: str) -> None:
        if not args.json:
            _say(f"  … {one_line(text)}")

    try:
        result = measure(setup, device=args.device, iterations=iterations, snapshot=args.snapshot,
                         progress=progress, time_budget_s=budget, full_size=args.full_size, config=unknown)
    except Cancelled:
        return 130
    if args.json:
        _out(json.dumps(result.to_json(), indent=2))
    else:
        _out(format_measurement(result))
    return 0


def _name_unknown(setup: TrainingSetup, args: argparse.Namespace, unknown: dict[str, Any]) -> None:
    """What the results say a family without a block model is: its model_type and the preset's or model's name."""
    setup.extras["model_type"] = str(unknown.get("model_type"))[:40]
    setup.extras["model_name"] = args.preset or args.model or f"model_type {setup.extras['model_type']!r}"


def _unknown_family_result(setup: TrainingSetup, args: argparse.Namespace) -> tuple[Result, str] | None:
    """A family without a block model (``None`` for another): the fitted method's result, as ``memcalc estimate``
    gives it, or the full trace's where the fit's checks refuse it; and a note saying so."""
    unknown = getattr(args, "unknown_config", None)
    if unknown is None:
        return None
    _name_unknown(setup, args, unknown)
    if getattr(args, "active_params", None) is not None:
        setup.extras["active_params"] = args.active_params
    result, note = _fitted_result(setup, unknown)
    if result is None:  # a fit the checks refuse on one GPU: the full trace
        from .trace.fake import trace_estimate

        result = trace_estimate(setup, config=unknown).result(None)
    return result, note


def cmd_report(args: argparse.Namespace) -> int:
    from .report.export import ReportWriteError, report_format, write_report

    report_format(args.out)  # a bad extension or an unwritable path fails before any estimate or Qt start-up
    check_output(args.out, field="out")
    setup, notes = setup_from_args(args)
    timeline = None
    if getattr(args, "snapshot", None):
        from .core.timeline import read_timeline_file

        timeline = read_timeline_file(args.snapshot)
    result = None if args.method is not None else _unknown_family_result(setup, args)
    if result is not None:
        result, note = result
        notes = [*notes, note] if note else notes
    else:
        result = evaluate(setup, args.method)
    os.environ["QT_QPA_PLATFORM"] = "offscreen"  # a command never shows a window (nor needs a display)
    try:
        written = write_report(result, args.out, page=args.page, notes=notes, timeline=timeline)
    except ReportWriteError as exc:
        _fail(f"--out: {exc}")
    _out(f"Wrote {written.describe()}")
    _out(result.headline())
    return 0


def cmd_layouts(args: argparse.Namespace) -> int:
    from .core.estimate import estimate
    from .core.layouts import NOT_CALIBRATED, layout_label, search

    setup, _notes = setup_from_args(args)
    if setup.parallel.etp > 1:
        raise InputError("etp", "the layout search weighs each expert's split itself (etp 1, 2, 4 and 8 under "
                                "Megatron-LM's strategies, as it does tp and pp): leave --etp out")
    top = parse_positive_int(args.top, "top", 10_000) if args.top.strip() not in ("0", "") else 0
    unknown = getattr(args, "unknown_config", None)
    if unknown is not None:
        layouts, name = _fitted_layouts(args, setup, unknown, top or 10_000)
    elif setup.model is None:
        raise InputError("model", "a layout search splits a model's layers and heads: give a preset or a config of a "
                                  "family memcalc models")
    else:
        layouts, name = search(setup, estimate, min_gpus_for=top or 10_000), setup.model.name or setup.model.family
    shown = layouts[:top] if top else layouts
    left_out = [{"reason": reason, "layouts": [layout_label(par) for par in pars]}
                for reason, pars in layouts.left_out.items()]
    if args.json:
        _out(json.dumps({"schema": 1, "gpus": setup.parallel.gpus, "capacity_bytes": setup.capacity_bytes,
                         "method": "fitted" if unknown is not None else "analytic",
                         "layouts": [lay.to_json() for lay in shown], "count": len(layouts),
                         "left_out": left_out}, indent=2))
        return 0
    cap = setup.capacity_bytes
    _out(f"{len(layouts)} layouts of {setup.parallel.gpus} GPUs for {name}"
         + (f", {format_bytes(cap)} each" if cap else " (no capacity: --gpu or --capacity for a verdict)")
         + "; best first: fits, then tokens/s by a rough step model (docs/parallelism.md), then headroom")
    if unknown is not None:
        _out("Fitted method (no block model): each layout's ledger from traces of the real model, its states by rule "
             "(docs/fitted.md); tensor parallelism without loss parallelism; pipeline and sequence-parallel layouts "
             "once calibrated (`memcalc estimate --pp N` or `--sp` calibrates one)")
    width = max((len(lay.label) for lay in shown), default=6)
    _out(f"{'#':>3}  {'layout':<{width}} {'peak/GPU':>11} {'headroom':>11} {'speed':>6} {'bubble':>6} "
         f"{'sent/GPU':>11} {'fewest GPUs':>11}")
    for i, lay in enumerate(shown, 1):
        head = "—" if lay.headroom_bytes is None else format_bytes(lay.headroom_bytes) if lay.fits else "over"
        speed = layouts.speed_text(lay)
        fewest = f"{lay.min_gpus:,}" if lay.min_gpus else "never" if lay.min_gpus_searched and cap else "—"
        peak = ("≤" if lay.upper_bound else "") + format_bytes(lay.peak_bytes)
        _out(f"{i:>3}  {lay.label:<{width}} {peak:>11} {head:>11} {speed:>6} "
             f"{lay.bubble:>6.0%} {format_bytes(lay.communication_bytes):>11} {fewest:>11}")
    _out("speed: tokens per second relative to the best layout that fits (compute, pipeline bubble and "
         "communication of one step; a ranking, not a forecast); in parentheses for a layout that does not fit")
    if len(shown) < len(layouts):
        _out(f"     … {len(layouts) - len(shown)} more (--top 0 shows all)")
    if any(lay.upper_bound for lay in shown):
        _out("≤: an upper bound, the autocast step's calibration standing in for the bf16 step (not cached; run "
             "without --cached-only to calibrate it)")
    for item in left_out:
        _out(f"Left out ({len(item['layouts'])}): {item['reason']}")
    waiting = [par for reason, pars in layouts.left_out.items() if NOT_CALIBRATED in reason for par in pars]
    if any(par.pp > 1 for par in waiting):
        _out("Pipeline layouts are calibrated one at a time (tens of seconds to minutes each, then cached): "
             "`memcalc estimate` with these flags and --pp, --strategy and --ep of a layout adds it to this search")
    if any(par.sp and par.pp == 1 for par in waiting):
        _out("Sequence-parallel layouts are each their own rank's calibration (tens of seconds to minutes, then "
             "cached): `memcalc estimate` with these flags and --tp, --sp, --strategy and --ep of a layout adds it")
    return 0


def _fitted_layouts(args: argparse.Namespace, setup: TrainingSetup, config: dict[str, Any],
                    min_gpus_for: int) -> tuple[Any, str]:
    """The layout search of a family without a block model (:func:`memcalc_gui.core.fitted.search_layouts`): each
    signature the layouts need (a tensor-parallel degree, the bf16 step of FSDP2 and Megatron-LM) calibrated once
    and cached, or with ``--cached-only`` only what the cache holds; pipeline layouts as cached (``memcalc estimate``
    calibrates one); and the model's name."""
    from .core.fitted import FitModel, rank_signature, search_layouts, signature
    from .trace.fake import TraceError, trace_available
    from .trace.fit import FitError, NotCalibrated, calibrate

    if not trace_available():
        raise InputError("method", f"the fitted method traces the model: {install_hint()}")
    family = str(config.get("model_type"))[:40]
    name = args.preset or args.model or f"model_type {family!r}"
    setup.extras.update(model_type=family, model_name=name, fitted=True)
    replicas: dict[str, FitModel | None] = {}
    ranks: dict[str, FitModel | None] = {}

    def replica(s: TrainingSetup) -> FitModel | None:
        key = json.dumps(signature(s), sort_keys=True, default=str)
        if key not in replicas:
            try:
                replicas[key] = calibrate(config, s, s.num_params, cached_only=True, rank=False)
            except (FitError, TraceError) as exc:
                replicas[key] = None
                # a pipeline layout is a calibration of its own schedule (tens of seconds to minutes each, and a
                # search has dozens): weighed once `memcalc estimate` has calibrated it
                if not args.cached_only and isinstance(exc, NotCalibrated) and s.parallel.pp == 1:
                    if not args.json:
                        _say(f"  … calibrating {_signature_text(s)} (once; then cached)")
                    with contextlib.suppress(FitError, TraceError):
                        replicas[key] = calibrate(config, s, s.num_params, rank=False)
        return replicas[key]

    def fit_for(s: TrainingSetup) -> FitModel | None:
        """The one-replica fit of ``s``'s signature, with its FSDP2 rank's fit where that is cached."""
        fit = replica(s)
        sig = rank_signature(s)
        if fit is None or sig is None:
            return fit
        key = json.dumps(sig, sort_keys=True, default=str)
        if key not in ranks:
            try:
                ranks[key] = calibrate(config, s, s.num_params, cached_only=True)
            except (FitError, TraceError):
                ranks[key] = fit
        return ranks[key]

    # the one-replica fit the shape comes from: no split of the model, nothing offloaded (the search's layouts
    # offload nothing either)
    base = setup.with_changes(parallel=dataclasses.replace(setup.parallel, tp=1, pp=1, sp=False, loss_parallel=False,
                                                             schedule="1f1b", virtual_stages=1, strategy="ddp",
                                                             offload="none", reshard_after_forward=True))
    fit = fit_for(base)
    if fit is None:
        raise InputError("method", "the fitted method does not apply to this setup (its calibration failed or is not "
                                   "cached): `memcalc estimate` says why")
    return search_layouts(setup.with_changes(params=fit.num_params), fit, fit_for, min_gpus_for, config), name


def _signature_text(setup: TrainingSetup) -> str:
    """What a calibration is of, for its progress line: ``tensor parallelism over 2 GPUs, the bf16 step``."""
    from .core.fitted import traced_precision

    par = setup.parallel
    what = f"tensor parallelism over {par.tp} GPUs" if par.tp > 1 else "one replica"
    what += ", the experts whole (beside expert parallelism)" if par.tp > 1 and par.ep > 1 else ""
    return what + (", the bf16 step" if traced_precision(setup) == "bf16" else "")


def cmd_presets(args: argparse.Namespace) -> int:
    models = []
    for name in preset_names():
        info = preset_info(name)
        entry: dict[str, Any] = {"name": name, "family": info.family, "params": info.num_params,
                                 "source": info.hub_id, "block_model": info.block_model}
        if info.active_params != info.num_params:
            entry["active_params"] = info.active_params
        models.append(entry)
    gpus = [{"id": g.id, "name": g.name, "nominal": g.nominal, "capacity_bytes": g.capacity_bytes}
            for g in gpu_presets()]
    if args.json:
        _out(json.dumps({"schema": 1, "models": models, "gpus": gpus}, indent=2))
        return 0
    _out("Models")
    for m in models:
        active = f" ({m['active_params'] / 1e9:.1f}B active)" if "active_params" in m else ""
        _out(f"  {m['name']:<18} {m['family']:<12} {m['params']:>16,} params   {m['source']}{active}")
    _out("\nGPUs (capacity as reported to PyTorch)")
    for g in gpus:
        _out(f"  {g['id']:<12} {g['name']:<26} {format_bytes(g['capacity_bytes']):>12}  ({g['nominal']})")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command. Exit 0 on success, 2 with one line on stderr for any bad input or unwritable output,
    130 on Ctrl+C; never a traceback (unless ``MEMCALC_DEBUG=1``)."""
    for stream in (sys.stdout, sys.stderr):  # an ASCII-only terminal gets '?' for '×' rather than a crash
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            with contextlib.suppress(OSError, ValueError):
                reconfigure(errors="replace")
    from .core.cachefile import take_notices

    take_notices()  # a command reports what its own run met (not what another one in this process left)
    try:
        return _run(argv)
    except KeyboardInterrupt:
        _say("memcalc: interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `memcalc ... | head`: the reader left; stay quiet at exit too
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except _OutputError as exc:
        _say(f"memcalc: error: cannot write the output: {one_line(exc)}")
        return EXIT_INPUT
    except RecursionError:
        _say("memcalc: error: the input nests too deeply to be read")
        return EXIT_INPUT
    except MemoryError:
        _say("memcalc: error: out of memory while reading the input")
        return EXIT_INPUT
    finally:  # a damaged cache file set aside, a cache folder that cannot be written: one line each, once
        for note in take_notices():
            _say(f"memcalc: note: {one_line(note)}")


def _run(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "estimate":
            return cmd_estimate(args)
        if args.command == "measure":
            return cmd_measure(args)
        if args.command == "report":
            return cmd_report(args)
        if args.command == "reconcile":
            return cmd_reconcile(args)
        if args.command == "layouts":
            return cmd_layouts(args)
        return cmd_presets(args)
    except InputError as exc:
        _field_error(exc)
    except MemcalcError as exc:
        _fail(str(exc))
    except (KeyboardInterrupt, BrokenPipeError, _OutputError, SystemExit, RecursionError, MemoryError):
        raise
    except Exception as exc:
        if os.environ.get(DEBUG_ENV) == "1":
            raise
        _say(f"memcalc: internal error: {one_line(f'{type(exc).__name__}: {exc}')} (please report this; "
             f"{DEBUG_ENV}=1 shows the traceback)")
        return 1


def entry() -> None:
    """The ``memcalc`` console command: :func:`main`, and after Ctrl+C an immediate exit 130.

    An interrupt can land inside ``import torch`` or a half-built model; tearing the interpreter down after that
    can raise it again and end the process by the signal instead of the one-line exit. So the interrupted
    process leaves at once (its output flushed). An interrupt that lands in an object's finalizer is swallowed by
    Python ("Exception ignored in …"), so the handler also remembers it: a run that then finishes still ends with
    the one line and 130, never with 0 as if nothing had been asked. Once torch is loaded the handler leaves at
    once itself: raised there, the interrupt can land in a callback torch's C++ calls, which aborts the process."""
    interrupted: list[bool] = []

    def on_sigint(signum: int, frame: Any) -> None:
        interrupted.append(True)
        if "torch" in sys.modules:
            # inside torch an interrupt raised here can land in a callback C++ calls, which cannot pass it on (the
            # process then aborts: "terminate called after throwing an instance of 'python_error'"): leave at once
            _say("memcalc: interrupted")
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(EXIT_INTERRUPTED)
        raise KeyboardInterrupt

    with contextlib.suppress(ValueError, OSError):  # not the main thread of an embedding interpreter: keep Python's
        signal.signal(signal.SIGINT, on_sigint)
    status = main()
    if interrupted and status != EXIT_INTERRUPTED:
        _say("memcalc: interrupted")
        status = EXIT_INTERRUPTED
    if status == EXIT_INTERRUPTED:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(status)
    raise SystemExit(status)


if __name__ == "__main__":
    entry()
