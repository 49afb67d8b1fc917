"""FSDP2 adapter: ODC through FSDP2's public comm hooks."""

from odc_hf.fsdp.adapter import ODCHandle, install_odc
from odc_hf.fsdp.sharding import shard_model
from odc_hf.fsdp.units import ODCUnit

__all__ = ["ODCHandle", "ODCUnit", "install_odc", "shard_model"]
