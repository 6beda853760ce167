"""Sharded, atomic, resumable checkpoints on ``torch.distributed.checkpoint`` (DCP), loadable at
any parallel layout and never unpickled.

    checkpointer.py     the component the trainer holds: where checkpoints go, what a run resumes
                        from, the training objects into and out of a checkpoint
    state.py            save_checkpoint / load_checkpoint: model, optimizer and trainer state through DCP
    background.py       checkpoint.async_save: one save at a time written and published by a thread
    files.py            names, the manifest, ``latest``, retention, verification, the one path rule
    index.py            DCP's index as JSON and the reader that uses it; one-process weight reads

Layout of ``checkpoint.dir``::

    step_000000100/          one complete checkpoint (renamed into place only once every file is written)
        index.json           DCP index as JSON: global shapes and which file holds which shard
        .metadata            the same index as DCP pickles it, for DCP's own tools; never read here
        __0_0.distcp ...     DCP data, one file per writing rank
        manifest.json        step, layout, size and sha256 of every file above; written last
    step_000000200/
    latest                   "step_000000200": the newest complete checkpoint
    .step_000000300.tmp/     a save in progress, or one killed mid-way: never read, removed at the next start
"""
