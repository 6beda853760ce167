"""Expert parallelism: each rank of an ep group holds E/ep experts and token copies travel to
them by all-to-all.

    apply.py            swap every MoE layer's dispatcher and shard its experts (the entry point)
    dispatcher.py       the all-to-all dispatcher, in named phases; only route, token_dispatch and
                        token_combine communicate
    route.py            the routing step shared by the flat and hierarchical dispatchers (counts,
                        drops, splits; one host sync) and the Route / Exchange records it leaves
    index.py            index math of routing counts and chunks (no communication)
    exchange.py         the counted, timed exchanges: token rows (launch and wait), metadata
    wire.py             compressed wire formats (bf16, fp8 e4m3 with block scales)
    hierarchical.py     node-aware two-stage exchange for ep groups across nodes
    tensor_parallel.py  expert tensor parallelism (etp): experts' hidden dim over etp ranks
"""
