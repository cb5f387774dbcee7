"""RUN/hf_model/README.md: the model card, written from the run's own records.

train.py writes it when a run ends (after the export and summary.json); run it again when
fine-tuning results arrive later (bert-finetune --watch, bert-ablate --downstream):

    python -m commodity_bert.model.card RUN

Everything in it is read from files, not remembered: RUN/run_config.json (arguments, DeepSpeed
config, model config, world size), RUN/summary.json (steps, samples, times, hosts, hardware,
final validation accuracy), RUN/metrics.jsonl, the data's manifest.json (sources and shards with
their sizes and sha256), RUN/downstream.jsonl, RUN/downstream.json and RUN/downstream/*.json
(recipes/evaluate.sh's, each family's result with its metric). The metadata header is
Hugging Face's (huggingface_hub's ModelCardData), so the Hub and `ModelCard.load` read it."""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from commodity_bert.host import atomic_write_text
from commodity_bert.model.sections import pretraining_recipe
from commodity_bert.run_config import RunConfig
from commodity_bert.run_dir import HF_MODEL, RUN_CONFIG, SUMMARY

CARD = "README.md"


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _read_rows(path: Path) -> list[dict]:
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut short
    return rows


# the Hugging Face task of results written before they said it themselves ("task_type")
EARLIER_TASK_TYPES = {"qa": "question-answering", "tagging": "token-classification"}


def task_type(result: dict) -> str:
    return result.get("task_type") or EARLIER_TASK_TYPES.get(result.get("family"), "text-classification")


def _final_row(result: dict, checkpoint: str) -> dict:
    row = {"task": result["task"], "family": result.get("family", "classification"), "task_type": task_type(result),
           "metric": result["metric"],
           "median": result["median"], "min": result["min"], "max": result["max"],
           "seeds": len(result.get("per_seed", [])), "checkpoint": checkpoint,
           "random_init": (result.get("random_init") or {}).get("median")}
    if isinstance(result.get("exact_match"), dict):  # QA's second metric
        row["exact_match"] = result["exact_match"]["median"]
    return row


def downstream_rows(run_dir: Path) -> list[dict]:
    """The fine-tuning results on record: the watcher's rows, bert-ablate's --downstream result
    and recipes/evaluate.sh's (RUN/downstream/*.json)."""
    rows = [{"task": r["task"], "family": r.get("family", "classification"), "task_type": task_type(r),
             "metric": r["metric"],
             "median": r["median"], "min": r["min"], "max": r["max"],
             "seeds": r.get("seeds"), "checkpoint": f"step {r['step']} ({r.get('source', '')})"}
            for r in _read_rows(run_dir / "downstream.jsonl") if "median" in r]
    finals = [_read_json(path) for path in sorted((run_dir / "downstream").glob("*.json"))] \
        if (run_dir / "downstream").is_dir() else []
    single = _read_json(run_dir / "downstream.json")  # bert-ablate's first task, also in downstream/ now
    if single and single.get("task") not in {r.get("task") for r in finals if r}:
        finals.insert(0, single)
    rows += [_final_row(result, "final") for result in finals if result and "median" in result and "task" in result]
    return rows


def duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min" if seconds < 7200 else \
        f"{seconds / 3600:.2f} h"


def reproduce_command(config: dict, summary: dict) -> str:
    """The launch that trains this run again: DeepSpeed's launcher over the same world."""
    args = dict(config["args"])
    hosts = list(dict.fromkeys(summary.get("hosts") or []))
    per_host = config["world_size"] // max(1, len(hosts))
    where = f"--num_gpus {per_host}" if len(hosts) <= 1 else f"--hostfile HOSTFILE  # {len(hosts)} hosts × {per_host}"
    flags = []
    for name in ("deepspeed_config", "data", "model", "output_dir", "max_steps", "time_budget", "seed", "init_from",
                 "log_every", "eval_every", "save_every"):
        value = args.get(name)
        if value not in (None, False, ""):
            flag = "--deepspeed_config" if name == "deepspeed_config" else "--" + name.replace("_", "-")
            flags.append(f"{flag} {shlex.quote(str(value))}")
    return f"deepspeed {where} train.py " + " ".join(flags)


def card_text(run_dir: Path) -> str:
    from huggingface_hub import EvalResult, ModelCardData
    config = _read_json(run_dir / RUN_CONFIG)
    summary = _read_json(run_dir / SUMMARY)
    if config is None or summary is None:
        raise FileNotFoundError(f"{run_dir}: run_config.json and summary.json are needed (written by train.py)")
    data_dir = Path(config["args"]["data"])
    manifest = _read_json(data_dir / "manifest.json") or {}
    model = config["model_config"]
    name = run_dir.resolve().name
    acc = summary.get("val_mlm_acc")
    downstream = downstream_rows(run_dir)
    results = []
    if acc is not None:
        results.append(EvalResult(task_type="fill-mask", dataset_type="held-out", dataset_name=f"{data_dir.name} validation split",
                                  metric_type="accuracy", metric_name="masked-LM accuracy", metric_value=round(acc, 4)))
    for row in downstream:
        metrics = [(row["metric"], row["median"])] + ([("exact_match", row["exact_match"])] if "exact_match" in row else [])
        for metric, value in metrics:
            results.append(EvalResult(task_type=row["task_type"], dataset_type=row["task"], dataset_name=row["task"],
                                      metric_type=metric, metric_name=f"{metric} (median of {row['seeds']} seeds)",
                                      metric_value=round(value, 4)))
    data = ModelCardData(language="en", library_name="transformers", pipeline_tag="fill-mask",
                         tags=["bert", "fill-mask", "deepspeed", "commodity-bert"], model_name=name,
                         eval_results=results or None)
    ds = RunConfig.parse(config["deepspeed_config"])
    recipe = pretraining_recipe(ds)  # the config's own rates, if it sets them
    shards_args = manifest.get("args") if isinstance(manifest.get("args"), dict) else {}
    mask_rate = recipe.get("mask_prob", shards_args.get("mask_prob", 0.15))
    dropout = recipe.get("dropout", model.get("hidden_dropout_prob"))
    hosts = summary.get("hosts") or []
    devices = summary.get("devices") or []
    lines = [
        f"# {name}",
        "",
        f"A BERT masked-language model ({model.get('num_hidden_layers')} layers, hidden {model.get('hidden_size')}, "
        f"{model.get('num_attention_heads')} heads, {model.get('vocab_size')} WordPieces) pretrained with "
        f"commodity-bert's `train.py` under DeepSpeed. Load it with "
        f"`AutoModelForMaskedLM.from_pretrained` (or any `AutoModelFor...` for fine-tuning).",
        "",
        "## Training",
        "",
        "| | |", "|---|---|",
        f"| steps | {summary['step']} ({summary.get('stopped_by')}) |",
        f"| samples | {summary['samples']:,} |",
        f"| wall time | {duration(summary.get('wall_s', 0))} ({duration(summary.get('trained_s', 0))} training) |",
        f"| ranks | {config['world_size']} on {len(set(hosts))} host(s): {', '.join(dict.fromkeys(hosts))} |",
        f"| hardware | {', '.join(dict.fromkeys(devices)) or 'not recorded'} |",
        f"| optimizer | {ds.optimizer_type or None} {json.dumps(ds.optimizer_params)} |",
        f"| communication | {config.get('comm_mode')} |",
        f"| precision | {ds.precision} |",
        f"| masking rate, dropout (pretraining) | {mask_rate}, {dropout} |",
        f"| batch | {summary['samples'] // max(1, summary['step'])} sequences of {manifest.get('seq_len', '?')} tokens |",
        f"| final validation MLM accuracy | {'n/a' if acc is None else f'{100 * acc:.2f}%'} |",
        "",
        "The DeepSpeed config and every argument: `run_config.json`, at the end of this card; the "
        "per-step metrics: the run's `metrics.jsonl`.",
        "",
        "## Data",
        "",
        f"`{data_dir}`: {manifest.get('format', '?')} shards of {manifest.get('seq_len', '?')} tokens, "
        f"{'with' if manifest.get('nsp') else 'without'} next-sentence pairs, {manifest.get('masking', '?')} masking; "
        f"vocabulary {manifest.get('vocab', {}).get('size', '?')} WordPieces "
        f"({'lowercased' if manifest.get('vocab', {}).get('lowercase') else 'cased'}), "
        f"sha256 `{manifest.get('vocab', {}).get('sha256', '?')}`.",
        "",
        "| source | bytes | sha256 |", "|---|---:|---|",
    ]
    sources = manifest.get("sources")
    if sources:
        for s in sources:
            size = "?" if s.get("bytes") is None else f"{s['bytes']:,}"
            digest = "not recorded (streamed from the Hub)" if s.get("sha256") is None else f"`{s['sha256']}`"
            lines.append(f"| `{s['path']}` | {size} | {digest} |")
    else:
        inputs = json.loads(manifest["args"]).get("inputs", []) if isinstance(manifest.get("args"), str) else \
            (manifest.get("args") or {}).get("inputs", [])
        lines += [f"| `{p}` | ? | not recorded (data made before sources were hashed) |" for p in inputs]
    lines += ["", "| split | shard | samples | tokens | sha256 |", "|---|---|---:|---:|---|"]
    for split, info in manifest.get("splits", {}).items():
        lines += [f"| {split} | {s['name']} | {s['samples']:,} | {s['tokens']:,} | `{s['sha256']}` |"
                  for s in info.get("shards", [])]
    if downstream:
        lines += ["", "## Fine-tuning", "", "| task | family | checkpoint | metric | median | min–max | seeds | random init |",
                  "|---|---|---|---|---:|---:|---:|---:|"]
        for r in downstream:
            rand = r.get("random_init")
            lines.append(f"| {r['task']} | {r['family']} | {r['checkpoint']} | {r['metric']} | {100 * r['median']:.1f}% | "
                         f"{100 * r['min']:.1f}–{100 * r['max']:.1f}% | {r['seeds']} | "
                         f"{'' if rand is None else f'{100 * rand:.1f}%'} |")
    lines += ["", "## Reproduce", "", "```bash", reproduce_command(config, summary), "```", "",
              "<details><summary>run_config.json</summary>", "", "```json",
              json.dumps(config, indent=1), "```", "", "</details>", ""]
    return f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines)


def write_card(run_dir: Path) -> Path:
    """RUN/hf_model/README.md, through a temporary name."""
    path = run_dir / HF_MODEL / CARD
    atomic_write_text(path, card_text(run_dir))
    return path


def refresh_card(run_dir: Path, log=print) -> None:
    """The card again with the fine-tuning rows just written, where the run has ended and has one."""
    if (run_dir / HF_MODEL / CARD).exists():
        try:
            log(f"model card updated: {write_card(run_dir)}")
        except (OSError, KeyError, ValueError, TypeError) as exc:
            log(f"model card not updated ({type(exc).__name__}: {exc})")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m commodity_bert.model.card",
                                     description="(Re)write RUN/hf_model/README.md from the run's records")
    parser.add_argument("run", type=Path, help="the RUN directory of train.py")
    args = parser.parse_args(argv)
    if not (args.run / HF_MODEL).is_dir():
        print(f"model card: {args.run}/hf_model not found: give a RUN directory whose training has ended",
              file=sys.stderr)
        sys.exit(2)
    try:
        print(write_card(args.run))
    except FileNotFoundError as exc:
        print(f"model card: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
