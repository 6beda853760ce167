"""Data parallelism, expert-aware, at every ZeRO stage.

    finalize.py         the gradient rule (scale by 1/dp, sum over the copies) and finalize_grads,
                        every reduction after backward
    ddp.py              stage 0/1 reduction (DDP, expert shards over edp), picks the wrapper
    tp_reduction.py     the same reduction when tensor parallelism is on
    zero1.py            ZeRO-1: optimizer states sharded over the data-parallel ranks
    fsdp.py             ZeRO-2/3 with FSDP2
    compression.py      bf16 and 1-bit compressed all-reduces
    compression_state.py  1-bit Adam's side of the DDP wrapper (residuals, momenta)
    onebit_adam.py      1-bit Adam
    grads.py            the global gradient norm and clipping
"""
