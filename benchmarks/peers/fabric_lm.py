"""Peer 3: the training of ``ddp_plain.py`` written with Lightning Fabric.

Same model, data, stream split, seed, threads, loop and measurement as
``ddp_plain.py`` (imported from there); Fabric (strategy "ddp", launched by
torchrun: Fabric reads torchelastic's variables and starts no processes of its
own) does the process setup, the DDP wrapping (``fabric.setup``), the backward
(``fabric.backward``) and the clipping (``fabric.clip_gradients``).

Start:  python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/peers/fabric_lm.py \
            --data-dir /work/shared/data --epochs 1 [--max-steps N] [--warmup-steps W] [--json OUT]
Needs the benchmark extras: pip install -e ".[peers]".
"""
from __future__ import annotations

import os

import torch.distributed as dist
from lightning_fabric import Fabric

from ddp_plain import CLIP, local_ranks, parse_args, pick_device, report, setup, train


def main() -> None:
    args = parse_args(__doc__)
    local_world = local_ranks()[1]
    fabric = Fabric(accelerator=pick_device(args.device).type, devices=local_world, strategy="ddp",
                    num_nodes=int(os.environ.get("WORLD_SIZE", 1)) // local_world)
    fabric.launch()  # joins the process group (the processes are torchrun's)
    data, model, opt, facts = setup(args, fabric.device)

    model, opt = fabric.setup(model, opt)  # DDP
    result = train(args, model, opt, data, backward=fabric.backward,
                   clip=lambda: fabric.clip_gradients(model, opt, max_norm=CLIP), eval_model=model.module)
    report(args, {"program": "fabric", **facts, **result})
    fabric.barrier()  # see SHUTDOWN in ddp_plain.py
    dist.destroy_process_group()  # Fabric leaves a gloo group to the interpreter's exit, which can abort a rank


if __name__ == "__main__":
    main()
