"""Token-row all-to-alls of the expert-parallel dispatcher, split into a launch and a wait, so
that work that does not need the rows (the shared experts, another chunk's experts) runs while
they travel.

``launch_rows`` starts the exchange and returns at once; ``PendingRows.wait`` blocks until the
rows are here (on a GPU: makes the compute stream wait for the communication stream) and returns
them decoded to the compute dtype. Autograd sends the gradients back the same way. The wire
formats (``moe.dispatch_dtype``) and their numerics are those of
``moetrain.distributed.compressed_exchange``, op for op:

* ``"none"``: the rows as they are; backward in the same dtype.
* ``"bf16"``: rows cast to bf16 before and back after; the casts' backward puts the gradient in
  bf16 on the way back.
* ``"fp8_e4m3"``: rows quantised and packed with their scales (``pack_e4m3``) into one uint8 row,
  unpacked on arrival; the backward is straight-through, the gradient of the unpacked rows goes
  back in bf16.

The launch is a functional collective (``_c10d_functional.all_to_all_single``): the op returns a
tensor whose contents are valid only after ``_c10d_functional.wait_tensor``, which is what makes
the exchange asynchronous on every backend (gloo, NCCL) without touching streams here.

Shape legend: M rows sent, R rows received, D elements per row, X bytes per wire row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moetrain.distributed.compressed_exchange import pack_e4m3, unpack_e4m3

_functional = torch.ops._c10d_functional


def _launch(x_MX: torch.Tensor, output_splits: list[int], input_splits: list[int],
            group: dist.ProcessGroup) -> torch.Tensor:
    """Start a variable-size all-to-all; the result must go through ``_wait`` before it is read.
    Differentiable: its backward is the reverse exchange (registered by torch)."""
    return _functional.all_to_all_single(x_MX.contiguous(), output_splits, input_splits, group.group_name)


def _wait(x_RX: torch.Tensor) -> torch.Tensor:
    """Block until a launched exchange has landed in ``x_RX`` (differentiable: identity backward)."""
    return _functional.wait_tensor(x_RX)


class _Fp8Arrival(torch.autograd.Function):
    """The unpacked fp8 rows as a function of the rows that were sent (straight-through): forward
    waits for the packed exchange and unpacks it; backward sends the gradient home in bf16."""

    @staticmethod
    def forward(ctx, x_MD, packed_RX, output_splits, input_splits, group):
        ctx.splits, ctx.group, ctx.dtype = (output_splits, input_splits), group, x_MD.dtype
        return unpack_e4m3(_wait(packed_RX), x_MD.shape[1], x_MD.dtype)

    @staticmethod
    def backward(ctx, grad_RD):
        output_splits, input_splits = ctx.splits
        grad_MD = _wait(_launch(grad_RD.to(torch.bfloat16), input_splits, output_splits, ctx.group))
        return grad_MD.to(ctx.dtype), None, None, None, None


@dataclass
class PendingRows:
    """Rows on their way (see ``launch_rows``)."""

    x_MD: torch.Tensor
    """The rows sent (the straight-through input of the fp8 arrival)."""
    in_flight_RX: torch.Tensor
    """The launched exchange in wire format; not to be read before ``wait``."""
    wire: str
    output_splits: list[int]
    input_splits: list[int]
    group: dist.ProcessGroup

    def wait(self) -> torch.Tensor:
        """The received rows ``[R, D]`` in the dtype of the rows sent."""
        if self.wire == "fp8_e4m3":
            return _Fp8Arrival.apply(self.x_MD, self.in_flight_RX, self.output_splits, self.input_splits, self.group)
        return _wait(self.in_flight_RX).to(self.x_MD.dtype)


def launch_rows(x_MD: torch.Tensor, *, wire: str, output_splits: list[int], input_splits: list[int],
                group: dist.ProcessGroup) -> PendingRows:
    """Start sending rows ``input_splits[p]`` of ``x_MD`` to rank p in ``wire`` format ("none",
    "bf16" or "fp8_e4m3"); returns at once."""
    if wire == "fp8_e4m3":
        # The packed bytes carry no autograd; _Fp8Arrival connects the arrival to x_MD.
        with torch.no_grad():
            in_flight = _launch(pack_e4m3(x_MD), output_splits, input_splits, group)
    else:
        in_flight = _launch(x_MD.to(torch.bfloat16) if wire == "bf16" else x_MD, output_splits, input_splits,
                            group)
    return PendingRows(x_MD, in_flight, wire, output_splits, input_splits, group)
