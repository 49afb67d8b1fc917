"""``odc_*`` keys in an FSDP config: accelerate and transformers ignore them silently; odc_hf refuses them.

ODC's options never live in an FSDP config ([configuration.md]: ``ODCConfig``, ``odc_*`` training arguments or
``ODC_*`` variables). A user who writes ``odc_max_tokens_per_microbatch: 4096`` under ``fsdp_config`` would otherwise
train with the default budget without a word:

- ``TrainingArguments(fsdp_config={...})``: transformers keeps unknown keys (and strips a ``fsdp_`` prefix) and
  accelerate's plugin never reads them; :func:`check_fsdp_config` sees the dict.
- the accelerate YAML's ``fsdp_config``: ``accelerate launch`` copies only the keys it knows into the ranks'
  environment, so a rank never sees the others. :func:`launch_config_file` finds the YAML the launcher read, from the
  launcher's command line (the rank's parent process, on Linux) or accelerate's default config; where neither can
  be read (another launcher, another OS) the check is skipped.
"""

from __future__ import annotations

import os
from pathlib import Path


def _field_names() -> list[str]:
    import dataclasses

    from odc_hf.config import ODCConfig

    return [f.name for f in dataclasses.fields(ODCConfig)]


def _closest_option(key: str) -> str | None:
    """The ODC option ``key`` (``odc_balanse``) names or most resembles (``balance``); ``None`` when none is close."""
    import difflib

    name = key.removeprefix("odc_")
    names = _field_names()
    if name in names:
        return name
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    return close[0] if close else None


def check_fsdp_config(fsdp_config, where: str) -> None:
    """Raise on an ``odc_*`` key (also ``fsdp_odc_*``) of an FSDP config dict, naming it and where ODC options go: the
    option it names, or (a misspelt one) the closest valid option, written each way it can be set."""
    if not isinstance(fsdp_config, dict):
        return
    keys = sorted(k for k in fsdp_config if str(k).removeprefix("fsdp_").startswith("odc_"))
    if not keys:
        return
    key = keys[0].removeprefix("fsdp_")
    option = _closest_option(key)
    if option is None:
        flag, variable, unknown = "--odc_<option>", "ODC_<OPTION>", f" ({key!r} is not an ODC option)"
    else:
        flag, variable, unknown = f"e.g. --odc_{option}", f"ODC_{option.upper()}", ""
        if option != key.removeprefix("odc_"):
            unknown = f" ({key!r} is not an ODC option; the closest is 'odc_{option}')"
    valid = ", ".join(f"odc_{n}" for n in _field_names())
    raise ValueError(
        f"{where} has {', '.join(repr(k) for k in keys)}, which accelerate ignores: ODC's options do not go in an "
        f"FSDP config{unknown}. Set them as training arguments ({valid}: {flag} with ODCSFTConfig / "
        f"ODCTrainingArguments), as environment variables ({variable}=...), or in ODCConfig(...) "
        "(docs/configuration.md)"
    )


def launch_config_file(environ=None) -> Path | None:
    """The accelerate config file ``accelerate launch`` read for this rank, if it can be known; else ``None``."""
    environ = os.environ if environ is None else environ
    if "LOCAL_RANK" not in environ:
        return None
    try:
        argv = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None
    if not any(a.endswith("accelerate") or a.startswith("accelerate.commands") or a == "launch" for a in argv):
        return None  # torchrun, srun, ...: no accelerate config
    for i, arg in enumerate(argv):
        if arg in ("--config_file", "--config-file") and i + 1 < len(argv):
            return Path(argv[i + 1])
        if arg.startswith(("--config_file=", "--config-file=")):
            return Path(arg.split("=", 1)[1])
    from accelerate.commands.config.config_args import default_config_file

    return Path(default_config_file) if os.path.isfile(default_config_file) else None


def check_launch_config(environ=None) -> None:
    """:func:`check_fsdp_config` on the ``fsdp_config`` of the accelerate YAML this rank was launched with."""
    path = launch_config_file(environ)
    if path is None or not path.is_file() or path.suffix not in (".yaml", ".yml"):
        return
    import yaml

    try:
        config = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return  # accelerate itself read it; not ours to report
    if isinstance(config, dict):
        check_fsdp_config(config.get("fsdp_config"), f"fsdp_config in the accelerate config {str(path)!r}")
