"""Time to accuracy: train.py against the Hugging Face Trainer, same model, data, CPU and budget.

Both sides train the same `--model` from the same seed for the same wall-clock budget on the
same machine, one after the other, and are scored on the same held-out set by the same
function (masked-LM accuracy on the statically masked validation split of the shards).

- hf_trainer: what a user of `run_mlm.py` sets up: `BertForMaskedLM` (SDPA), the training
  split's token sequences as a `datasets.Dataset` (run_mlm's tokenized, grouped texts),
  `DataCollatorForLanguageModeling` (15% dynamic masking, padding to the longest in the batch),
  `Trainer` with AdamW, constant lr after warmup.
- project: `deepspeed train.py` on one rank with `ds_configs/cpu_tiny_lamb.json`'s LAMB, its
  stratified, unpadded batches and sparse MLM head, constant lr after warmup.

--precision applies to both: fp32 (run_mlm's default), or bf16 (the Trainer's `--bf16`, i.e.
CPU autocast; DeepSpeed's `"bf16": {"enabled": true}` for train.py).

Each side is evaluated every --eval-every-s seconds of its own training (evaluation time is
not counted) and at the end. The report: each side's accuracy over time, the hf_trainer's final
accuracy and how long the project took to reach it; a PNG plot and JSON.

--hf-steps N trains the Trainer side N optimizer steps (the time budget still caps it), so its
schedule can decay to 0 as train.py's configs do (`--hf-schedule linear --hf-warmup-ratio 0.1
--hf-beta2 0.98 --hf-lr 1e-3`: ds_configs/cpu_mini_adamw_bf16.json's recipe); a step budget also
keeps the model independent of what else runs on the machine. `--sides hf_trainer` runs that side
alone (beside a train.py run made elsewhere, e.g. by bert-ablate). The Trainer's last model is
always kept in WORK/snapshots/hf_trainer_final.

--snapshot-minutes 10 20 keeps each side's model as a Hugging Face directory (weights and
tokenizer, loadable by `bert-finetune --model`) in WORK/snapshots/{hf_trainer,project}_Mmin
after M minutes of training. Both schedules are constant after warmup, so the M-minute snapshot
of a longer run is what an M-minute run would have produced. The Trainer side saves from its
callback (saving not counted, as scoring is not); train.py runs in segments, each stopped by its
own --time-budget (kept across relaunches) and resumed from its checkpoint, its RUN/hf_model
copied after each.

Equal tokens (--sequences N): both sides train N sequences of the same shards (the same passes
over them), with one recipe, ds_configs/cpu_mini_adamw_bf16.json's (AdamW 1e-3, beta2 0.98, eps
1e-6, weight decay 0.01, clipping 1.0, linear warm-up over --warmup-ratio of the steps, then linear
decay to 0 at the last step), at the same micro-batch; no time budget stops either. Then
--finetune-tasks fine-tunes each side's final model with bert-finetune on those tasks at each of
--finetune-examples (a count, or all) over --finetune-seeds, random init once beside them: the
parity that matters is downstream, not in masked-LM accuracy.

    python benchmarks/vs_hf_trainer.py --sequences 25000 --input corpus/corpus.txt --precision bf16 \
        --finetune-tasks embedded:polarity embedded:party --finetune-examples 300 all --work W --json OUT
    python benchmarks/vs_hf_trainer.py [--model mini] [--minutes 10] [--snapshot-minutes 5 10]
        [--work DIR] [--json OUT] [--plot OUT.png]
    python benchmarks/vs_hf_trainer.py --sides hf_trainer --model mini --precision bf16 --hf-steps 800 \
        --hf-schedule linear --hf-warmup-ratio 0.1 --hf-beta2 0.98 --hf-lr 1e-3 --minutes 120 --work W
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]  # site-packages may hold another `benchmarks`
from bench_common import free_port, make_shards

BASE_CONFIG = REPO / "ds_configs" / "cpu_tiny_lamb.json"
ADAMW_CONFIG = REPO / "ds_configs" / "cpu_mini_adamw_bf16.json"  # --sequences: both sides' recipe


def prepare_data(work: Path, input_spec: str, seq_len: int) -> Path:
    """MLM-only shards (full-sentence packing, dynamic masking) of the real text."""
    name = Path(input_spec.removeprefix("embedded:")).stem
    return make_shards(work / f"{name}_seq{seq_len}_mlm", input_spec, seq_len, "--no-nsp", "--masking",
                       "dynamic", "--num-shards", "2", "--val-fraction", "0.02")


def masked_lm_accuracy(hf_model, val_batches) -> float:
    """The same score for both sides: the padded HF forward, argmax at the masked positions."""
    import torch
    correct = count = 0
    was_training = hf_model.training
    hf_model.eval()
    with torch.no_grad():
        for batch in val_batches:
            logits = hf_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                              token_type_ids=batch["token_type_ids"]).logits
            predicted = logits.reshape(-1, logits.shape[-1]).index_select(0, batch["masked_index"]).argmax(-1)
            correct += int((predicted == batch["masked_labels"]).sum())
            count += batch["masked_labels"].numel()
    hf_model.train(was_training)
    return correct / max(count, 1)


def run_hf_trainer(args) -> None:
    """The Trainer side, in its own process (as train.py runs in its own)."""
    import numpy as np
    import torch
    from datasets import Dataset
    from transformers import (
        BertForMaskedLM,
        BertTokenizerFast,
        DataCollatorForLanguageModeling,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    from commodity_bert.data import shard_format as fmt
    from commodity_bert.data.dataset import ShardSet
    from commodity_bert.data.loader import ValidationBatches, load_arrays
    from commodity_bert.model.bert import build_config

    data = Path(args.data)
    manifest = fmt.load_manifest(data)
    arrays = load_arrays(fmt.shard_paths(data, manifest, "train"))
    sequences = [row[:n].tolist() for row, n in zip(arrays["input_ids"], arrays["lengths"])]
    order = np.random.default_rng(args.seed).permutation(len(sequences))
    train_set = Dataset.from_dict({"input_ids": [sequences[i] for i in order]})
    tokenizer = BertTokenizerFast(vocab=str(data / fmt.VOCAB_NAME), do_lower_case=True)
    val = ValidationBatches(ShardSet.open(data), 0, 1, args.micro_batch)  # all of it, as train.py scores
    torch.manual_seed(args.seed)
    model = BertForMaskedLM._from_config(copy.deepcopy(build_config(args.model, manifest["vocab"]["size"])),
                                         attn_implementation="sdpa")
    budget, curve = args.minutes * 60, []
    began = time.perf_counter()
    snapshots = sorted(m for m in args.snapshot_minutes if m <= args.minutes)

    class TimeBudgetAndEval(TrainerCallback):
        """Stops at the wall-clock budget; evaluates every eval_every_s of training time and keeps
        the model at each snapshot minute."""

        def on_train_begin(self, targs, state, control, **kw):
            self.began, self.evaluating, self.last_eval = time.perf_counter(), 0.0, 0.0

        def on_step_end(self, targs, state, control, **kw):
            trained = time.perf_counter() - self.began - self.evaluating  # loading included, scoring not
            if trained >= budget:
                control.should_training_stop = True
            while snapshots and trained >= snapshots[0] * 60:
                saving = time.perf_counter()
                keep = Path(args.out).parent / "snapshots" / f"hf_trainer_{snapshots.pop(0):g}min"
                model.save_pretrained(str(keep))
                tokenizer.save_pretrained(str(keep))
                (keep / "pretraining.json").write_text(json.dumps({"elapsed_s": trained, "step": state.global_step}))
                self.evaluating += time.perf_counter() - saving
            if trained - self.last_eval >= args.eval_every_s or control.should_training_stop:
                self.last_eval = trained
                scoring = time.perf_counter()
                curve.append({"elapsed_s": trained, "step": state.global_step,
                              "val_mlm_acc": masked_lm_accuracy(model, val)})
                self.evaluating += time.perf_counter() - scoring
                print(json.dumps(curve[-1]), flush=True)

    targs = TrainingArguments(
        output_dir=str(Path(args.out) / "trainer"), per_device_train_batch_size=args.micro_batch,
        learning_rate=args.hf_lr, weight_decay=0.01, adam_beta2=args.hf_beta2, adam_epsilon=args.hf_eps,
        warmup_steps=round(args.hf_warmup_ratio * args.hf_steps) if args.hf_warmup_ratio else args.warmup_steps,
        lr_scheduler_type=args.hf_schedule, max_steps=args.hf_steps or 10 ** 7, logging_steps=50, save_strategy="no",
        report_to=[], use_cpu=True, dataloader_num_workers=1, seed=args.seed, disable_tqdm=True,
        bf16=args.precision == "bf16")
    trainer = Trainer(model=model, args=targs, train_dataset=train_set,
                      data_collator=DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15),
                      callbacks=[TimeBudgetAndEval()])
    trainer.train()
    Path(args.out, "curve.json").write_text(json.dumps(curve))
    keep = Path(args.out).parent / "snapshots" / "hf_trainer_final"
    model.save_pretrained(str(keep))
    tokenizer.save_pretrained(str(keep))
    (keep / "pretraining.json").write_text(json.dumps({
        "step": trainer.state.global_step, "samples": trainer.state.global_step * args.micro_batch,
        "wall_s": time.perf_counter() - began, "val_mlm_acc": curve[-1]["val_mlm_acc"] if curve else None}))


def run_project(args, data: Path, out: Path) -> list[dict]:
    config = json.loads((ADAMW_CONFIG if args.sequences else BASE_CONFIG).read_text())
    config["train_micro_batch_size_per_gpu"] = args.micro_batch
    if args.sequences:  # the recipe as it ships, its schedule spanning the run
        config["scheduler"]["params"].update({"warmup_num_steps": round(args.warmup_ratio * args.hf_steps),
                                              "total_num_steps": args.hf_steps})
    else:
        config["optimizer"]["params"]["lr"] = args.project_lr
        config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": args.project_lr,
                                                              "warmup_num_steps": args.warmup_steps,
                                                              "warmup_type": "linear"}}
    config["bf16"] = {"enabled": args.precision == "bf16"}
    out.mkdir(parents=True, exist_ok=True)
    (out / "ds_config.json").write_text(json.dumps(config))
    deepspeed = str(Path(sys.executable).parent / "deepspeed")
    # train.py scores the same validation split with the same definition (argmax at the masked
    # positions); its elapsed_s leaves its evaluations out, as the Trainer side does
    segments = sorted({m for m in args.snapshot_minutes if m < args.minutes} | {args.minutes})
    for i, minutes in enumerate(segments):
        cmd = [deepspeed, "--num_gpus", "1", "--master_port", str(free_port()), "train.py",
               "--deepspeed_config", str(out / "ds_config.json"), "--data", str(data), "--model", args.model,
               "--output-dir", str(out / "run"), "--time-budget", f"{minutes * 60}s",
               "--max-steps", str(args.hf_steps if args.sequences else 1000000),
               "--log-every", "10", "--eval-every", str(args.project_eval_every), "--num-workers", "1",
               "--save-every-minutes", "0", "--seed", str(args.seed), "--resume", "auto" if i else "none"]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
        if proc.returncode:
            raise SystemExit(f"train.py failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
        if minutes in args.snapshot_minutes:
            keep = out.parent / "snapshots" / f"project_{minutes:g}min"
            shutil.rmtree(keep, ignore_errors=True)
            shutil.copytree(out / "run" / "hf_model", keep)
            summary = json.loads((out / "run" / "summary.json").read_text())
            (keep / "pretraining.json").write_text(json.dumps({"elapsed_s": summary["trained_s"],
                                                               "wall_s": summary["wall_s"], "step": summary["step"]}))
    rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    return [{"elapsed_s": r["elapsed_s"], "step": r["step"], "val_mlm_acc": r["val_mlm_acc"]}
            for r in rows if "val_mlm_acc" in r]


def finetune_both(args, work: Path) -> list[dict]:
    """Each side's final model fine-tuned by bert-finetune on every task and label count, the
    same seeds and lr grid; random init once per task and count (with the project's call)."""
    models = {"project": work / "project" / "run" / "hf_model", "hf_trainer": work / "snapshots" / "hf_trainer_final"}
    rows = []
    for task in args.finetune_tasks:
        for examples in args.finetune_examples:
            for side, model in models.items():
                out = work / "downstream" / f"{side}_{task.replace(':', '_')}_{examples}.json"
                cmd = [sys.executable, "-m", "commodity_bert.finetune", "--model", str(model), "--task", task,
                       "--seeds", *map(str, args.finetune_seeds),
                       *(["--lr-grid", *map(str, args.finetune_lr_grid)] if args.finetune_lr_grid else []),
                       "--quiet", "--json", str(out), *(["--random-init"] if side == "project" else []),
                       *([] if examples == "all" else ["--train-examples", examples])]
                proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
                if proc.returncode:
                    raise SystemExit(f"bert-finetune failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
                result = json.loads(out.read_text())
                arms = [(side, result)] + ([("random_init", result["random_init"])] if result.get("random_init") else [])
                for arm, r in arms:
                    rows.append({"task": task, "examples": examples, "train_size": result["train_size"], "arm": arm,
                                 "median": r["median"], "min": r["min"], "max": r["max"], "lr": r["lr"],
                                 "per_seed": [x["value"] for x in r["per_seed"]], "json": str(out)})
                print(f"{task} N={examples} {side}: {100 * result['median']:.1f}% ({100 * result['min']:.1f}–"
                      f"{100 * result['max']:.1f})", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="mini")
    parser.add_argument("--minutes", type=float, default=10.0, help="wall-clock training budget of each side")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--input", default="embedded:sotu", help="real text, as bert-data-prep shards --input")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32", help="of both sides")
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--hf-lr", type=float, default=5e-4, help="AdamW lr for the Trainer (from scratch)")
    parser.add_argument("--project-lr", type=float, default=5e-3, help="LAMB lr for train.py")
    parser.add_argument("--warmup-steps", type=int, default=30)
    parser.add_argument("--hf-steps", type=int, default=0, help="the Trainer's optimizer steps (0: the time budget)")
    parser.add_argument("--hf-schedule", choices=["constant_with_warmup", "linear"], default="constant_with_warmup",
                        help="the Trainer's lr schedule (linear: decay to 0 at --hf-steps)")
    parser.add_argument("--hf-warmup-ratio", type=float, default=0.0,
                        help="the Trainer's warm-up as a fraction of --hf-steps (0: --warmup-steps)")
    parser.add_argument("--hf-beta2", type=float, default=0.999, help="the Trainer's AdamW beta2")
    parser.add_argument("--hf-eps", type=float, default=1e-8, help="the Trainer's AdamW epsilon")
    parser.add_argument("--sequences", type=int, default=0,
                        help="equal tokens: both sides train this many sequences with one AdamW recipe, no time budget")
    parser.add_argument("--warmup-ratio", type=float, default=0.1, help="--sequences: warm-up share of the steps")
    parser.add_argument("--finetune-tasks", nargs="*", default=[], help="bert-finetune each side's model on these")
    parser.add_argument("--finetune-examples", nargs="+", default=["300", "all"],
                        help="label counts (bert-finetune --train-examples), or all")
    parser.add_argument("--finetune-seeds", type=int, nargs="+", default=[1, 2, 3])
    # bert-finetune's own grid by default: the pretrained arm chose its smallest rate, 3e-5, in 3
    # of the H200 gain curve's 5 cells (benchmarks/results/gain_curve/gain_curve_h200_mini_rows.json,
    # 2026-11-27), which 3e-4 1e-3 lacks
    parser.add_argument("--finetune-lr-grid", type=float, nargs="+", help="default: bert-finetune's own")
    parser.add_argument("--sides", default="project,hf_trainer", help="which sides to run, comma-separated")
    parser.add_argument("--eval-every-s", type=float, default=60.0)
    parser.add_argument("--project-eval-every", type=int, default=25, help="train.py evaluates every N steps")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--snapshot-minutes", type=float, nargs="*", default=[],
                        help="keep each side's model after these minutes (WORK/snapshots/SIDE_Mmin)")
    parser.add_argument("--work", help="directory for data and runs (default: a temporary one)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--plot", help="write a PNG of accuracy against time here")
    parser.add_argument("--run-trainer", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.sequences:
        if args.sequences < args.micro_batch:
            raise SystemExit(f"--sequences {args.sequences}: give at least one micro-batch ({args.micro_batch})")
        # one recipe for both sides (ADAMW_CONFIG's), the same steps, no time budget
        recipe = json.loads(ADAMW_CONFIG.read_text())["optimizer"]["params"]
        args.hf_steps, args.hf_schedule, args.hf_warmup_ratio = args.sequences // args.micro_batch, "linear", args.warmup_ratio
        args.hf_lr, args.hf_beta2, args.hf_eps = recipe["lr"], recipe["betas"][1], recipe["eps"]
        args.minutes = 10 ** 6
    if args.run_trainer:
        run_hf_trainer(args)
        return

    sides = set(args.sides.split(","))
    if not sides or sides - {"project", "hf_trainer"}:
        raise SystemExit(f"--sides {args.sides}: name project, hf_trainer or both, comma-separated")
    if (args.hf_schedule == "linear" or args.hf_warmup_ratio) and not args.hf_steps:
        raise SystemExit("--hf-schedule linear and --hf-warmup-ratio need --hf-steps (the step the schedule ends at)")
    work = Path(args.work or tempfile.mkdtemp(prefix="vs_trainer_"))
    data = prepare_data(work, args.input, args.seq_len)
    machine = f"{platform.machine()}, {os.cpu_count()} cores"

    def curve_line(name: str, curve: list[dict]) -> str:
        return f"{name:<11} " + ", ".join(f"{r['elapsed_s'] / 60:.1f} min (step {r['step']}): {r['val_mlm_acc']:.2%}"
                                          for r in curve)

    def write_json(result: dict) -> None:
        if args.json:
            Path(args.json).write_text(json.dumps({"machine": machine, "args": vars(args), **result}, indent=1))

    started = time.time()
    project = run_project(args, data, work / "project") if "project" in sides else []
    project_wall = time.time() - started
    if "hf_trainer" not in sides:
        print(curve_line("project", project))
        return write_json({"project": project, "project_wall_s": project_wall})
    trainer_out = work / "hf_trainer"
    proc = subprocess.run([sys.executable, __file__, "--run-trainer", "--data", str(data), "--out", str(trainer_out),
                           *[a for a in sys.argv[1:] if a not in ("--run-trainer",)]],
                          cwd=REPO, capture_output=True, text=True, check=False, env={**os.environ})
    if proc.returncode:
        raise SystemExit(f"HF Trainer run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    trainer = json.loads((trainer_out / "curve.json").read_text())

    if "project" not in sides:
        print(curve_line("hf_trainer", trainer))
        return write_json({"hf_trainer": trainer})
    target = trainer[-1]["val_mlm_acc"]
    reached = next((r for r in project if r["val_mlm_acc"] >= target), None)
    print(f"{args.model}, seq {args.seq_len}, {args.precision}, micro-batch {args.micro_batch}, "
          + (f"{args.sequences:,} sequences ({args.hf_steps} steps) each" if args.sequences else f"{args.minutes:g} min each")
          + f"; {machine}")
    for name, curve in (("hf_trainer", trainer), ("project", project)):
        print(curve_line(name, curve))
    if reached:
        print(f"hf_trainer's final accuracy {target:.2%} ({trainer[-1]['elapsed_s'] / 60:.1f} min): the project "
              f"reached it at {reached['elapsed_s'] / 60:.1f} min "
              f"({reached['elapsed_s'] / trainer[-1]['elapsed_s']:.2f} of the time)")
    else:
        print(f"hf_trainer's final accuracy {target:.2%}: the project did not reach it "
              f"(final {project[-1]['val_mlm_acc']:.2%})")
    downstream = finetune_both(args, work) if args.finetune_tasks else None
    write_json({"hf_trainer": trainer, "project": project, "target": target,
                "project_reached_at_s": reached["elapsed_s"] if reached else None, "project_wall_s": project_wall,
                "downstream": downstream})
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, curve in (("HF Trainer (AdamW, padded, dense head)", trainer),
                            ("train.py (LAMB, unpadded, sparse head)", project)):
            ax.plot([r["elapsed_s"] / 60 for r in curve], [100 * r["val_mlm_acc"] for r in curve], marker="o",
                    label=name)
        ax.axhline(100 * target, color="gray", linestyle=":", linewidth=1)
        ax.set_xlabel("training wall time (min)")
        ax.set_ylabel("held-out masked-LM accuracy (%)")
        ax.set_title(f"{args.model}, {args.precision}, on {machine}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)


if __name__ == "__main__":
    main()
