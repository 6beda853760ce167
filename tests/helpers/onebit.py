"""1-bit Adam's data-parallel side for one replica, for unit tests of its arithmetic: the momentum
average over one replica is the tensor itself. The collectives are tested across real processes in
tests/distributed/test_onebit_adam.py."""


class OneReplica:
    local_gradients = False

    def has_replicas(self, p) -> bool:
        return True

    def set_local_gradients(self, on: bool) -> None:
        self.local_gradients = on

    def onebit_average_(self, params, tensors) -> None:
        """The mean over one replica is each tensor itself: nothing to exchange or change."""
