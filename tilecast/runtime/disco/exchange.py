"""Differentiable all-to-all-v exchanges between the shards of one direction (latitude or
longitude) of a distributed convolution.

An exchange is described by a plan: for every peer, the region of the local tensor sent to it,
and the region of the output the piece it sends back is added to. Gathering a halo, moving from
a longitude split to a channel split and reduce-scattering partial sums are all exchanges, and
the adjoint of an exchange is the same exchange with the two region lists swapped (what was
sent is where gradients are added, what was placed is what is sent back), so one
autograd.Function covers every collective of distributed.py with its exact gradient: a gather
is differentiated by a scatter-add and a reduce-scatter by a gather.

Pieces travel point to point (isend / irecv, which gloo and NCCL both implement for every
dtype); a rank's piece for itself is added without communication. `Communicator`s give the
rank's place in its group: `GroupComm` over a torch.distributed process group, `ShardPosition`
a fixed (rank, size) that cannot communicate (a group of 1, or a benchmark placing one shard).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Sequence, Union

import torch
import torch.distributed as dist
from torch import Tensor

#: a region of a tensor: one slice per leading dimension, the remaining dimensions whole
Region = tuple[slice, ...]
#: [start, stop) of the rows (or longitudes, channels) a rank holds along one dimension
Span = tuple[int, int]


class Communicator(Protocol):
    """A rank's place in one direction of the process grid and the exchange between its peers."""
    rank: int
    size: int

    def exchange(self, outgoing: Sequence[Optional[Tensor]],
                 incoming_shapes: Sequence[Optional[tuple[int, ...]]],
                 like: Tensor) -> list[Optional[Tensor]]: ...

    def all_reduce(self, tensor: Tensor) -> None: ...


@dataclass(frozen=True)
class ShardPosition:
    """Rank `rank` of `size` without a process group: a group of 1 (no split), or one shard
    of a split placed by hand (benchmarks), which can build its local problem but not talk."""
    rank: int = 0
    size: int = 1

    def __post_init__(self):
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is outside a group of {self.size}")

    def exchange(self, outgoing, incoming_shapes, like):
        if self.size != 1:
            raise RuntimeError(f"ShardPosition(rank={self.rank}, size={self.size}) has no process "
                               "group to exchange with; pass a torch.distributed group instead")
        return [outgoing[0]]

    def all_reduce(self, tensor: Tensor) -> None:
        if self.size != 1:
            raise RuntimeError(f"ShardPosition(rank={self.rank}, size={self.size}) cannot all-reduce")


class GroupComm:
    """A torch.distributed process group as a Communicator (any backend with isend/irecv)."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        if self.rank < 0:
            raise ValueError("this process is not a member of the process group it was given")

    def exchange(self, outgoing, incoming_shapes, like):
        received: list[Optional[Tensor]] = [None] * self.size
        operations = []
        for peer in range(self.size):
            if peer == self.rank:
                received[peer] = outgoing[peer]
                continue
            piece = outgoing[peer]
            if piece is not None and piece.numel():
                operations.append(dist.P2POp(dist.isend, piece.contiguous(), group=self.group,
                                             group_peer=peer))
            shape = incoming_shapes[peer]
            if shape is not None and _numel(shape):
                received[peer] = torch.empty(shape, dtype=like.dtype, device=like.device)
                operations.append(dist.P2POp(dist.irecv, received[peer], group=self.group,
                                             group_peer=peer))
        # one batch: NCCL needs the sends and receives of a step grouped, or ranks that both
        # send first would wait on each other
        if operations:
            for work in dist.batch_isend_irecv(operations):
                work.wait()
        return received

    def all_reduce(self, tensor: Tensor) -> None:
        if self.size > 1:
            dist.all_reduce(tensor, group=self.group)


def as_communicator(group: Union[None, dist.ProcessGroup, ShardPosition, GroupComm],
                    what: str) -> Union[ShardPosition, GroupComm]:
    """None -> a group of 1; a ProcessGroup -> GroupComm; a Communicator stays itself."""
    if group is None:
        return ShardPosition()
    if isinstance(group, (ShardPosition, GroupComm)):
        return group
    if isinstance(group, dist.ProcessGroup):
        return GroupComm(group)
    raise TypeError(f"{what} must be a torch.distributed ProcessGroup, a ShardPosition or None, "
                    f"got {type(group).__name__}")


def _numel(shape: Sequence[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def region_shape(shape: Sequence[int], region: Region) -> tuple[int, ...]:
    """The shape of tensor[region] for a tensor of `shape`."""
    return tuple(len(range(*region[dim].indices(size))) if dim < len(region) else size
                 for dim, size in enumerate(shape))


@dataclass(frozen=True)
class ExchangePlan:
    """sends[peer]: region of the input sent to peer; places[peer]: region of the output the
    piece from peer is added to (None: nothing); resize: (dim, size) pairs where the output's
    shape differs from the input's."""
    sends: tuple[Optional[Region], ...]
    places: tuple[Optional[Region], ...]
    resize: tuple[tuple[int, int], ...]

    def output_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        out = list(shape)
        for dim, size in self.resize:
            out[dim] = size
        return tuple(out)

    def adjoint(self, input_shape: Sequence[int]) -> "ExchangePlan":
        """The plan of the gradient: regions swapped, back to the input's shape."""
        return ExchangePlan(self.places, self.sends,
                            tuple((dim, input_shape[dim]) for dim, _ in self.resize))


def _run(x: Tensor, comm, plan: ExchangePlan) -> Tensor:
    out_shape = plan.output_shape(x.shape)
    outgoing = [None if region is None else x[region] for region in plan.sends]
    shapes = [None if region is None else region_shape(out_shape, region) for region in plan.places]
    out = x.new_zeros(out_shape)
    for region, piece in zip(plan.places, comm.exchange(outgoing, shapes, x)):
        if region is not None and piece is not None:
            out[region] += piece
    return out


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, comm, plan: ExchangePlan) -> Tensor:
        ctx.comm, ctx.plan, ctx.input_shape = comm, plan, tuple(x.shape)
        return _run(x, comm, plan)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _Exchange.apply(grad, ctx.comm, ctx.plan.adjoint(ctx.input_shape)), None, None


def _is_identity(plan: ExchangePlan, shape: tuple[int, ...]) -> bool:
    """A one-rank plan that sends the whole input to the whole output (no split)."""
    send, place = plan.sends[0], plan.places[0]
    return (send is not None and place is not None and plan.output_shape(shape) == shape
            and region_shape(shape, send) == shape == region_shape(shape, place))


def exchange(x: Tensor, comm, plan: ExchangePlan) -> Tensor:
    """Run `plan` over `comm` on x, differentiably (the gradient runs the adjoint plan). Every
    rank of the group must call it with its own plan of the same exchange."""
    if len(plan.sends) != comm.size or len(plan.places) != comm.size:
        raise ValueError(f"plan for {len(plan.sends)} ranks used in a group of {comm.size}")
    if comm.size == 1 and _is_identity(plan, tuple(x.shape)):
        return x
    return _Exchange.apply(x, comm, plan)


# plans of the collectives of distributed.py, from the spans (start, stop) each rank holds

def _intersect(a: Span, b: Span) -> Optional[Span]:
    start, stop = max(a[0], b[0]), min(a[1], b[1])
    return (start, stop) if start < stop else None


def _region(dim: int, span: Optional[Span], origin: int = 0) -> Optional[Region]:
    """span (minus origin) of dimension dim, the dimensions before it whole."""
    if span is None:
        return None
    return (slice(None),) * dim + (slice(span[0] - origin, span[1] - origin),)


def band_gather_plan(shards: list[Span], bands: list[Span], rank: int, dim: int) -> ExchangePlan:
    """Each rank's band of rows along dim, gathered from the shards that hold them."""
    mine, band = shards[rank], bands[rank]
    sends = tuple(_region(dim, _intersect(mine, other), mine[0]) for other in bands)
    places = tuple(_region(dim, _intersect(other, band), band[0]) for other in shards)
    return ExchangePlan(sends, places, ((dim, band[1] - band[0]),))


def band_scatter_plan(shards: list[Span], bands: list[Span], rank: int, dim: int) -> ExchangePlan:
    """The adjoint of band_gather_plan: each band's rows added into the shards that own them."""
    gather = band_gather_plan(shards, bands, rank, dim)
    return ExchangePlan(gather.places, gather.sends, ((dim, shards[rank][1] - shards[rank][0]),))


def split_to_split_plan(from_spans: list[Span], to_spans: list[Span], rank: int,
                        from_dim: int, to_dim: int) -> ExchangePlan:
    """All-to-all from a split along from_dim (whole along to_dim) to a split along to_dim
    (whole along from_dim): rank q receives to_spans[q] of every rank's piece."""
    sends = tuple(_region(to_dim, span) for span in to_spans)
    places = tuple(_region(from_dim, span) for span in from_spans)
    mine = to_spans[rank]
    return ExchangePlan(sends, places, ((to_dim, mine[1] - mine[0]), (from_dim, from_spans[-1][1])))


def reduce_scatter_plan(spans: list[Span], rank: int, dim: int) -> ExchangePlan:
    """Partial sums, whole along dim, added up; rank q keeps spans[q] of dim."""
    sends = tuple(_region(dim, span) for span in spans)
    places = tuple(() for _ in spans)
    return ExchangePlan(sends, places, ((dim, spans[rank][1] - spans[rank][0]),))
