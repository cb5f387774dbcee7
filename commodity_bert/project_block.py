"""The DeepSpeed config's "commodity_bert" block: the project's own switches beside DeepSpeed's
keys, so that an ablation stays one JSON file (docs/training.md, ds_configs/README.md). Its
readers take their section here; DeepSpeed gets the config without it (`without_block`); the
launch refuses a key it does not know (train/launch_checks.py)."""
from __future__ import annotations

PROJECT_BLOCK = "commodity_bert"


def section(config: dict, name: str) -> dict:
    """The block's `name` section ({} where the config has none)."""
    return config.get(PROJECT_BLOCK, {}).get(name, {})


def without_block(config: dict) -> dict:
    """The config as DeepSpeed should see it: DeepSpeed rejects keys it does not know."""
    return {k: v for k, v in config.items() if k != PROJECT_BLOCK}
