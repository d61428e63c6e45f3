"""The adapter file format: ``adapter_config.json`` (schema) + ``adapter_model.safetensors``,
atomic directory writes, and the :class:`TargetPin`. Knows nothing about model assembly
(:mod:`heads.loading`) or drafter kinds."""

from .fields import check_fields
from .files import (
    CONFIG_NAME, WEIGHTS_NAME, adapter_config, check_inside, check_tensor_dtypes, json_writer, read_config,
    read_header, read_json, read_safetensors, read_weights, save_adapter, write_directory,
)
from .pin import TargetPin
from .schema import (
    FORMAT_VERSION, AdapterError, TargetMismatchError, acceptance_entries, recorded_acceptance, target_differences,
)

__all__ = [
    "FORMAT_VERSION", "CONFIG_NAME", "WEIGHTS_NAME", "AdapterError", "TargetMismatchError", "TargetPin",
    "adapter_config", "save_adapter", "read_config", "read_header", "read_json", "read_weights", "read_safetensors",
    "target_differences", "acceptance_entries", "recorded_acceptance", "write_directory", "json_writer", "check_fields", "check_inside",
    "check_tensor_dtypes",
]
