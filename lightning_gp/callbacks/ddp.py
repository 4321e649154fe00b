"""The DDP path: defend each rank's gradient in a communication hook, before the all-reduce.

Under DDP one rank is one client. By the time ``on_after_backward`` runs, DDP has averaged the
gradients, so the raw per-rank gradient has already left the rank; the defense must run inside
the communication hook. Lightning registers ``ddp_comm_hook`` only on CUDA, so the hook is
registered here on the DDP-wrapped model, which works on CPU/gloo as well.

DDP hands the hook one bucket of gradients at a time, but defenses may need the whole model
(global thresholds, per-model masks). The hook therefore holds every bucket until the last one
arrives, defends the complete named gradient once, then all-reduces each bucket and completes
the futures DDP is waiting on. This gives up DDP's overlap of communication with the backward
pass: the price of defending the full gradient.
"""

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.futures import Future

if TYPE_CHECKING:
    import lightning.pytorch as pl


class DefendedAllReduce:
    """State of the communication hook of one rank (one client)."""

    def __init__(self, trainer: "pl.Trainer", module: nn.Module, process_group: dist.ProcessGroup | None) -> None:
        self.trainer = trainer
        self.module = module
        self.process_group = process_group
        self.names = {id(p): n for n, p in module.named_parameters()}
        self._pending: list[tuple[list[Tensor], list[Tensor], Tensor, Future]] = []
        self.broadcasts = 0

    def on_bucket(self, bucket: dist.GradBucket) -> Future:
        future: Future = Future()
        self._pending.append((bucket.parameters(), bucket.gradients(), bucket.buffer(), future))
        if bucket.is_last():
            self._defend_and_allreduce()
        return future

    @torch.no_grad()
    def _defend_and_allreduce(self) -> None:
        from lightning_gp.callbacks.pipeline import SharedGradientPipeline

        pending, self._pending = self._pending, []
        gradients = {self.names[id(p)]: g for params, grads, _, _ in pending for p, g in zip(params, grads)}
        pipeline = SharedGradientPipeline.from_trainer(self.trainer)
        rank, round = self.trainer.global_rank, self.trainer.global_step
        self._check_same_round(round)
        world = dist.get_world_size(self.process_group)
        pipeline.begin_round(round, list(range(world)), {rank: gradients}, self._broadcast)
        shared = pipeline.process(
            gradients,
            client_id=rank,
            round=round,
            model=self.module,
            meta={"path": "ddp", "world_size": self.trainer.world_size},
        )
        aggregate = {}
        for params, _, buffer, future in pending:
            flat = torch.cat([shared[self.names[id(p)]].reshape(-1) for p in params]).to(buffer.dtype)
            dist.all_reduce(flat, group=self.process_group)
            flat.div_(world)
            aggregate.update(_unpack(flat, {self.names[id(p)]: p for p in params}))
            future.set_result(flat)
        pipeline.finish_round(aggregate, round=round, clients=world)

    def _check_same_round(self, round: int) -> None:
        """Every rank must be in the same round, or a shared mask would pair the wrong rounds."""
        rounds = torch.tensor([round, -round], dtype=torch.int64)
        dist.all_reduce(rounds, op=dist.ReduceOp.MAX, group=self.process_group)
        if int(rounds[0]) != -int(rounds[1]):
            raise RuntimeError(
                f"DDP ranks disagree on the round: this rank is at step {round}, others range over "
                f"[{-int(rounds[1])}, {int(rounds[0])}]; every rank must run the same number of optimizer steps"
            )

    def _broadcast(self, source_client: int, tensors: dict) -> dict:
        """``share`` under DDP: the source rank's tensors, sent to every rank in one broadcast
        when they share a dtype (ADGP's boolean masks travel as one uint8 buffer)."""
        dtypes = {t.dtype for t in tensors.values()}
        if len(dtypes) == 1:
            flat = _pack(tensors)
            dist.broadcast(flat, src=source_client, group=self.process_group)
            self.broadcasts += 1
            return _unpack(flat, tensors)
        out = {}
        for name, tensor in tensors.items():
            tensor = tensor.clone()
            dist.broadcast(tensor, src=source_client, group=self.process_group)
            self.broadcasts += 1
            out[name] = tensor
        return out


def _pack(tensors: dict) -> torch.Tensor:
    return torch.cat([t.reshape(-1).to(torch.uint8 if t.dtype == torch.bool else t.dtype) for t in tensors.values()])


def _unpack(flat: torch.Tensor, like: dict) -> dict:
    out, offset = {}, 0
    for name, t in like.items():
        out[name] = flat[offset : offset + t.numel()].view(t.shape).to(t.dtype)
        offset += t.numel()
    return out


# DDP checks this hook's annotations at runtime: they must be real objects, not strings.
def _defended_allreduce_hook(state: "DefendedAllReduce", bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    return state.on_bucket(bucket)


def register_defended_allreduce(trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> DefendedAllReduce:
    """Register the defending all-reduce on the trainer's DDP-wrapped model."""
    from torch.nn.parallel import DistributedDataParallel

    ddp_model = trainer.strategy.model
    if not isinstance(ddp_model, DistributedDataParallel):
        raise RuntimeError(
            f"expected the DDP strategy to wrap the model in DistributedDataParallel, found {type(ddp_model).__name__}"
        )
    state = DefendedAllReduce(trainer, pl_module, ddp_model.process_group)
    try:
        ddp_model.register_comm_hook(state, _defended_allreduce_hook)
    except RuntimeError as err:
        raise RuntimeError(
            "gradient defenses register their own DDP communication hook, and this model already has "
            "one; remove ddp_comm_hook from DDPStrategy(...) (a defense must see the gradient before "
            "any compression or all-reduce)"
        ) from err
    return state
