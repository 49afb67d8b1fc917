"""ODC options as trainer arguments: ``ODCTrainingArguments`` / ``ODCSFTConfig`` add ``odc_*`` fields.

They are the same knobs as :class:`odc_hf.ODCConfig` (one definition: the fields below are derived from it),
exposed where argument parsers look (``HfArgumentParser``/``TrlParser`` give ``--odc_balance`` etc.). A field
left at ``None`` falls back to the ``ODC_*`` environment variable, then to ODCConfig's default; an explicit
``odc_config=`` passed to the trainer wins over all of them.
"""

from __future__ import annotations

import dataclasses

from odc_hf.config import ODCConfig

PREFIX = "odc_"


def _odc_fields() -> list[tuple[str, type, dataclasses.Field]]:
    doc = ODCConfig.__doc__ or ""
    fields = []
    for f in dataclasses.fields(ODCConfig):
        marker = f"{f.name}:"
        help_text = doc.split(marker, 1)[1].split("\n        ", 1)[0].strip() if marker in doc else f.name
        fields.append((PREFIX + f.name, f"{f.type} | None",
                       dataclasses.field(default=None, metadata={"help": f"ODC: {help_text} (default {f.default!r})"})))  # fmt: skip
    return fields


def make_odc_arguments(args_cls: type) -> type:
    """``TrainingArguments`` (or ``SFTConfig``, ...) plus ``odc_<field>`` for every ODCConfig field."""
    cls = dataclasses.make_dataclass(f"ODC{args_cls.__name__}", _odc_fields(), bases=(args_cls,))
    cls.__module__ = __name__
    return cls


def odc_config_from_args(args, environ=None) -> ODCConfig:
    """ODCConfig from ``odc_*`` argument fields (None: not set), the environment and the defaults."""
    overrides = {f.name: getattr(args, PREFIX + f.name, None) for f in dataclasses.fields(ODCConfig)}
    return ODCConfig.from_env(environ, **overrides)


def __getattr__(name):
    if name == "ODCTrainingArguments":
        from transformers import TrainingArguments

        cls = make_odc_arguments(TrainingArguments)
    elif name == "ODCSFTConfig":
        from trl import SFTConfig

        cls = make_odc_arguments(SFTConfig)
    else:
        raise AttributeError(name)
    globals()[name] = cls
    return cls
