"""Pipeline parallelism on ``torch.distributed.pipelining``: the stages cut from a single-device
model, their schedule, and their gradients."""
