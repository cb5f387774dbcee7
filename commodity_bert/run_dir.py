"""The names inside a training run's directory (RUN): train.py writes them; bert-finetune,
bert-ablate, the model card and bert-data-prep read them (the output layout: DESIGN.md, "Training")."""
import json
from pathlib import Path

RUN_CONFIG = "run_config.json"  # the arguments and the DeepSpeed config, as given and as run
SUMMARY = "summary.json"        # written last: the run ended (done, stopped or out of time)
METRICS = "metrics.jsonl"       # one line per logged step and per evaluation
HF_MODEL = "hf_model"           # the export, for from_pretrained
CHECKPOINTS = "checkpoints"     # step_N/, one per save


def read_run_config(run_dir: Path) -> dict | None:
    """RUN/run_config.json as train.py wrote it, or None where it is missing or unreadable."""
    try:
        config = json.loads((Path(run_dir) / RUN_CONFIG).read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None
