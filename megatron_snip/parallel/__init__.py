"""Parallelism: topology (groups, the stage split), comm (every collective), pipeline schedules, DDP,
the distributed optimizer, sequence sharding, process-group init and watchdog.

The only room that calls torch.distributed. May import: atomic_io; nothing else of megatron_snip.
"""
