"""The model's sections of the config's "commodity_bert" block: the attention layout,
activation checkpointing, and the pretraining recipe's rates (masking, dropout). Apart from
bert.py so that the launch checks read them without importing transformers."""
from __future__ import annotations

from commodity_bert.run_config import RunConfig, register_section

ATTENTION_LAYOUTS = ("padded", "jagged")


def _check_attention(settings: dict, config: RunConfig) -> str | None:
    if settings["layout"] not in ATTENTION_LAYOUTS:
        return (f'"commodity_bert.attention.layout" {settings["layout"]!r}: give one of '
                f'{", ".join(map(repr, ATTENTION_LAYOUTS))} (default "padded")')
    return None


def _check_activation_checkpointing(settings: dict, config: RunConfig) -> str | None:
    if not isinstance(settings["enabled"], bool):
        return f'"commodity_bert.activation_checkpointing.enabled" must be true or false, not {settings["enabled"]!r}'
    return None


def _check_pretraining(settings: dict, config: RunConfig) -> str | None:
    for key, value in settings.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < 1 \
                or (key == "mask_prob" and value == 0):
            allowed = "(0, 1), e.g. 0.15 (BERT) or 0.4" if key == "mask_prob" else "[0, 1), e.g. 0.0 or 0.1 (BERT)"
            return f'"commodity_bert.pretraining.{key}" {value!r}: give a number in {allowed}'
    return None


register_section("attention", {"layout": "padded"}, _check_attention)
register_section("activation_checkpointing", {"enabled": False}, _check_activation_checkpointing)
# the recipe's rates where the config sets them (None: the shards' masking rate, the model's dropout)
register_section("pretraining", {"mask_prob": None, "dropout": None}, _check_pretraining)


def attention_layout(config: RunConfig | dict) -> str:
    """The config's `"commodity_bert": {"attention": {"layout": ...}}`, "padded" by default."""
    return RunConfig.of(config).section("attention")["layout"]


def activation_checkpointing(config: RunConfig | dict) -> bool:
    """Whether each layer is recomputed in backward (less memory, about a third more compute)."""
    return RunConfig.of(config).section("activation_checkpointing")["enabled"]


def pretraining_recipe(config: RunConfig | dict) -> dict:
    """The rates the config sets itself: {"mask_prob": ..., "dropout": ...}, each only where given
    (otherwise the shards' masking rate and the model's dropout hold)."""
    return RunConfig.of(config).section("pretraining")
