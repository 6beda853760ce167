import torch

# Tests are timed on a 2-core machine; more threads than cores only adds contention.
torch.set_num_threads(min(2, torch.get_num_threads()))
