"""Hugging Face MoE families in and out: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3.

    moetrain convert --from-hf HF_DIR --to OUT        (family from config.json model_type)
    moetrain convert RUN --to-hf OUT [--family F] [--fused] [--dtype bf16] [--max-shard-size 5GB]
    moetrain train --init-from-hf HF_DIR ...          (``moetrain.interop.hf.train_from``)

One module per family (configs both ways, what it cannot express, tensor names); one streaming
converter (``convert``) over the safetensors reader/writer of ``moetrain.utils.safetensors_io``.
"""

from moetrain.interop.hf.convert import ConversionReport, export_hf, import_hf
from moetrain.interop.hf.registry import FAMILIES, choose_family, family_of

__all__ = ["FAMILIES", "ConversionReport", "choose_family", "export_hf", "family_of", "import_hf"]
