"""Getting models out of and into moetrain: consolidated safetensors exports of a run, and Hugging
Face conversion (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3; ``moetrain.interop.hf``).

    moetrain export RUN_DIR --to DIR           # model.safetensors + config.yaml, full tensors
    moetrain convert SRC --to-hf DIR           # config.json + safetensors for transformers
    moetrain convert --from-hf DIR --to DIR    # a Hugging Face model as a moetrain export
"""

from moetrain.interop.export import (
           build_model,
           export_model,
           load_source,
           open_source,
           read_export,
           write_export,
)
from moetrain.interop.hf import export_hf, import_hf

__all__ = ["build_model", "export_hf", "export_model", "import_hf", "load_source", "open_source", "read_export",
           "write_export"]
