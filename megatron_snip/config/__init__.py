"""Configuration: a tree of frozen dataclasses, loaded from TOML with dotted overrides.

    cfg = load_config("launch/configs/tiny.toml", ["training.max_steps=60", "snip.fp4_target=0.8"])
    cfg.validate(world_size=1)

Owns: ``sections.py`` (the dataclasses, per-field and cross-field checks), ``snip_section.py``
(the ``[snip]`` section and its choices), ``values.py`` (the value rules and errors every section
shares, TOML values in and out), ``toml_io.py`` (``load_config``, ``config_from_dict``). May
import: the standard library, and ``precision`` (format and mode names, lazily, inside checks);
nothing else of megatron_snip.
"""

from megatron_snip.config.sections import (
    RECOMPUTE_MODES,
    Config,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    ParallelConfig,
    PrecisionConfig,
    TrainingConfig,
)
from megatron_snip.config.snip_section import (
    CURVATURE_NOISE,
    LOSS_FIRST_ORDER,
    PRECONDITIONERS,
    SNIP_BUDGETS,
    SNIP_TARGETS,
    WEIGHT_DIVERGENCE,
    SnipConfig,
)
from megatron_snip.config.toml_io import config_from_dict, load_config
from megatron_snip.config.values import (
    check_finite,
    check_positive,
    check_seed,
    coerce,
    field_error,
    parse_override,
    parse_time_costs,
    toml_value,
)

__all__ = [
    "CURVATURE_NOISE",
    "LOSS_FIRST_ORDER",
    "PRECONDITIONERS",
    "RECOMPUTE_MODES",
    "SNIP_BUDGETS",
    "SNIP_TARGETS",
    "WEIGHT_DIVERGENCE",
    "Config",
    "DataConfig",
    "LoggingConfig",
    "ModelConfig",
    "ParallelConfig",
    "PrecisionConfig",
    "SnipConfig",
    "TrainingConfig",
    "check_finite",
    "check_positive",
    "check_seed",
    "coerce",
    "config_from_dict",
    "field_error",
    "load_config",
    "parse_override",
    "parse_time_costs",
    "toml_value",
]
