"""What one optimizer step of train.py's engine dispatches, with the project's one-pass master step
and with DeepSpeed's own (FP16_UnfusedOptimizer, tensor by tensor): operations (each a kernel on a
GPU), host syncs among them (`.item()`-like reads of a device value), and the step's time here.

On a GPU a step of a small model at a moderate batch is bound by kernel launches and syncs, not
by its arithmetic; on a CPU the two steps take about the same time, so the counts are what this
machine can show. The model is a preset at its real size (`mini`: 4 layers, BERT's 30,522-token
vocabulary), in bf16 at ZeRO 0 with the config's optimizer, world size 1.

    python benchmarks/master_step_ops.py [--model mini] [--optimizer Lamb|OneBitLamb|ZeroOneAdam] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from bench_common import cpu_name, single_rank_environment  # noqa: E402

SYNCS = {"aten::_local_scalar_dense", "aten::item", "aten::is_nonzero"}


class CountOps:
    """The aten operations dispatched inside it, and how many of them read a value to the host."""

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func._schema.name
                counter.ops += 1
                counter.syncs += name in SYNCS
                return func(*args, **(kwargs or {}))
        self.ops, self.syncs, self.mode = 0, 0, Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="mini")
    p.add_argument("--optimizer", default="Lamb", choices=["Lamb", "OneBitLamb", "ZeroOneAdam"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    single_rank_environment()
    import deepspeed
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    from commodity_bert.model.bert import PretrainingModel, build_config, build_model
    from commodity_bert.train.engine import build_engine
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    params = {"Lamb": {"lr": 1e-3, "weight_decay": 0.01}, "OneBitLamb": {"lr": 1e-3, "freeze_step": 1000},
              "ZeroOneAdam": {"lr": 1e-3, "var_freeze_step": 1000}}[args.optimizer]
    rows = []
    for step_kind in ("one_pass", "deepspeed"):
        torch.manual_seed(0)
        model = PretrainingModel(build_model(build_config(args.model, 30522), nsp=False))
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
                  "gradient_clipping": 1.0, "bf16": {"enabled": True},
                  "optimizer": {"type": args.optimizer, "params": params}}
        engine = build_engine(config, model).engine
        if step_kind == "deepspeed":
            engine.optimizer.__class__ = FP16_UnfusedOptimizer
        tensors = sum(len(g) for g in engine.optimizer.fp16_groups)
        counts, seconds = [], []
        for _ in range(args.repeats + 1):
            for p_ in model.parameters():  # a gradient on every tensor, as after a backward
                p_.grad = torch.randn_like(p_) * 1e-3
            with CountOps() as counted:
                engine.optimizer.step()
            for p_ in model.parameters():
                p_.grad = torch.randn_like(p_) * 1e-3
            started = time.perf_counter()
            engine.optimizer.step()
            seconds.append(time.perf_counter() - started)
            counts.append((counted.ops, counted.syncs))
        row = {"step": step_kind, "model": args.model, "optimizer": args.optimizer, "tensors": tensors,
               "parameters": sum(p_.numel() for p_ in model.parameters()), "ops": counts[-1][0],
               "host_syncs": counts[-1][1], "step_s_median": statistics.median(seconds[1:])}
        rows.append(row)
        print(f"{step_kind:>9}: {row['ops']:>5} operations, {row['host_syncs']:>3} host syncs a step over "
              f"{tensors} tensors; {row['step_s_median'] * 1e3:.1f} ms here", flush=True)
    result = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__,
              "deepspeed": deepspeed.__version__, "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
