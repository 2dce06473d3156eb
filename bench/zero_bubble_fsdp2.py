"""Do PyTorch's zero-bubble schedules get the weight gradients right under FSDP2? (issue 17; why memcalc offers them
beside FSDP2 only without resharding after forward.)

    python bench/zero_bubble_fsdp2.py [--json] [interleaved-zb|zbv]

Four gloo processes on the CPU (2 pipeline stages per schedule's placement × FSDP2 over 2 data-parallel ranks) train
one step of a small stack of linears under ``ScheduleInterleavedZeroBubble`` and ``ScheduleZBVZeroBubble`` (2 stages per
rank), each stage ``fully_shard``-ed with and without ``reshard_after_forward``; every weight's gradient is compared
with the same step of the whole model in one process (cosine similarity and norm ratio; the schedule and FSDP2 scale
the gradients by the same factor throughout). The reason it can go wrong: ``stage_backward_input`` collects the
stage's weights (``submodule.parameters()``) before autograd runs, and a stage resharded after forward registers its
sharded parameters there, which the graph never reaches, so its deferred weight-gradient steps miss them.
"""

from __future__ import annotations

import copy
import json
import os
import socket
import sys
from typing import Any

LAYERS, WIDTH, MICRO, ROWS = 4, 16, 4, 1


def _model() -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(LAYERS)])


def _rank(rank: int, port: int, cases: list[tuple[str, bool]], out: Any) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, schedules

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=4)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
        torch.manual_seed(1)
        x = torch.randn(2 * MICRO * ROWS, WIDTH)
        y = torch.randn(2 * MICRO * ROWS, WIDTH)
        mine = slice(dp_rank * MICRO * ROWS, (dp_rank + 1) * MICRO * ROWS)

        def loss_fn(output: Any, target: Any) -> Any:
            return ((output - target) ** 2).mean()

        # the same step on one process: the sum of every micro-batch's loss over both data-parallel ranks
        reference = _model()
        sum(loss_fn(reference(x[i:i + ROWS]), y[i:i + ROWS]) for i in range(0, len(x), ROWS)).backward()
        for schedule, reshard in cases:
            whole = _model()
            held = (pp_rank, 3 - pp_rank) if schedule == "zbv" else (pp_rank, pp_rank + 2)
            modules, stages = {}, []
            for s in held:
                module = copy.deepcopy(whole[s])
                fully_shard(module, mesh=mesh["dp"], reshard_after_forward=reshard)
                modules[s] = module
                stages.append(PipelineStage(module, s, 4, torch.device("cpu"), group=mesh["pp"].get_group()))
            cls = schedules.ScheduleZBVZeroBubble if schedule == "zbv" else schedules.ScheduleInterleavedZeroBubble
            step = cls(stages, n_microbatches=MICRO, loss_fn=loss_fn)
            if 0 in held:
                step.step(x[mine], target=y[mine] if 3 in held else None)
            elif 3 in held:
                step.step(target=y[mine])
            else:
                step.step()
            rows = []
            for s, module in modules.items():
                for name, param in module.named_parameters():
                    ref = dict(reference[s].named_parameters())[name].grad
                    if param.grad is None:
                        rows.append((s, name, None, None))
                        continue
                    got = param.grad.full_tensor()
                    cosine = float(torch.nn.functional.cosine_similarity(got.flatten(), ref.flatten(), dim=0))
                    rows.append((s, name, cosine, float(got.norm() / ref.norm())))
            out.put((rank, dp_rank, f"{schedule} reshard={reshard}", rows))
    finally:
        dist.destroy_process_group()


def check(cases: list[tuple[str, bool]]) -> dict[str, list[tuple[int, str, float | None, float | None]]]:
    """Per case (``"<schedule> reshard=<bool>"``), each stage's (stage, weight, cosine, norm ratio) on data-parallel
    rank 0; None where no gradient was made. One set of four processes runs every case in turn."""
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, cases, queue)) for r in range(4)]
    for p in procs:
        p.start()
    try:
        results = [queue.get(timeout=180) for _ in range(4 * len(cases))]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    table: dict[str, list[tuple[int, str, float | None, float | None]]] = {}
    for _, dp, kind, rows in results:
        if dp == 0:
            table.setdefault(kind, []).extend(rows)
    return {kind: sorted(rows) for kind, rows in table.items()}


def main() -> None:
    import warnings

    warnings.filterwarnings("ignore")
    chosen = [a for a in ("interleaved-zb", "zbv") if a in sys.argv[1:]] or ["interleaved-zb", "zbv"]
    table = check([(schedule, reshard) for schedule in chosen for reshard in (False, True)])
    if "--json" in sys.argv:
        print(json.dumps(table))
        return
    print(f"{'schedule':<30}{'stage':>6}  {'weight':<10}{'cosine':>10}{'norm ratio':>12}")
    for kind, rows in table.items():
        for stage, name, cosine, ratio in rows:
            print(f"{kind:<30}{stage:>6}  {name:<10}" + (f"{cosine:>10.4f}{ratio:>12.4f}" if cosine is not None
                                                           else f"{'none':>10}{'':>12}"))


if __name__ == "__main__":
    main()
