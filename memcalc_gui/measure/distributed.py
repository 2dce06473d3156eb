"""A real multi-process training step over several CPU processes (PyTorch's gloo backend), each rank measured with
the live-storage tracker: the check of the per-GPU ledgers against the engines themselves, not only their formulas.
DDP wraps the model in ``DistributedDataParallel`` (its defaults); ``pipeline:<schedule>`` runs one pipeline stage per
process under PyTorch's schedule (:mod:`memcalc_gui.trace.pipeline`), activations and gradients really sent;

FSDP2 (``torch.distributed.fsdp.fully_shard``) wraps every decoder layer and then the root model, as torchtitan's
``apply_fsdp`` does; under mixed precision its ``MixedPrecisionPolicy`` gathers bf16 weights and reduces gradients
in fp32 (torchtitan's defaults), with no autocast. ``torch`` is imported inside the functions only.
"""

from __future__ import annotations

import os
import queue
import socket
from typing import Any

from .cpu_step import StepMeasurement, measure_training_step

#: Seconds a rank may take before the run is abandoned (a hung collective must not hang the caller).
RANK_TIMEOUT_S = 300


def fsdp2_parallelize(precision: str, reshard_after_forward: bool) -> Any:
    """The ``parallelize`` callback of :func:`measure_training_step` for one FSDP2 rank."""

    def apply(model: Any) -> None:
        import torch
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from transformers.modeling_layers import GradientCheckpointingLayer

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if precision == "mixed" else MixedPrecisionPolicy()
        for layer in [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]:
            fully_shard(layer, mp_policy=policy, reshard_after_forward=reshard_after_forward)
        fully_shard(model, mp_policy=policy, reshard_after_forward=reshard_after_forward)

    return apply


def ddp_parallelize() -> Any:
    """The ``parallelize`` callback of :func:`measure_training_step` for one DDP rank: the model wrapped in
    ``DistributedDataParallel`` with its defaults (25 MiB buckets, ``gradient_as_bucket_view=False``)."""

    def apply(model: Any) -> Any:
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)

    return apply


def _rank(rank: int, world: int, port: int, kwargs: dict[str, Any], strategy: str, reshard_after_forward: bool,
          out: Any) -> None:
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    except Exception as exc:  # the port taken meanwhile, most often: the parent tries again
        out.put((rank, None, f"{type(exc).__name__}: {exc}"))
        return
    import gc

    # the collector runs only where the step runs it (each iteration's end): left automatic, it ran at moments that
    # differed between runs and ranks, and an FSDP2 buffer in a reference cycle was freed early or late
    gc.disable()
    try:
        if strategy == "fsdp2":
            m = measure_training_step(**kwargs, parallelize=fsdp2_parallelize(kwargs["precision"],
                                                                              reshard_after_forward),
                                      autocast=False, seed=rank)
        elif strategy == "ddp":
            m = measure_training_step(**kwargs, parallelize=ddp_parallelize(), seed=rank)
        elif strategy.startswith("pipeline:"):  # pipeline:<schedule>: one stage per process, sends and receives real
            from ..trace.fake import unpacked_sequences
            from ..trace.pipeline import PipeRank, cutter, driver

            layout = PipeRank(world, rank, strategy.split(":", 1)[1], 1, kwargs["grad_accum"])
            make = driver(layout, batch=kwargs["batch"], seq=kwargs["seq"],
                          precision=kwargs["precision"])
            with unpacked_sequences():
                m = measure_training_step(**kwargs, parallelize=cutter(layout), pipeline=make, seed=0)
        else:
            raise ValueError(f"the multi-process CPU step runs ddp, fsdp2 or pipeline:<schedule>, not {strategy!r}")
        out.put((rank, m, None))
    except Exception as exc:  # reported to the parent, which raises it
        out.put((rank, None, f"{type(exc).__name__}: {exc}"))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure_sharded_step(config: dict[str, Any], *, world: int = 2, strategy: str = "fsdp2",
                         reshard_after_forward: bool = True, **kwargs: Any) -> list[StepMeasurement]:
    """Run the training step of :func:`measure_training_step` (``kwargs``) on ``world`` CPU processes under
    ``strategy`` and return each rank's measurement, rank 0 first. A rendezvous port another process took between
    choosing and binding it is tried again once with a new one."""
    try:
        return _run(config, world, strategy, reshard_after_forward, kwargs)
    except RuntimeError as exc:
        if "address already in use" not in str(exc).lower() and "eaddrinuse" not in str(exc).lower():
            raise
        return _run(config, world, strategy, reshard_after_forward, kwargs)


def _run(config: dict[str, Any], world: int, strategy: str, reshard_after_forward: bool,
         kwargs: dict[str, Any]) -> list[StepMeasurement]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    args = dict(kwargs, config=config)
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, args, strategy, reshard_after_forward, out))
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, StepMeasurement] = {}
    errors: list[str] = []
    try:
        for _ in procs:
            try:
                rank, m, err = out.get(timeout=RANK_TIMEOUT_S)
            except queue.Empty:
                errors.append(f"no rank answered within {RANK_TIMEOUT_S} s")
                break
            if err:  # the other ranks would wait for it in a collective: stop them
                errors.append(f"rank {rank}: {err}")
                break
            results[rank] = m
    finally:
        for p in procs:
            p.join(timeout=30 if not errors else 1)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("; ".join(errors))
    return [results[r] for r in range(world)]
