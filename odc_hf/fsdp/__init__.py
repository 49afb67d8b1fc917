"""FSDP2 adapter: ODC through FSDP2's public comm hooks; plain-FSDP2 helpers for the baseline."""

from odc_hf.fsdp.adapter import ODCHandle, install_odc
from odc_hf.fsdp.collectives import sum_reduction
from odc_hf.fsdp.sharding import is_sharded, shard_model
from odc_hf.fsdp.units import ODCUnit

__all__ = ["ODCHandle", "ODCUnit", "install_odc", "is_sharded", "shard_model", "sum_reduction"]
