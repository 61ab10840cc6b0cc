"""Learning-rate schedules: the one home is ``config/schedule.py`` (SNIP's run budget and the dry
run read the schedule too, below ``training/``); re-exported here for the trainer."""

from megatron_snip.config.schedule import lr_at, wsd_decay_start

__all__ = ["lr_at", "wsd_decay_start"]
