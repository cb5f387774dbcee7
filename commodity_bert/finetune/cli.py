"""bert-finetune: fine-tune a pretrained BERT on a task over several seeds and report the dev
metric beside baselines that need no pretraining (and, with --random-init, the same
architecture fine-tuned from random weights), so a reader sees what pretraining bought. Three
families, told apart by the files' layout: sentence (pair) classification, beside the majority
class and a bag-of-words logistic regression; extractive QA (SQuAD's JSON), exact match and F1
beside a sliding-window word-overlap answer; token tagging (CoNLL columns, JSONL tokens + tags),
entity F1 beside each word's most frequent tag. The learning rate and the number of steps are chosen per arm by cross-validation on
the training data (--lr auto, the default; never on dev), and a collapsed pretrained model is named.

    bert-finetune --model RUN --task embedded:polarity --random-init
    bert-finetune --model RUN/hf_model --train train.csv --validation dev.csv --text-field review
    bert-finetune --model RUN --glue MRPC glue_data/MRPC --json mrpc.json
    bert-finetune --model RUN --train squad/train-v1.1.json --validation squad/dev-v1.1.json --max-seq-len 384
    bert-finetune --model RUN --train ner/train.conll --validation ner/dev.conll
    bert-finetune --watch RUN --task embedded:polarity     # probe each checkpoint as it appears
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import sys
from pathlib import Path

from commodity_bert.cli_help import one_line_parser, show_defaults
from commodity_bert.finetune.evaluation import evaluate
from commodity_bert.finetune.families import DEFAULT, FAMILIES, embedded_tasks, families
from commodity_bert.finetune.metrics import METRICS
from commodity_bert.host import atomic_write_text
from commodity_bert.finetune.models import POOLINGS, ModelError
from commodity_bert.finetune.tasks import TaskError

PROG = "bert-finetune"
DEFAULT_FOLDS = 3  # --lr-folds when not given: a tenth of 1,000 rows is too few to rank rates (docs/evaluation.md)


class UsageError(Exception):
    """Bad or incompatible flags; the message is one line for the user."""


OneLineParser = one_line_parser(UsageError)


def fail(message: str, status: int = 2):
    print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(status)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = p.add_argument_group("the model")
    which.add_argument("--model", type=Path, help="a RUN directory, an exported hf_model, a Hugging Face BERT "
                       "directory with its tokenizer, or a checkpoint RUN/checkpoints/step_N")
    which.add_argument("--watch", type=Path, metavar="RUN", help="probe each new checkpoint and export of this "
                       "(running or finished) run; rows go to RUN/downstream.jsonl and its TensorBoard")
    task = p.add_argument_group("the task (one of)")
    task.add_argument("--task", help=f"an embedded task: {', '.join(embedded_tasks())}")
    task.add_argument("--glue", nargs=2, metavar=("TASK", "DIR"),
                      help="GLUE's own TSVs: SST-2, CoLA, MRPC, QQP, QNLI, RTE or MNLI, and the directory of its "
                           "train.tsv and dev.tsv (MNLI: dev_matched.tsv)")
    task.add_argument("--train", type=Path, help="classification: CSV/TSV with a header row, JSONL, or a save_to_disk "
                      "dataset; extractive QA: SQuAD's JSON (or its rows as JSONL / a saved dataset); token "
                      "tagging: CoNLL columns (.conll, .iob, .bio, .txt, .tsv) or JSONL tokens + tags")
    task.add_argument("--validation", type=Path, help="the dev set, in the same form")
    task.add_argument("--family", choices=sorted(FAMILIES), help="the task family (default: from the --train file's "
                      "layout: SQuAD's JSON is qa, CoNLL columns and JSONL tokens + tags are tagging, the rest "
                      "classification; .txt/.tsv files are tagging only when named so)")
    task.add_argument("--text-field", default="text")
    task.add_argument("--text-pair-field", help="the second text of sentence-pair tasks")
    task.add_argument("--label-field", default="label")
    task.add_argument("--metric", choices=METRICS, help="default: accuracy (GLUE tasks: GLUE's own)")
    task.add_argument("--positive-label", help="F1's positive class (default: the last label in sorted order)")
    task.add_argument("--train-examples", type=int, metavar="N",
                      help="fine-tune on N rows of the training split, stratified by label, the same rows for "
                           "every arm and seed (--lr auto holds its slice out of these N); default: all")
    task.add_argument("--write-train-text", type=Path, metavar="FILE",
                      help="write the task's training texts (with --train-examples, those rows), one document "
                           "each, to FILE (.txt) for bert-data-prep, and exit: the unlabelled text recipes/adapt.sh "
                           "continues pretraining on; never the dev split")
    hp = p.add_argument_group("fine-tuning, the same for every task unless told")
    hp.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    hp.add_argument("--epochs", type=float, default=3.0)
    hp.add_argument("--lr", default="auto", help="a learning rate, or auto (default): the best of --lr-grid "
                    "at each length of --steps-grid, by --lr-folds cross-validation on the training rows, for each "
                    "arm")
    hp.add_argument("--lr-grid", type=float, nargs="+", help="rates --lr auto tries (default: 3e-5 1e-4 3e-4 1e-3 "
                    "for models narrower than BERT-base, else 3e-5 5e-5 1e-4 3e-4)")
    hp.add_argument("--lr-folds", type=int, metavar="K",
                    help="--lr auto scores each rate (and length) by K-fold cross-validation on the training "
                         "rows, K fine-tunings each (default 3); 1: one held-out slice of a tenth, K times cheaper "
                         "and noisier")
    hp.add_argument("--early-stopping", action=argparse.BooleanOptionalAction, default=True,
                    help="--lr auto chooses the number of steps with the rate, by the same cross-validation: each "
                         "length of --steps-grid a whole schedule (warm-up, decay to 0 at its end), and the "
                         "chosen one re-run so for every seed; --no-early-stopping: the full length alone")
    hp.add_argument("--steps-grid", type=int, nargs="+", metavar="N",
                    help="the lengths --early-stopping tries, in optimizer steps (default: a quarter, a half and "
                         "all of the schedule --epochs and --min-steps give)")
    hp.add_argument("--layer-lr-decay", type=float, default=1.0, metavar="D",
                    help="each encoder layer fine-tunes at D times the rate of the layer above it, the top layer "
                         "at D times the head's, the embeddings lowest (ELECTRA's 0.8; default 1: one rate)")
    hp.add_argument("--min-steps", type=int, help="at least this many optimizer steps (more epochs for a small "
                    "task; default: " + ", ".join(f"{f.min_steps} for {f.description}" for f in families()) + ")")
    hp.add_argument("--pooling", choices=POOLINGS, default="mean",
                    help="what the classifier reads: mean of the final states (default), HF's pooler (dense + "
                         "tanh on [CLS], untrained after MLM-only pretraining), or the [CLS] state")
    hp.add_argument("--reinit-layers", type=int, default=0, metavar="N",
                    help="the pretrained model's top N encoder layers start from BERT's initialisation (Zhang et "
                         "al. 2020); default 0")
    hp.add_argument("--head-lr", type=float, metavar="LR",
                    help="the classifier head's own learning rate, whatever the encoder's (default: the same)")
    hp.add_argument("--head-init", choices=("fresh", "probe"), default="fresh",
                    help="the classifier head starts fresh (default) or as a logistic regression on the frozen "
                         "encoder's features of the training rows (linear probing then fine-tuning, Kumar et "
                         "al. 2022), in every arm")
    hp.add_argument("--stride", type=int, metavar="N", help="extractive QA: tokens two windows of a long context "
                    "share (default: a quarter of --max-seq-len)")
    hp.add_argument("--batch-size", type=int, default=32)
    hp.add_argument("--max-seq-len", type=int, default=128)
    hp.add_argument("--warmup-fraction", type=float, default=0.1)
    hp.add_argument("--weight-decay", type=float, default=0.01)
    hp.add_argument("--dropout", type=float, default=0.1)
    hp.add_argument("--precision", choices=("auto", "fp32", "bf16", "fp16"), default="auto",
                    help="auto: bf16 autocast on GPUs with bf16 (compute capability 8.0+) and on CPUs with "
                         "AVX-512 BF16; fp16 autocast with a loss scale on older GPUs (V100, T4, RTX 20xx); "
                         "else fp32")
    hp.add_argument("--random-init", action="store_true",
                    help="also fine-tune the same architecture from random weights, with the same seeds")
    run = p.add_argument_group("where and how")
    run.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    run.add_argument("--threads", type=int, help="CPU threads (default: torch's, one per core)")
    run.add_argument("--cache-dir", type=Path, help="tokenized tasks (default: ~/.cache/commodity_bert/finetune)")
    run.add_argument("--no-cache", action="store_true", help="tokenize again and keep nothing")
    run.add_argument("--json", type=Path, help="write the result object here")
    run.add_argument("--quiet", action="store_true", help="no progress bars")
    run.add_argument("--check-only", action="store_true",
                     help="check the flags and read the task's files, then exit: 0, or 2 with the error line "
                          "(train.py --watch-downstream checks its flags so before the first step)")
    watch = p.add_argument_group("--watch")
    watch.add_argument("--poll-seconds", type=float, default=30.0)
    watch.add_argument("--once", action="store_true", help="probe what is there now, then exit")
    watch.add_argument("--stop-with-pid", type=int, help="exit once this process (the training) has ended "
                       "and its last export is probed")
    return show_defaults(p)


def check_arguments(args) -> None:
    if args.write_train_text is not None:
        if args.model is not None or args.watch is not None:
            raise UsageError("--write-train-text writes a task's text and exits; it takes no --model or --watch")
    elif (args.model is None) == (args.watch is None):
        raise UsageError("give --model PATH (fine-tune it) or --watch RUN (probe a run's checkpoints), one of them")
    sources = [args.task is not None, args.glue is not None, args.train is not None or args.validation is not None]
    if sum(sources) != 1:
        raise UsageError("name one task: --task embedded:polarity, --glue TASK DIR, or --train FILE --validation FILE")
    if sources[2] and (args.train is None or args.validation is None):
        raise UsageError("--train and --validation go together")
    if args.lr != "auto":
        try:
            args.lr = float(args.lr)
        except ValueError:
            raise UsageError(f"--lr {args.lr}: give a number such as 1e-4, or auto") from None
        if args.lr_grid:
            raise UsageError("--lr-grid goes with --lr auto; give one or the other")
    for name in ("epochs", "batch_size", "max_seq_len"):
        if not getattr(args, name) > 0 or not math.isfinite(getattr(args, name)):  # nan and inf too
            raise UsageError(f"--{name.replace('_', '-')} {getattr(args, name)}: give a positive number")
    rates = [args.lr] if args.lr != "auto" else []
    if any(not (lr > 0 and math.isfinite(lr)) for lr in [*rates, *(args.lr_grid or [])]):
        raise UsageError("--lr and --lr-grid must be positive numbers")
    if args.lr_folds is not None:
        if not 1 <= args.lr_folds <= 10:
            raise UsageError(f"--lr-folds {args.lr_folds}: give 1 (one held-out slice) to 10 folds")
        if args.lr_folds > 1 and args.lr != "auto":
            raise UsageError("--lr-folds goes with --lr auto; a fixed --lr selects nothing")
    args.lr_folds = DEFAULT_FOLDS if args.lr_folds is None else args.lr_folds
    if args.steps_grid is not None:
        if args.lr != "auto" or not args.early_stopping:
            raise UsageError("--steps-grid goes with --lr auto and --early-stopping; a fixed --lr selects nothing")
        if any(n <= 0 for n in args.steps_grid) or len(set(args.steps_grid)) != len(args.steps_grid):
            raise UsageError("--steps-grid: give distinct positive step counts, e.g. 50 100 200")
    if not (0 < args.layer_lr_decay <= 1):
        raise UsageError(f"--layer-lr-decay {args.layer_lr_decay}: give a factor in (0, 1], e.g. 0.8; 1 is off")
    if args.head_lr is not None and not (args.head_lr > 0 and math.isfinite(args.head_lr)):
        raise UsageError("--head-lr must be positive")
    if args.min_steps is not None and args.min_steps < 0:
        raise UsageError("--min-steps must be 0 or more")
    if args.threads is not None and args.threads <= 0:
        raise UsageError("--threads must be positive")
    if not 0 <= args.dropout < 1 or not 0 <= args.warmup_fraction <= 1:
        raise UsageError("--dropout must be in [0, 1) and --warmup-fraction in [0, 1]")
    if len(set(args.seeds)) != len(args.seeds):
        raise UsageError("--seeds: each seed once")
    if args.stride is not None and args.stride < 0:
        raise UsageError("--stride must be 0 or more")
    if args.json is not None and (Path(args.json).is_dir() or not Path(args.json).resolve().parent.is_dir()):
        raise UsageError(f"--json {args.json}: give a file's path in an existing directory")


def family_of(args) -> str:
    """The family of the --task named, else the one --family names, else the one the --train
    file's layout says (the first family that recognises it)."""
    if args.task is not None:
        embedded = embedded_tasks()
        if args.task not in embedded:
            raise TaskError(f"--task {args.task}: unknown; embedded tasks: {', '.join(embedded)}")
        return embedded[args.task].name
    if args.family or args.glue is not None or args.train is None:
        return args.family or DEFAULT
    return next((f.name for f in families() if f.detects is not None and f.detects(args.train)), DEFAULT)


def load_task(args):
    family = FAMILIES[family_of(args)]
    for other in families():  # a flag only another family takes would be ignored: refused
        if other is not family and (given := other.own_flags(args)):
            raise UsageError(f"{given[0]} is for {other.description}; this task is {family.name}")
    task = family.embedded[args.task]() if args.task is not None else family.from_files(args)
    return task if args.train_examples is None else family.sample_train(task, args.train_examples)


def write_train_text(task, path: Path) -> None:
    """The training split's texts as bert-data-prep's .txt (a blank line ends a document; a
    sentence pair is one document of two lines), written to a temporary name and renamed."""
    if path.is_dir():
        raise UsageError(f"--write-train-text {path}: a directory; give a file name such as {path}/train.txt")
    if not path.parent.is_dir():
        raise UsageError(f"--write-train-text {path}: no directory {path.parent}; create it first")
    documents = FAMILIES[task.family].train_texts(task)
    temporary = path.with_name(path.name + ".partial")
    with open(temporary, "w", encoding="utf-8") as fh:
        for document in documents:
            lines = [" ".join(text.split()) for text in document]
            fh.write("\n".join(line for line in lines if line) + "\n\n")
    temporary.replace(path)
    print(f"{path}: {len(documents):,} training texts of {task.name} (the dev split is not in it)")


def pick_device(requested: str):
    import torch
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(requested)
    if device.type == "cuda" and not torch.cuda.is_available():
        fail(f"--device {requested}: no CUDA device here; use --device cpu")
    return device


def pick_precision(requested: str, device, capability: tuple[int, int] | None = None) -> str:
    """--precision auto's choice: bf16 where the device computes in it, fp16 on GPUs that do not
    (torch.cuda.is_bf16_supported() says True there too: it counts emulation), else fp32."""
    if requested == "fp16" and device.type != "cuda":
        fail("--precision fp16 needs a GPU (on a CPU it is emulated, slower than fp32); use bf16 or fp32")
    if requested != "auto":
        return requested
    import torch
    if device.type == "cuda":
        major, _ = capability or torch.cuda.get_device_capability(device)
        return "bf16" if major >= 8 else "fp16"
    try:  # without AVX-512 BF16 a CPU emulates bf16, slower than fp32
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "fp32"
    return "bf16" if "avx512_bf16" in flags.split() or "amx_bf16" in flags.split() else "fp32"


def hyperparameters(args, device, family: str = DEFAULT):
    from commodity_bert.finetune.trainer import Hyperparameters
    return Hyperparameters(epochs=args.epochs, lr=None if args.lr == "auto" else args.lr, batch_size=args.batch_size,
                           max_seq_len=args.max_seq_len, warmup_fraction=args.warmup_fraction,
                           weight_decay=args.weight_decay, dropout=args.dropout,
                           precision=pick_precision(args.precision, device),
                           min_steps=FAMILIES[family].min_steps if args.min_steps is None else args.min_steps,
                           pooling=args.pooling, reinit_layers=args.reinit_layers, head_lr=args.head_lr,
                           head_init=args.head_init, stride=args.stride, layer_lr_decay=args.layer_lr_decay)


def print_report(result: dict) -> None:
    hp = result["hyperparameters"]
    folds = result["selection"].get("folds", 1)
    scored = (f"by {folds}-fold cross-validation on the training examples" if folds > 1 else
              f"on {result['selection']['held_out']} held-out training examples")
    early = hp["lr"] == "auto" and result["selection"].get("early_stopping")
    lengths = result["selection"].get("steps_grid") or []
    lr = ("auto: the best of " + ", ".join(f"{g:g}" for g in result["selection"]["grid"]) +
          (" at " + ", ".join(str(n) for n in lengths) + " steps" if early else "") +
          f" {scored}") if hp["lr"] == "auto" else f"{hp['lr']:g}"
    # with early stopping the full schedule's length; each arm's chosen length is in its row
    steps = max(lengths) if early else result["per_seed"][0]["steps"]
    reinit = f", top {hp['reinit_layers']} layers re-initialised" if hp.get("reinit_layers") else ""
    sampled = result.get("train_examples")
    family = FAMILIES[result.get("family", DEFAULT)]
    of = (f" of {sampled['of']}" + (", stratified" if family.stratified else "")) if sampled else ""
    head = family.head(hp)
    print(f"{result['task']} ({family.name}): {result['metric']} on {result['dev_size']} dev {family.units} "
          f"({result['train_size']}{of} train); {len(result['per_seed'])} seeds, {steps} steps ({hp['epochs']:g} "
          f"epochs, at least {hp['min_steps']}), lr {lr}, batch {hp['batch_size']}, max {hp['max_seq_len']} tokens, "
          f"{head}{reinit}, {hp['precision']} on {result['device']}; {result['seconds']:.0f} s")
    print(f"{'':<24}{'median':>8}{'min':>8}{'max':>8}{'lr':>8}{'steps':>7}   per seed")
    named = [("pretrained", result)] + ([("random init", result["random_init"])] if result["random_init"] else [])
    for name, row in named:
        per_seed = " ".join(f"{100 * r['value']:.1f}" for r in row["per_seed"])
        print(f"{name:<24}{100 * row['median']:>7.1f}%{100 * row['min']:>7.1f}%{100 * row['max']:>7.1f}%"
              f"{row['lr']:>8.0e}{row.get('steps', steps):>7}   {per_seed}")
        if "exact_match" in row:
            em = row["exact_match"]
            print(f"{'  exact match':<24}{100 * em['median']:>7.1f}%{100 * em['min']:>7.1f}%{100 * em['max']:>7.1f}%")
    for line in family.report_lines(result):
        print(line)
    print(f"model: {result['model']}")


def write_json(path: Path, obj) -> None:
    """Through a temporary name: a failed write leaves the earlier file as it was."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(obj, indent=1) + "\n")


def main(argv: list[str] | None = None) -> None:
    try:
        args = build_parser().parse_args(argv)
        check_arguments(args)
        task = load_task(args)  # before any model is read: a bad file is reported at once
        if args.check_only:
            return
        if args.write_train_text is not None:
            write_train_text(task, args.write_train_text)
            return
    except (UsageError, TaskError) as exc:
        fail(str(exc))
    import torch
    if args.threads:
        torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    from commodity_bert.finetune.trainer import default_cache_dir
    cache_dir = None if args.no_cache else (args.cache_dir or default_cache_dir())
    try:
        hp = hyperparameters(args, device, task.family)
        if args.watch is not None:
            from commodity_bert.finetune import watch
            watch.run(args.watch, task, hp, args.seeds, device, cache_dir, poll_seconds=args.poll_seconds,
                      once=args.once, stop_with_pid=args.stop_with_pid, progress=not args.quiet,
                      selection={"lr_grid": args.lr_grid, "lr_folds": args.lr_folds, "steps_grid": args.steps_grid,
                                 "early_stopping": args.early_stopping})
            return
        from commodity_bert.finetune import models
        pretrained = models.load(args.model)
        result = evaluate(pretrained, task, hp, args.seeds, device, cache_dir, args.random_init, not args.quiet,
                          args.lr_grid, args.lr_folds, args.steps_grid, args.early_stopping)
    except (TaskError, ModelError) as exc:
        fail(str(exc))
    print_report(result)
    if args.json:
        write_json(args.json, result)
    gc.freeze()  # the exit then skips freeing torch's and transformers' objects one by one (~1 s)


if __name__ == "__main__":
    main()
