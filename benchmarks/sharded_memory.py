"""Per-rank memory of parameters + gradients + optimizer state at W=2: allreduce vs zero1 vs fsdp.

Runs ``paratrain``'s Trainer for 2 steps of ``gpt`` on WikiText-2 (configs/gpt_wt2.toml's model and
vocabulary, Adam, float32; ``$PARATRAIN_DATA``) in 2 gloo processes per strategy, then counts on each
rank the bytes of the distinct storages that hold its parameters (for fsdp: its DTensor shards),
gradients, and optimizer state, after an optimizer step and before ``zero_grad`` (the steady state's
peak of these three). Method on CPU: tensor accounting (``untyped_storage().nbytes()``, each storage
once), since the CPU allocator keeps no statistics; RSS would mix in the interpreter and libraries.
fsdp's transient all-gathered block (one unit at a time) is reported separately.

    PARATRAIN_DATA=../shared/data python benchmarks/sharded_memory.py   # a table, ratios vs allreduce
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp



def storages_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


MODELS = {  # gpt_wt2's model (its tied embedding is 90% of the parameters) and ptb_small's LSTM (untied)
    "gpt_wt2": ({"entry": "gpt"}, {"corpus": "wikitext-2"}, {"n_layer": 2, "n_head": 4, "d_model": 128, "dropout": 0.0}),
    "ptb_small": ({"entry": "lstm-lm"}, {"corpus": "ptb"}, {"embed_dim": 200, "hidden_dim": 200, "num_layers": 2,
                                                           "dropout": 0.0}),
}


def _rank(rank: int, world: int, strategy: str, data: str, work: str, port: int, model: str) -> None:
    import torch.distributed as dist

    from paratrain.config import from_dict
    from paratrain.env import DistEnv
    from paratrain.train import Trainer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    task, corpus, arch = MODELS[model]
    cfg = from_dict({"name": "mem", "task": task,
                     "data": {**corpus, "mode": "bptt", "bptt": 32, "eval_batch_size": 4,
                              "train_fraction": 0.02, "eval_fraction": 0.01},
                     "model": arch,
                     "train": {"optimizer": "adam", "lr": 1e-3, "batch_size": 8, "max_steps": 2, "epochs": 100,
                               "convention": "mean_over_tokens", "schedule": "constant", "log_every": 1},
                     "dist": {"strategy": strategy, "nproc": world}})
    tr = Trainer(cfg, DistEnv(rank, rank, world, world, "gloo", torch.device("cpu")), f"{work}/{strategy}", data,
                 verbose=False)
    s = tr.strategy
    seen = {}
    base_step = s.optimizer_step

    def step(optimizer, base, closure=None):  # after the update, before zero_grad: all three are live
        out = base_step(optimizer, base, closure)
        params = list(s.module.parameters())
        opt = s.shard_optimizer if getattr(s, "shard_optimizer", None) is not None else s.optimizer
        states = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
        seen.update(params=storages_bytes(params), grads=storages_bytes(p.grad for p in params),
                    optimizer=storages_bytes(states))
        return out

    s.optimizer_step = step
    tr.fit()
    if strategy == "fsdp":  # the largest unit all-gathered during forward/backward
        inner = {id(p) for u in s.units for p in u.parameters()}
        # a DTensor parameter's numel() is the whole parameter's: the size of the gathered unit
        sizes = [sum(p.numel() * p.element_size() for p in u.parameters()) for u in s.units]
        sizes.append(sum(p.numel() * p.element_size() for p in s.module.parameters() if id(p) not in inner))
        seen["gathered_unit"] = max(sizes)
    tr.close()
    Path(f"{work}/{strategy}-{rank}.json").write_text(json.dumps(seen))
    dist.destroy_process_group()


def main() -> None:
    for model in MODELS:
        table(model)


def table(model: str) -> None:
    import socket

    rows = {}
    with tempfile.TemporaryDirectory() as work:
        data = os.environ.get("PARATRAIN_DATA", str(Path(__file__).resolve().parents[2] / "shared" / "data"))
        for strategy in ("allreduce", "zero1", "fsdp"):
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            mp.start_processes(_rank, args=(2, strategy, str(data), work, port, model), nprocs=2, start_method="spawn")
            rows[strategy] = [json.loads(Path(f"{work}/{strategy}-{r}.json").read_text()) for r in range(2)]
    base = rows["allreduce"][0]
    base_total = base["params"] + base["grads"] + base["optimizer"]
    print(f"\n{model}, W=2, Adam, float32:\n")
    print("| strategy | rank | params MiB | grads MiB | optimizer MiB | total MiB | total vs allreduce | "
          "optimizer vs allreduce |")
    print("|---|---|---|---|---|---|---|---|")
    for strategy, per_rank in rows.items():
        for r, m in enumerate(per_rank):
            total = m["params"] + m["grads"] + m["optimizer"]
            print(f"| {strategy} | {r} | {m['params'] / 2**20:.2f} | {m['grads'] / 2**20:.2f} | "
                  f"{m['optimizer'] / 2**20:.2f} | {total / 2**20:.2f} | {total / base_total:.3f}x | "
                  f"{m['optimizer'] / base['optimizer']:.3f}x |")
    g = rows["fsdp"][0].get("gathered_unit")
    print(f"\nfsdp: largest unit all-gathered at a time (transient): {g / 2**20:.2f} MiB")


if __name__ == "__main__":
    main()
