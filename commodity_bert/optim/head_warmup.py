"""A head warm-up for continued pretraining: for a run's first steps the encoder's rate is scaled
(to 0 by default, a frozen encoder) and the heads' may be raised, while a fresh pretraining head
learns to read the encoder.

A published encoder without its masked-LM head (a `BertModel`, a sentence-transformers export)
gets a random head; trained together from the first step, that head's large early gradients
reshape the encoder before it can use them (Kumar et al. 2022, "Fine-Tuning can Distort Pretrained
Features": linear probing, then fine-tuning). The config says

    "commodity_bert": {"head_warmup": {"steps": 50, "encoder_lr_scale": 0.0, "head_lr_scale": 10.0}}

Written here because neither DeepSpeed nor transformers has it: DeepSpeed's schedulers give every
parameter group one rate. The heads' parameters get groups of their own (optim/build.py); this
wraps the config's scheduler so that, after each of its steps, the groups' rates are scaled
while the warm-up lasts. The optimizer still sees every gradient (Adam's moments warm up with the
encoder's), and at a rate of 0 neither the update nor decoupled weight decay moves the encoder.
"""
from __future__ import annotations

from commodity_bert.run_config import RunConfig, register_section

HEAD_GROUP = "pretraining_head"  # the parameter-group option marking the heads' groups
DEFAULTS = {"steps": 0, "encoder_lr_scale": 0.0, "head_lr_scale": 1.0}


def check_settings(settings: dict, config: RunConfig) -> str | None:
    """What is wrong with the section, as one line, or None."""
    steps = settings["steps"]
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
        return f'"commodity_bert.head_warmup.steps" must be a whole number of steps >= 0, not {steps!r}'
    for key, low, high in (("encoder_lr_scale", 0, 1), ("head_lr_scale", 0, 1000)):
        value = settings[key]
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not low <= value < high:
            return f'"commodity_bert.head_warmup.{key}" must be in [{low}, {high}), not {value!r}'
    if steps and not config.has_scheduler:
        return ('"commodity_bert.head_warmup" needs a "scheduler" block in the config (its rate is scaled after '
                'each of the scheduler\'s steps); add one, e.g. WarmupDecayLR')
    return None


SECTION = register_section("head_warmup", DEFAULTS, check_settings,
                           lambda settings, steps: {**settings, "steps": min(settings.get("steps", 0), max(1, steps // 4))})


def head_warmup_settings(config: RunConfig | dict) -> dict:
    """The config's "commodity_bert.head_warmup" section with its defaults; steps 0: none."""
    return RunConfig.of(config).section("head_warmup")


class HeadWarmupScheduler:
    """The config's scheduler, with the encoder's and the heads' groups' rates scaled until
    optimizer step `steps` has run. get_last_lr gives the rates the groups train at (the logged
    `lr` is the encoder's: 0 while it is held); everything else (state_dict, ...) is the wrapped
    scheduler's, so checkpoints hold the same state with and without the warm-up, and a run
    resumed within the warm-up gets the scaled rates back with the optimizer's state."""

    def __init__(self, scheduler, steps: int, encoder_lr_scale: float, head_lr_scale: float = 1.0):
        self.scheduler = scheduler
        self.steps, self.encoder_lr_scale, self.head_lr_scale = steps, encoder_lr_scale, head_lr_scale
        self._scale()  # the rate the scheduler set for the first step

    @property
    def groups(self) -> list[dict]:
        """The optimizer's groups as they are now: loading a checkpoint replaces the group dicts
        (torch's Optimizer.load_state_dict), so a list kept from the start would scale, and report,
        groups the optimizer no longer uses."""
        return self.scheduler.optimizer.param_groups

    def _next_step(self) -> int:
        """The optimizer step the groups' rates are now set for (1 for the first)."""
        done = getattr(self.scheduler, "last_batch_iteration", None)  # DeepSpeed's: -1 before any step
        if done is None:
            done = self.scheduler.last_epoch - 1  # torch's: 0 before any step
        return done + 2

    def _scale(self) -> None:
        if self._next_step() <= self.steps:
            for group in self.groups:
                group["lr"] *= self.head_lr_scale if group.get(HEAD_GROUP) else self.encoder_lr_scale

    def step(self, *args, **kwargs):
        result = self.scheduler.step(*args, **kwargs)
        self._scale()
        return result

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.groups]

    def __getattr__(self, name):
        return getattr(self.scheduler, name)


def install(engine, config: RunConfig):
    """Wrap the engine's scheduler where the config asks for a head warm-up; the scheduler to
    use (the engine's, wrapped or not)."""
    settings = head_warmup_settings(config)
    if not settings["steps"] or engine.lr_scheduler is None:
        return engine.lr_scheduler
    engine.lr_scheduler = HeadWarmupScheduler(engine.lr_scheduler, settings["steps"], settings["encoder_lr_scale"],
                                              settings["head_lr_scale"])
    return engine.lr_scheduler
