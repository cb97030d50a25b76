"""Peer 2: the training of ``ddp_plain.py`` written with Hugging Face Accelerate.

Same model, data, stream split, seed, threads, loop and measurement as
``ddp_plain.py`` (imported from there); Accelerate does the process setup
(``Accelerator``), the DDP wrapping (``prepare(model, optimizer)``), the
backward (``accelerator.backward``) and the clipping
(``accelerator.clip_grad_norm_``). Only the model and the optimizer go through
``prepare``: each rank feeds its own contiguous block of streams exactly as
``ddp_plain.py`` does (a prepared DataLoader would reshard the batches).

Start:  python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/peers/accelerate_lm.py \
            --data-dir /work/shared/data --epochs 1 [--max-steps N] [--warmup-steps W] [--json OUT]
Needs the benchmark extras: pip install -e ".[peers]".
"""
from __future__ import annotations

from accelerate import Accelerator

from ddp_plain import CLIP, parse_args, pick_device, report, setup, train


def main() -> None:
    args = parse_args(__doc__)
    accelerator = Accelerator(cpu=pick_device(args.device).type == "cpu")  # joins the process group
    data, model, opt, facts = setup(args, accelerator.device)

    model, opt = accelerator.prepare(model, opt)  # DDP; no DataLoader: each rank keeps its own streams
    result = train(args, model, opt, data, backward=accelerator.backward,
                   clip=lambda: accelerator.clip_grad_norm_(model.parameters(), CLIP),
                   eval_model=accelerator.unwrap_model(model))
    report(args, {"program": "accelerate", "distributed_type": str(accelerator.distributed_type), **facts, **result})
    accelerator.wait_for_everyone()  # see SHUTDOWN in ddp_plain.py
    accelerator.end_training()  # leaves the process group


if __name__ == "__main__":
    main()
