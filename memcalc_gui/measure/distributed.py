"""A real multi-process training step over several CPU processes (PyTorch's gloo backend), each rank measured with
the live-storage tracker: the check of the per-GPU ledgers against the engines themselves, not only their formulas.
DDP wraps the model in ``DistributedDataParallel`` (its defaults); ``pipeline:<schedule>`` runs one pipeline stage per
process (with FSDP2 over each stage's data-parallel ranks when asked) under PyTorch's schedule
(:mod:`memcalc_gui.trace.pipeline`), activations and gradients really sent; ``ranks`` runs one rank of a tensor-,
context-parallel and FSDP2 mesh exactly as the per-rank trace does (:func:`memcalc_gui.trace.ranks.run_rank`), on
real tensors over gloo instead of fake ones over the fake process group.

FSDP2 (``torch.distributed.fsdp.fully_shard``) wraps every decoder layer and then the root model, as torchtitan's
``apply_fsdp`` does; under mixed precision its ``MixedPrecisionPolicy`` gathers bf16 weights and reduces gradients
in fp32 (torchtitan's defaults), with no autocast. ``torch`` is imported inside the functions only.
"""

from __future__ import annotations

import contextlib
import functools
import os
import queue
import socket
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from .cpu_step import StepMeasurement, measure_training_step

#: Seconds a rank may take before the run is abandoned (a hung collective must not hang the caller).
RANK_TIMEOUT_S = 300
#: prctl(2)'s option that names the signal a process gets when its parent ends.
PR_SET_PDEATHSIG = 1


def fsdp2_parallelize(precision: str, reshard_after_forward: bool) -> Any:
    """The ``parallelize`` callback of :func:`measure_training_step` for one FSDP2 rank."""

    def apply(model: Any) -> None:
        import torch
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from transformers.modeling_layers import GradientCheckpointingLayer

        from ..trace.ranks import experts_placement, root_reshard

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if precision == "mixed" else MixedPrecisionPolicy()
        place = experts_placement(model, torch.distributed.get_world_size())  # torchtitan's, as the trace's
        for layer in [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]:
            fully_shard(layer, mp_policy=policy, reshard_after_forward=reshard_after_forward, shard_placement_fn=place)
        fully_shard(model, mp_policy=policy, reshard_after_forward=root_reshard(reshard_after_forward))

    return apply


def ddp_parallelize(group: Any = None) -> Any:
    """The ``parallelize`` callback of :func:`measure_training_step` for one DDP rank: the model wrapped in
    ``DistributedDataParallel`` with its defaults (25 MiB buckets, ``gradient_as_bucket_view=False``), over ``group``
    (the default process group when ``None``)."""

    def apply(model: Any) -> Any:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model, process_group=group)
        # DDP broadcasts rank 0's weights through a flat buffer, which gloo's worker thread lets go of a moment after
        # the call returns: now and then a rank's load still held it (3 × the weights instead of 2). A barrier, the
        # next collective on the same workers, waits for that.
        dist.barrier(group)
        return wrapped

    return apply


#: How often the parent looks at its ranks' queue, a cancel request and the ranks' health (seconds).
POLL_S = 0.2


def _step(rank: int, world: int, kwargs: dict[str, Any], strategy: str, reshard_after_forward: bool,
          layout: Any) -> StepMeasurement:
    """This process's rank of the step: DDP or FSDP2 wrapped here, a parallel layout's rank (``ranks``: the same
    :func:`~memcalc_gui.trace.ranks.run_rank` the per-rank trace runs, on real tensors over this process group), or
    one pipeline stage (``pipeline:<schedule>``) under PyTorch's schedule."""
    import torch.distributed as dist

    # gloo's workers let go of finished collectives' buffers at the barrier; a phase's peak is its lowest over the
    # steady iterations (a buffer they free late lands in one of them now and then), except where the iterations
    # really differ: a router sends an expert-parallel rank other tokens as the weights change (its optimizer step,
    # which holds no tokens, is steady)
    kwargs = dict(kwargs, settle=dist.barrier,
                  settled=True if getattr(layout, "ep", 1) == 1 else ("optimizer_step",))
    if strategy == "fsdp2":
        return measure_training_step(**kwargs, parallelize=fsdp2_parallelize(kwargs["precision"],
                                                                             reshard_after_forward),
                                     autocast=False, seed=rank)
    if strategy == "ddp":
        return measure_training_step(**kwargs, parallelize=ddp_parallelize(), seed=rank)
    if strategy == "ranks":  # one rank of a tensor-, context-parallel and FSDP2 mesh (trace.ranks), for real
        from ..trace.ranks import run_rank

        config = kwargs.pop("config")
        m: StepMeasurement = run_rank(config, layout, fake=False, group="current", seed=rank, **kwargs)
        return m
    if strategy.startswith("pipeline:"):  # one stage per process (per data-parallel rank of it): sends are real
        import dataclasses

        from ..trace.pipeline import PipeRank, trace_pipeline_rank

        pipe = layout if layout is not None else PipeRank(world, 0, strategy.split(":", 1)[1], 1,
                                                          kwargs["grad_accum"])
        pipe = dataclasses.replace(pipe, rank=rank // (pipe.dp_replicate * pipe.data * pipe.cp * pipe.tp))
        config = kwargs.pop("config")
        stage: StepMeasurement = trace_pipeline_rank(config, pipe, fake=False, group="current", seed=0, **kwargs)
        return stage
    raise ValueError(f"the multi-process CPU step runs ddp, fsdp2, ranks or pipeline:<schedule>, not {strategy!r}")


@contextlib.contextmanager
def nccl_like_reduce_scatter() -> Iterator[None]:
    """FSDP2's reduce-scatter over gloo without gloo's own copy of the input, for the duration.

    gloo runs ``reduce_scatter_single`` on a copy of its whole input (the tracker sees an input-sized storage made
    inside the call and split: 519 MiB of fp32 beside FSDP2's own 519 MiB input at the end of Qwen2.5-0.5B's backward,
    where its tied embedding is reduced); NCCL reduces into the output. So each rank runs it as an in-place
    all-reduce of FSDP2's input buffer, which FSDP2 owns and frees right after, and copies its shard out: the bytes
    NCCL holds, the same gradients."""
    import torch.distributed as dist

    original = dist.reduce_scatter_single

    def reduce_scatter(output: Any, input: Any, op: Any = dist.ReduceOp.SUM, group: Any = None,
                       async_op: bool = False) -> Any:
        if async_op or dist.get_backend(group) != "gloo":
            return original(output, input, op=op, group=group, async_op=async_op)
        dist.all_reduce(input, op=op, group=group)
        output.copy_(input.reshape(dist.get_world_size(group), -1)[dist.get_rank(group)].reshape(output.shape))
        return None

    dist.reduce_scatter_single = reduce_scatter
    try:
        yield
    finally:
        dist.reduce_scatter_single = original


def _die_with_parent(parent: int | None = None) -> None:
    """On Linux the kernel ends this rank when the thread that started it ends (a window killed, a test stopped
    for its time): a rank left behind would wait in a collective for gloo's half-hour timeout (prctl(2),
    ``PR_SET_PDEATHSIG``). A parent (``parent``: its pid) that ended before the request was made is seen at once:
    the rank was handed to another process, and ends. A rank forked by a fork server (:func:`rank_context`) has the
    server for parent, which ends when the process it serves ends: the server hands each child a copy of the pipe end
    that tells it so, and the rank closes its copy (else the server would wait on the rank, and the rank on the
    server). Elsewhere the parent's own deadline and kill remain."""
    if not sys.platform.startswith("linux"):
        return
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    alive = getattr(server, "_forkserver_alive_fd", None)
    if alive is not None:  # only in a fork server's child: no server was started in this process
        with contextlib.suppress(OSError):
            os.close(alive)
        server._forkserver_alive_fd = None  # type: ignore[union-attr]
    import ctypes
    import signal

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if parent is not None and os.getppid() != parent:
        os._exit(1)


#: What the fork server imports once, before it forks any rank: torch, its distributed packages and transformers'
#: shared model code (a family's own modeling module is imported by the rank).
FORKSERVER_PRELOAD = ("torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.tensor",
                      "torch.distributed.tensor.parallel", "transformers", "transformers.modeling_utils",
                      "transformers.modeling_layers", "memcalc_gui.measure.distributed", "memcalc_gui.measure.cpu_step")


#: Whether this process started its fork server (:func:`rank_context`): the next ranks start without imports.
_server_started = False


def uses_fork_server() -> bool:
    """Whether :func:`rank_context` forks the ranks from a fork server here (Linux, not frozen)."""
    import multiprocessing

    return sys.platform.startswith("linux") and not getattr(sys, "frozen", False) \
        and "forkserver" in multiprocessing.get_all_start_methods()


def fork_server_started() -> bool:
    """Whether the ranks of the next measurement start from a running fork server (no imports to wait for)."""
    return _server_started and uses_fork_server()


def rank_context() -> tuple[Any, int | None]:
    """The ``multiprocessing`` context the ranks start from, and the pid of the process that forks them.

    On Linux that is a fork server (Python's ``forkserver`` start method, the default from Python 3.14) which imported
    :data:`FORKSERVER_PRELOAD` once: a rank then starts in a fraction of a second instead of importing torch and
    transformers again (about 2 s of CPU each, 9 s for four ranks on a 2-core machine), from the second measurement
    on. The server is a clean process (it never ran the window or CUDA) and ends with this one. Elsewhere, and in a
    frozen app, each rank is a spawned interpreter as before."""
    import torch.multiprocessing as mp

    global _server_started
    if not uses_fork_server():
        return mp.get_context("spawn"), os.getpid()
    from multiprocessing import forkserver

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))  # read when the server starts, the first time only
    forkserver.ensure_running()
    _server_started = True
    return ctx, getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)


def _rank(rank: int, world: int, port: int, kwargs: dict[str, Any], strategy: str, reshard_after_forward: bool,
          out: Any, layout: Any = None, report: bool = False, parent: int | None = None,
          environ: dict[str, str] | None = None) -> None:
    _die_with_parent(parent)
    if environ is not None:  # a fork server's child has the server's environment, not the caller's of now
        os.environ.clear()
        os.environ.update(environ)
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
    if report and rank == 0:  # the first rank tells the parent where the step is (progress)
        kwargs = dict(kwargs, on_phase=lambda phase, it, micro: out.put((-1, (phase, it, micro), None)))
    try:
        with nccl_like_reduce_scatter():
            out.put((rank, _step(rank, world, kwargs, strategy, reshard_after_forward, layout), None))
    except Exception as exc:  # reported to the parent, which raises it
        out.put((rank, None, f"{type(exc).__name__}: {exc}"))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RanksCancelled(RuntimeError):
    """``should_stop()`` said stop: every rank was ended."""


def measure_sharded_step(config: dict[str, Any], *, world: int = 2, strategy: str = "fsdp2",
                         reshard_after_forward: bool = True, layout: Any = None,
                         on_phase: Callable[[str, int, int], None] | None = None,
                         should_stop: Callable[[], bool] | None = None, **kwargs: Any) -> list[StepMeasurement]:
    """Run the training step of :func:`measure_training_step` (``kwargs``) on ``world`` CPU processes under
    ``strategy`` (``ddp``, ``fsdp2``, ``ranks`` with a :class:`~memcalc_gui.trace.ranks.RankLayout`, or
    ``pipeline:<schedule>``, with a :class:`~memcalc_gui.trace.pipeline.PipeRank` for more than plain stages) and
    return each rank's measurement, rank 0 first. ``on_phase`` hears rank 0's phases; ``should_stop()`` true ends
    every rank (:class:`RanksCancelled`). A rendezvous port another process took between choosing and binding it is
    tried again once with a new one."""
    run = functools.partial(_run, config, world, strategy, reshard_after_forward, kwargs, layout, on_phase,
                            should_stop)
    try:
        return run()
    except RuntimeError as exc:
        if "address already in use" not in str(exc).lower() and "eaddrinuse" not in str(exc).lower():
            raise
        return run()


def _run(config: dict[str, Any], world: int, strategy: str, reshard_after_forward: bool, kwargs: dict[str, Any],
         layout: Any, on_phase: Callable[[str, int, int], None] | None,
         should_stop: Callable[[], bool] | None) -> list[StepMeasurement]:
    ctx, forker = rank_context()
    out = ctx.Queue()
    args = dict(kwargs, config=config)
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, args, strategy, reshard_after_forward, out, layout,
                                             on_phase is not None, forker, dict(os.environ)), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, StepMeasurement] = {}
    errors: list[str] = []
    deadline = time.monotonic() + RANK_TIMEOUT_S
    try:
        while len(results) < world and not errors:
            if should_stop is not None and should_stop():
                raise RanksCancelled("measurement cancelled")
            try:
                rank, m, err = out.get(timeout=POLL_S)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in results]
                if dead and out.empty():  # a rank killed (out of memory, most often) answers nothing
                    time.sleep(POLL_S)  # its last message may still be in the pipe
                    if out.empty():
                        errors.append(f"rank {dead[0]} ended without a result (exit code "
                                      f"{procs[dead[0]].exitcode}; out of memory?)")
                elif time.monotonic() > deadline:
                    errors.append(f"no rank answered within {RANK_TIMEOUT_S} s")
                continue
            if rank < 0:  # rank 0's progress
                if on_phase is not None:
                    on_phase(*m)
                continue
            if err:  # the other ranks would wait for it in a collective: stop them
                errors.append(f"rank {rank}: {err}")
                break
            results[rank] = m
    finally:
        stopping = bool(errors) or len(results) < world
        for p in procs:
            p.join(timeout=1 if stopping else 30)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        out.close()
    if errors:
        raise RuntimeError("; ".join(errors))
    return [results[r] for r in range(world)]
