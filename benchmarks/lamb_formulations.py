"""Why DeepSpeed's FusedLamb learns slower than the project's LAMB: its formulation, rebuilt on CPU.

On an H200 (benchmarks/RESULTS.md#fusedlamb), DeepSpeed's FusedLamb and the project's LAMB, given the same
config, the same shards and seed, had the same step-1 loss and gradient norms but FusedLamb's loss
fell far slower. Reading DeepSpeed 0.19.8's kernel (csrc/lamb/fused_lamb_cuda_kernel.cu): it takes
the trust ratio of the update m/(sqrt(v) + eps) + wd*p built from the moments *before* bias
correction, and applies the correction afterwards, in the step size lr*sqrt(1 - b2^t)/(1 - b1^t).
The ratio normalises the update's size, so the correction no longer cancels: every step shrinks
by that factor. This script rebuilds that formulation in torch (`FusedLambFormulation`, written
from the kernel's arithmetic; FusedLamb itself runs only on CUDA) and runs train.py's own path on
the CPU with each, so its curves can be laid beside the GPU's: if the rebuilt formulation follows
FusedLamb's GPU curve and the project's LAMB follows its own, the formulation is the cause.

    python benchmarks/lamb_formulations.py --data SHARDS [--steps 30] [--gpu-session session.json] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks"), str(REPO / "benchmarks" / "gpu")]

from commodity_bert.optim import build  # noqa: F401  (the shipped optimizers register themselves)
from commodity_bert.optim.lamb import Lamb
from commodity_bert.optim.registry import register_optimizer, registered


class FusedLambFormulation(Lamb):
    """DeepSpeed FusedLamb's arithmetic (eps_mode 1: sqrt(v) + eps), for tensors on any device."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                state["step"] += 1
                t = state["step"]
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(beta1).add_(p.grad, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                update = m / (v.sqrt() + group["eps"]) + group["weight_decay"] * p
                w_norm, u_norm = p.norm(), update.norm()
                ratio = (w_norm / u_norm).clamp(group["min_coeff"], group["max_coeff"]) \
                    if w_norm > 0 and u_norm > 0 else torch.tensor(1.0)
                step_size = group["lr"] * (1 - beta2 ** t) ** 0.5 / (1 - beta1 ** t) \
                    if group["bias_correction"] else group["lr"]
                p.add_(update, alpha=-step_size * float(ratio))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--gpu-session", type=Path, help="a GPU session.json whose fused_lamb part to lay beside")
    parser.add_argument("--work", default="/tmp/lamb_formulations")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    import parts
    from bench_common import cpu_name, single_rank_environment
    single_rank_environment()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    config = json.loads((REPO / "ds_configs" / "cpu_tiny_lamb.json").read_text())
    curves = {}
    # the rebuilt formulation trains as an optimizer of its own, with Lamb's params
    register_optimizer(replace(registered("Lamb"), type="FusedLambFormulation",
                               build=lambda groups, params, config: FusedLambFormulation(groups, **params)))
    for name, optimizer in (("project", "Lamb"), ("fusedlamb_formulation", "FusedLambFormulation")):
        config["optimizer"]["type"] = optimizer
        rows = parts.train_once(config, work, name, Path(args.data), "tiny", args.steps)
        curves[name] = [r["loss"] for r in parts.trained_rows(rows)]
    result = {"machine": f"CPU: {cpu_name()}", "torch": torch.__version__, "steps": args.steps,
              "config": "ds_configs/cpu_tiny_lamb.json", "cpu": curves}
    if args.gpu_session:
        gpu = json.loads(args.gpu_session.read_text())["parts"]["fused_lamb"]
        result["gpu"] = {cell["name"]: cell["loss"] for cell in gpu["cells"]}
        result["gpu_device"] = gpu.get("device")
    print(f"{'step':>4} " + " ".join(f"{k:>22}" for k in curves) +
          ("  " + " ".join(f"{'GPU ' + k:>22}" for k in result.get("gpu", {})) if "gpu" in result else ""))
    for i in range(args.steps):
        cells = [curves[k][i] for k in curves] + [v[i] for v in result.get("gpu", {}).values() if i < len(v)]
        print(f"{i + 1:>4} " + " ".join(f"{c:>22.4f}" for c in cells))
    if "gpu" in result:
        late = slice(args.steps * 2 // 3, None)
        gaps = {"project (CPU) vs project (GPU)": max(abs(a - b) for a, b in zip(curves["project"], result["gpu"]["project"])),
                "formulation (CPU) vs FusedLamb (GPU)": max(abs(a - b) for a, b in
                                                           zip(curves["fusedlamb_formulation"], result["gpu"]["deepspeed"])),
                "project vs FusedLamb, GPU, last third": abs(sum(result["gpu"]["project"][late]) / len(result["gpu"]["project"][late]) -
                                                            sum(result["gpu"]["deepspeed"][late]) / len(result["gpu"]["deepspeed"][late]))}
        result["largest_gaps"] = gaps
        for k, v in gaps.items():
            print(f"{k}: {v:.4f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
