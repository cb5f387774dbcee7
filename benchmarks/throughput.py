"""Single-device training throughput: the padded dense baseline and this project's path, side
by side in one process, on real text.

- padded_baseline: HF `BertForPreTraining` (SDPA attention, HF's default) on batches padded to
  --seq-len, with HF's dense masked-LM loss (labels -100 on unmasked positions): what
  `run_mlm --pad_to_max_length` or NVIDIA's padded BERT compute.
- padded_sparse_head: the same padded batches through HF's encoder, with the MLM head on the
  masked positions only (gathered before the head), as Google's and NVIDIA's BERT do.
- project: the model train.py runs (commodity_bert.model.bert.PretrainingModel): stratified batches
  trimmed to their longest sample, real tokens only through every layer but attention, the
  MLM head on masked tokens only.
- project_compiled (only when asked for): the project's path under `torch.compile(dynamic=True)`;
  its compilation happens in the warm-up round and is not timed. It tells whether train.py's
  opt-in `--compile` pays on a device (on the CPU: not in fp32, ~10% in bf16; RESULTS.md).
- project_jagged (only when asked for): the project's path with attention on nested jagged
  tensors of the real tokens (`"commodity_bert": {"attention": {"layout": "jagged"}}` in
  train.py): no scatter into the padded layout and gather back; on a GPU SDPA's variable-length
  FlashAttention kernel.
- engine_lamb (only when asked for): the project's model as train.py trains it, in DeepSpeed's
  engine (`train.engine.build_engine`, world size 1): weights in the precision itself (bf16
  weights as DeepSpeed's bf16 mode keeps them: no autocast casts each forward), the fp32 master
  copies in DeepSpeed's wrapper with the project's one-pass step (optim/precision.py), the
  project's LAMB, gradient clipping at 1.0. `engine_lamb_deepspeed_step` is the same with
  DeepSpeed's own wrapper step (tensor by tensor), to show what the one-pass step changes.
- project_checkpointed (only when asked for): the project's path with activation checkpointing
  (`"commodity_bert": {"activation_checkpointing": {"enabled": true}}` in train.py); on CUDA the
  `step_memory_gb` column shows the memory it saves.

Both train on the same samples (the project's stratified micro-batches; the baseline gets them
padded), with the same optimizer (AdamW) and autocast precision, forward + backward + step.
Batches are built before timing, so this measures the device, not the loader (train.py's
`data_wait_s` metric covers that). Paths alternate over --repeats rounds; figures are medians.

Columns: real tokens/s; `computed_over_real`: tokens the encoder's layers process ÷ real
tokens (attention's own ratio, query-key pairs scored ÷ pairs within sequences, is given
apart); `tflops`: model FLOPs of the real work (real tokens, attention within sequences, the
head on masked tokens; the same for both paths) per second, so ratios between paths are speed
ratios; `executed_tflops`: the FLOPs the path really performs; `mfu`: tflops ÷ `peak_tflops`,
a large square matmul in the same dtype timed on the same device in the same run.

    python benchmarks/throughput.py [--device cpu|cuda] [--model mini] [--seq-len 128]
        [--precision fp32|bf16|fp16] [--micro-batch 16] [--input embedded:sotu] [--json OUT]
"""
from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]  # site-packages may hold another `benchmarks`

from bench_common import make_shards, single_rank_environment

from commodity_bert.data import shard_format as fmt
from commodity_bert.data.dataset import ShardSet
from commodity_bert.data.loader import TrainingBatches
from commodity_bert.model.bert import (
    PretrainingModel,
    build_config,
    build_model,
    training_flops,
    use_activation_checkpointing,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def prepare_data(input_spec: str, seq_len: int, work: Path) -> Path:
    name = Path(input_spec.removeprefix("embedded:")).stem
    return make_shards(work / f"{name}_seq{seq_len}", input_spec, seq_len, "--dupe-factor", "1",
                       "--num-shards", "2", "--val-fraction", "0.01")


def project_batches(data: Path, micro_batch: int, count: int) -> list[dict]:
    batches = TrainingBatches(ShardSet.open(data), rank=0, world=1, micro_batch=micro_batch, seed=1, num_workers=0)
    stream = iter(batches)
    return [next(stream) for _ in range(count)]


def padded_batch(batch: dict, seq_len: int, nsp: bool) -> dict:
    """The same samples padded to seq_len, with dense labels (-100 where nothing is masked)."""
    sequences, width = batch["input_ids"].shape

    def pad(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(x, (0, seq_len - width))

    labels = torch.full((sequences * seq_len,), -100, dtype=torch.long)
    index = batch["masked_index"]
    labels[index // width * seq_len + index % width] = batch["masked_labels"]
    padded = {"input_ids": pad(batch["input_ids"]), "attention_mask": pad(batch["attention_mask"]),
              "token_type_ids": pad(batch["token_type_ids"]), "labels": labels.view(sequences, seq_len)}
    if nsp:
        padded["next_sentence_label"] = batch["next_sentence_labels"]
    return padded


def matmul_peak_tflops(device: torch.device, dtype: torch.dtype, size: int, repeats: int = 5) -> float:
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(repeats + 1):
        synchronize(device)
        started = time.perf_counter()
        for _ in range(4):
            a @ b
        synchronize(device)
        best = min(best, (time.perf_counter() - started) / 4)
    return 2 * size ** 3 / best / 1e12


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class PaddedSparseHead(torch.nn.Module):
    """Google's and NVIDIA's BERT: the encoder on padded batches, the MLM head only on the
    masked positions, gathered first (masked_lm_positions), instead of on every position."""

    def __init__(self, hf_model: torch.nn.Module):
        super().__init__()
        self.hf = hf_model

    def forward(self, input_ids, attention_mask, token_type_ids, masked_positions, masked_labels,
                next_sentence_label=None):
        encoder = self.hf.bert(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
        hidden = encoder.last_hidden_state.reshape(-1, encoder.last_hidden_state.shape[-1])[masked_positions]
        predictions = self.hf.cls.predictions(hidden) if next_sentence_label is not None else self.hf.cls(hidden)
        loss = torch.nn.functional.cross_entropy(predictions.float(), masked_labels)
        if next_sentence_label is not None:
            nsp = self.hf.cls.seq_relationship(encoder.pooler_output)
            loss = loss + torch.nn.functional.cross_entropy(nsp.float(), next_sentence_label)
        return loss


def padded_sparse_batch(batch: dict, seq_len: int, nsp: bool) -> dict:
    padded = padded_batch(batch, seq_len, nsp)
    labels = padded.pop("labels").reshape(-1)
    positions = (labels != -100).nonzero().squeeze(1)  # made before timing, as the shards store them
    return {**padded, "masked_positions": positions, "masked_labels": labels[positions]}

ENGINE_PATHS = ("engine_lamb", "engine_lamb_deepspeed_step")


def engine_for(name: str, model: torch.nn.Module, device: torch.device, precision: str, micro_batch: int):
    """train.py's engine around `model` at world size 1 (the process group made here if none is)."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    from commodity_bert.train.engine import build_engine
    if not dist.is_initialized():
        single_rank_environment()
        deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo",
                                   auto_mpi_discovery=False, verbose=False)
    config = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
              "steps_per_print": 10**9, "gradient_clipping": 1.0,
              "optimizer": {"type": "Lamb", "params": {"lr": 1e-3, "weight_decay": 0.01}},
              "bf16": {"enabled": precision == "bf16"},
              "fp16": {"enabled": precision == "fp16", "loss_scale": 0, "initial_scale_power": 16}}
    engine = build_engine(config, model).engine
    if name == "engine_lamb_deepspeed_step" and isinstance(engine.optimizer, FP16_UnfusedOptimizer):
        engine.optimizer.__class__ = FP16_UnfusedOptimizer  # back to DeepSpeed's own step()
    return engine


class TrainingPath:
    """One way of training: a model, its batches on the device, and its step function."""

    def __init__(self, name: str, model: torch.nn.Module, batches: list[dict], device: torch.device,
                 precision: str, executed_flops: float):
        self.name, self.model, self.device, self.precision = name, model.to(device), device, precision
        self.batches = [{k: v.to(device) for k, v in b.items()} for b in batches]
        self.executed_flops = executed_flops  # per pass over the batches
        self.engine = engine_for(name, model, device, precision, len(batches[0]["input_ids"])) \
            if name in ENGINE_PATHS else None
        fused = device.type == "cuda"
        self.optimizer = None if self.engine else torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
        self.scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
        self.step_memory_gb: float | None = None  # CUDA only

    def loss(self, batch: dict) -> torch.Tensor:
        if self.name.startswith("project"):
            return self.model(batch)[0]
        if self.name == "padded_sparse_head":
            return self.model(**batch)
        return self.model(**batch).loss


    def run(self) -> float:
        """Seconds for one pass over the batches, one optimizer step per batch. On CUDA it also
        keeps the most memory a step took above what was held before it (activations, gradients,
        the optimizer's transients: what activation checkpointing trades for time)."""
        synchronize(self.device)
        if self.device.type == "cuda":
            before = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        started = time.perf_counter()
        for batch in self.batches:
            if self.engine is not None:
                loss, _ = self.engine(batch)
                self.engine.backward(loss)
                self.engine.step()
                continue
            with torch.autocast(self.device.type, dtype=DTYPES[self.precision], enabled=self.precision != "fp32"):
                loss = self.loss(batch)
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
        synchronize(self.device)
        seconds = time.perf_counter() - started
        if self.device.type == "cuda":
            step_memory = (torch.cuda.max_memory_allocated(self.device) - before) / 2**30
            self.step_memory_gb = max(self.step_memory_gb or 0.0, step_memory)
        return seconds

    def release(self) -> None:
        self.model = self.optimizer = self.batches = self.engine = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def measure(device: torch.device, model_name: str, data: Path, precision: str, micro_batch: int, steps: int,
            repeats: int, path_names: list[str], peak: float | None = None) -> list[dict]:
    """One row per path: the same `steps` micro-batches of `data`, timed `repeats` times each after
    a warm-up, paths alternating. `peak`: the matmul peak if already measured in this process."""
    manifest = fmt.load_manifest(data)
    seq_len = manifest["seq_len"]
    batches = project_batches(data, micro_batch, steps)
    config = build_config(model_name, manifest["vocab"]["size"])
    real_tokens = sum(int(b["real_tokens"]) for b in batches)
    sequences = sum(b["input_ids"].shape[0] for b in batches)
    masked = sum(b["masked_index"].numel() for b in batches)
    pairs_within = sum(int((b["attention_mask"].sum(1) ** 2).sum()) for b in batches)
    pairs_trimmed = sum(b["input_ids"].shape[0] * b["input_ids"].shape[1] ** 2 for b in batches)
    padded_tokens = sequences * seq_len
    model_flops = training_flops(config, real_tokens, pairs_within, masked)
    pairs_padded = sequences * seq_len ** 2
    plan = {  # tokens through the encoder's layers, query-key pairs scored, FLOPs executed
        "padded_baseline": {"computed": padded_tokens, "pairs": pairs_padded,
                            "executed": training_flops(config, padded_tokens, pairs_padded, padded_tokens)},
        "padded_sparse_head": {"computed": padded_tokens, "pairs": pairs_padded,
                               "executed": training_flops(config, padded_tokens, pairs_padded, masked)},
        "project": {"computed": real_tokens, "pairs": pairs_trimmed,
                    "executed": training_flops(config, real_tokens, pairs_trimmed, masked)},
    }
    plan["project_compiled"] = plan["project"]
    plan["project_jagged"] = {**plan["project"], "pairs": pairs_within,
                              "executed": training_flops(config, real_tokens, pairs_within, masked)}
    for name in ENGINE_PATHS:
        plan[name] = plan["project"]
    # activation checkpointing runs each layer's forward twice: 4/3 of the FLOPs, minus the head's
    plan["project_checkpointed"] = {**plan["project"], "executed": plan["project"]["executed"] +
                                    training_flops(config, real_tokens, pairs_trimmed, 0) / 3}

    paths = []
    torch.manual_seed(0)
    base_model = build_model(config, nsp=manifest["nsp"])
    for name in path_names:
        if name.startswith("padded"):
            hf = type(base_model)._from_config(copy.deepcopy(config), attn_implementation="sdpa")
            hf.load_state_dict(base_model.state_dict())
            if name == "padded_sparse_head":
                model, inputs = PaddedSparseHead(hf), [padded_sparse_batch(b, seq_len, manifest["nsp"])
                                                       for b in batches]
            else:
                model, inputs = hf, [padded_batch(b, seq_len, manifest["nsp"]) for b in batches]
            paths.append(TrainingPath(name, model, inputs, device, precision, plan[name]["executed"]))
        else:
            hf = copy.deepcopy(base_model)
            if name == "project_checkpointed":
                use_activation_checkpointing(hf)
            model = PretrainingModel(hf, attention="jagged" if name == "project_jagged" else "padded")
            if name == "project_compiled":
                model = torch.compile(model, dynamic=True)  # batch widths and token counts vary
            if name in ENGINE_PATHS and precision != "fp32":
                model = model.to(DTYPES[precision])  # what DeepSpeed's bf16/fp16 modes train
            paths.append(TrainingPath(name, model, batches, device, precision, plan[name]["executed"]))
    if peak is None:
        peak = matmul_peak_tflops(device, DTYPES[precision], 8192 if device.type == "cuda" else 2048)

    for path in paths:  # warm-up: allocator, kernels' autotuning, lazy optimizer state
        path.run()
    times = {path.name: [] for path in paths}
    for _ in range(repeats):
        for path in paths:
            times[path.name].append(path.run())

    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    rows = []
    for path in paths:
        seconds = statistics.median(times[path.name])
        tflops = model_flops / seconds / 1e12
        rows.append({
            "path": path.name, "device": device_name, "model": model_name, "seq_len": seq_len,
            "precision": precision, "micro_batch": micro_batch, "steps": steps,
            "seq_per_s": sequences / seconds, "tokens_per_s": real_tokens / seconds,
            "computed_over_real": plan[path.name]["computed"] / real_tokens,
            "attention_pairs_over_real": plan[path.name]["pairs"] / pairs_within,
            "tflops": tflops, "executed_tflops": path.executed_flops / seconds / 1e12,
            "mfu": tflops / peak, "peak_tflops": peak, "real_share": real_tokens / padded_tokens,
            "step_s_median": seconds / steps, "step_s_all": [t / steps for t in times[path.name]],
            "step_memory_gb": path.step_memory_gb,
        })
    for path in paths:  # free the device for the next measurement in this process
        path.release()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", default="mini", help="preset: tiny, mini, small, medium, base, large")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--precision", choices=list(DTYPES), help="default: bf16 on CUDA, fp32 on CPU")
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per round")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; figures are medians over them")
    parser.add_argument("--input", default="embedded:sotu", help="real text, as bert-data-prep shards --input")
    parser.add_argument("--data", help="existing shards to use instead (their sequence length wins)")
    parser.add_argument("--paths", nargs="+",
                        choices=["padded_baseline", "padded_sparse_head", "project", "project_compiled", "project_checkpointed", "project_jagged",
                                 *ENGINE_PATHS],
                        default=["padded_baseline", "project"])
    parser.add_argument("--work", help="directory for the prepared shards (default: a temporary one)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible; use --device cpu")
    precision = args.precision or ("bf16" if device.type == "cuda" else "fp32")
    if precision == "fp16" and device.type == "cpu":
        raise SystemExit("--precision fp16 needs CUDA (CPU autocast has no fp16 loss scaling here); use bf16 or fp32")
    if args.data:
        data = Path(args.data)
    else:
        data = prepare_data(args.input, args.seq_len, Path(args.work or tempfile.mkdtemp(prefix="throughput_")))
    rows = measure(device, args.model, data, precision, args.micro_batch, args.steps, args.repeats, args.paths)
    args.seq_len = rows[0]["seq_len"]
    peak, device_name = rows[0]["peak_tflops"], rows[0]["device"]
    real_share = rows[0]["real_share"]
    print(f"{args.model}, seq {args.seq_len}, {precision}, micro-batch {args.micro_batch}, {device_name}; "
          f"{args.data or args.input}: {real_share:.1%} of padded positions are real tokens; "
          f"matmul peak {peak:.2f} TFLOP/s")
    width = max(16, *(len(r['path']) for r in rows))
    print(f"{'path':<{width}} {'seq/s':>8} {'real tok/s':>11} {'computed/real':>13} {'attn pairs/real':>15} "
          f"{'TFLOP/s':>8} {'executed':>8} {'MFU':>6} {'step s':>7}")
    for r in rows:
        print(f"{r['path']:<{width}} {r['seq_per_s']:>8.1f} {r['tokens_per_s']:>11,.0f} {r['computed_over_real']:>13.3f} "
              f"{r['attention_pairs_over_real']:>15.3f} {r['tflops']:>8.3f} {r['executed_tflops']:>8.3f} "
              f"{r['mfu']:>6.1%} {r['step_s_median']:>7.3f}")
    by_name = {r["path"]: r for r in rows}
    for name in ("padded_sparse_head", "project", "project_compiled"):
        if name in by_name and "padded_baseline" in by_name:
            print(f"{name} / padded_baseline, real tokens/s: "
                  f"{by_name[name]['tokens_per_s'] / by_name['padded_baseline']['tokens_per_s']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
