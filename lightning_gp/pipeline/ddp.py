"""The DDP path: defend each rank's gradient in a communication hook, before the all-reduce.

Under DDP one rank is one client. By the time ``on_after_backward`` runs, DDP has averaged the
gradients, so the raw per-rank gradient has already left the rank; the defense must run inside
the communication hook. Lightning registers ``ddp_comm_hook`` only on CUDA, so the hook is
registered here on the DDP-wrapped model, which works on CPU/gloo as well.

DDP hands the hook one bucket of gradients at a time, while the backward pass goes on. Two ways
to defend them:

* **bucket by bucket** (:attr:`DefendedAllReduce.bucketwise`, chosen when every defense is
  :attr:`~lightning_gp.pipeline.stages.DefenseStage.layerwise`: per-layer Top-k, magnitude,
  random and dual gradient pruning, Gaussian/Laplace noise, quantisation): each bucket's layers
  are defended as the bucket arrives, written into the bucket and all-reduced asynchronously
  (``all_reduce(..., async_op=True).get_future().then(...)``, as torch's default
  ``allreduce_hook``), so communication overlaps the rest of the backward pass. The defended
  buckets are collected and the observers (taps, meters) see the whole shared gradient once,
  after the last bucket. Defending layers part by part in bucket order is bit-identical to
  defending them at once (state and random streams included);
* **held** (any defense that needs the whole model: global thresholds, sensitivity estimates,
  ADGP's shared mask, anything that prepares a round across clients): the hook holds every
  bucket until the last one arrives, defends the complete named gradient once, then all-reduces
  each bucket and completes the futures DDP is waiting on, giving up the overlap. A stage that
  prepares its round is prepared from the rank's gradient as the stages before it defend it
  (``SharedGradientPipeline.begin_round``): with ``[GaussianNoise, ADGP]`` the chosen rank
  broadcasts the mask of its noised gradient. A stage that prepares rounds is never layerwise,
  so the bucket-by-bucket path has no round to prepare.

Two things DDP would otherwise get wrong for a defense:

* a failure on one rank (say a NaN gradient) would raise there only, and the other ranks would
  die later inside gloo with "connection closed": the ranks agree on failure after defending,
  and every rank raises the same :class:`DistributedDefenseError` (bucket by bucket, a rank
  whose pipeline failed sends zeros for its remaining buckets, never an undefended gradient, and
  the ranks agree once the last bucket is sent);
* with ``find_unused_parameters=True``, DDP leaves ``.grad`` at ``None`` for a parameter no rank
  used this step, even though error feedback may have sent residual mass for it: the runner
  writes the aggregate into such gradients before the optimizer step, so nothing counted as sent
  is lost.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.futures import Future
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from lightning_gp.named_tensors import flatten_named, unflatten_named
from lightning_gp.pipeline.local import single_optimizer
from lightning_gp.pipeline.pipeline import ClientStepRunner, RoundNotPrepared, SharedGradientPipeline
from lightning_gp.pipeline.stages import ClientSetup, StageCall

if TYPE_CHECKING:
    import lightning.pytorch as pl


class DistributedDefenseError(RuntimeError):
    """The shared-gradient pipeline failed on at least one DDP rank; raised on every rank alike."""


class DDPClientStep(ClientStepRunner):
    """One DDP rank is one client: its gradient is defended in the communication hook."""

    execution_path = "ddp"

    def __init__(self) -> None:
        self.comm_hook: DefendedAllReduce | None = None

    def client_setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> ClientSetup:
        single_optimizer(trainer)
        # DDP reduces every parameter that requires a gradient, whatever the optimizer steps.
        shapes = {n: p.shape for n, p in pl_module.named_parameters() if p.requires_grad}
        return ClientSetup(trainer.world_size, pl_module, shapes, cohort_size=trainer.world_size)

    def attach(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.comm_hook = register_defended_allreduce(trainer, pl_module, self.fit_pipeline())

    @torch.no_grad()
    def before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer) -> None:
        # DDP leaves .grad None for a parameter no rank used this step, even though the hook sent a
        # (possibly nonzero, error-feedback) aggregate for it: give the optimizer what was sent.
        aggregate = self.comm_hook.last_aggregate if self.comm_hook is not None else None
        if not aggregate:
            return
        for name, p in pl_module.named_parameters():
            if p.grad is None and name in aggregate and bool(aggregate[name].any()):
                p.grad = aggregate[name].to(p.dtype).clone()


@dataclass
class _BucketwiseStep:
    """One optimizer step of the bucket-by-bucket path, from its first bucket to its last."""

    round: int
    meta: dict[str, Any]
    shared: dict[str, Tensor] = field(default_factory=dict)
    buckets: list[tuple[dict[str, Tensor], Future]] = field(default_factory=list)
    failure: Exception | None = None


class DefendedAllReduce:
    """State of the communication hook of one rank (one client).

    Attributes:
        bucketwise: defend and all-reduce each bucket as it arrives (True when every defense is
            layerwise), else hold every bucket and defend the whole gradient once. Setting it to
            False on a layerwise pipeline holds the buckets anyway (the comparison of
            ``benchmarks/distributed.py``); setting it to True on another pipeline is refused.
        last_aggregate: the aggregate of the last step (what every rank downloads), by layer; on
            the bucket-by-bucket path these are views of DDP's buckets, valid until the next backward.
        last_buckets: how many buckets DDP handed over in the last step.
    """

    def __init__(
        self,
        trainer: pl.Trainer,
        module: nn.Module,
        pipeline: SharedGradientPipeline,
        process_group: dist.ProcessGroup | None,
    ) -> None:
        self.trainer = trainer
        self.module = module
        self.pipeline = pipeline
        self.process_group = process_group
        self.names = {id(p): n for n, p in module.named_parameters()}
        self._pending: list[tuple[list[Tensor], list[Tensor], Tensor, Future]] = []
        self._step: _BucketwiseStep | None = None
        self.broadcasts = 0
        self.last_aggregate: dict[str, Tensor] = {}
        self.last_buckets = 0
        self.bucketwise = pipeline.layerwise

    def on_bucket(self, bucket: dist.GradBucket) -> Future:
        if self.bucketwise:
            if not self.pipeline.layerwise:
                raise RuntimeError(
                    "bucketwise=True needs every defense to be layerwise; a defense of this pipeline needs the "
                    "whole model's gradient at once"
                )
            return self._defend_bucket(bucket)
        future: Future = Future()
        self._pending.append((bucket.parameters(), bucket.gradients(), bucket.buffer(), future))
        if bucket.is_last():
            self._defend_and_allreduce()
        return future

    @torch.no_grad()
    def _defend_and_allreduce(self) -> None:
        pending, self._pending = self._pending, []
        gradients = {self.names[id(p)]: g for params, grads, _, _ in pending for p, g in zip(params, grads)}
        pipeline = self.pipeline
        rank, round = self.trainer.global_rank, self.trainer.global_step
        self._check_same_round(round)
        world = dist.get_world_size(self.process_group)
        failure: Exception | None = None
        not_prepared: RoundNotPrepared | None = None
        meta = {"path": DDPClientStep.execution_path, "world_size": self.trainer.world_size}
        try:
            # a stage that prepares its round (ADGP's broadcast mask) is prepared from this rank's
            # gradient as the stages before it defend it; process goes on from there
            pipeline.begin_round(
                round,
                list(range(world)),
                {rank: gradients},
                self._broadcast,
                model=self.module,
                meta=meta,
                agree=self._any_rank_failed,
            )
            shared = pipeline.process(gradients, StageCall(rank, round, self.module, meta=meta))
        except RoundNotPrepared as err:  # another rank failed first: it reports why, below
            not_prepared = err
        except Exception as err:  # agreed on below, then raised on every rank
            failure = err
        self._agree_on_failure(failure)  # raises on every rank when any rank failed
        if not_prepared is not None:
            raise not_prepared  # only if no rank reported the failure it agreed on
        aggregate = {}
        for params, _, buffer, future in pending:
            named = {self.names[id(p)]: p for p in params}
            flat = flatten_named({n: shared[n] for n in named}, dtype=buffer.dtype)
            dist.all_reduce(flat, group=self.process_group)
            flat.div_(world)
            aggregate.update(unflatten_named(flat, named))
            future.set_result(flat)
        self.last_aggregate, self.last_buckets = aggregate, len(pending)
        pipeline.finish_round(aggregate, round=round, clients=world)

    @torch.no_grad()
    def _defend_bucket(self, bucket: dist.GradBucket) -> Future:
        """Defend one bucket's layers, write them into the bucket and all-reduce it asynchronously."""
        round = self.trainer.global_step
        step = self._step
        if step is None or step.round != round:  # the first bucket of this optimizer step
            self._check_same_round(round)
            meta = {"path": DDPClientStep.execution_path, "world_size": self.trainer.world_size}
            step = self._step = _BucketwiseStep(round, meta)
        grads = bucket.gradients()  # views into bucket.buffer()
        gradients = {self.names[id(p)]: g for p, g in zip(bucket.parameters(), grads)}
        if step.failure is None:
            try:
                shared = self.pipeline.defend(
                    gradients, StageCall(self.trainer.global_rank, round, self.module, meta=step.meta), part=True
                )
            except Exception as err:  # agreed on after the last bucket, then raised on every rank
                step.failure = err
        buffer = bucket.buffer()
        if step.failure is None:
            # the observers see the whole gradient after the last bucket, when this bucket's
            # all-reduce (in place, asynchronous) may have averaged it: keep a copy of any layer
            # that still lives in the bucket (no defense, or one that passed a layer through)
            bucket_memory = buffer.untyped_storage().data_ptr()
            step.shared.update(
                {n: t.clone() if t.untyped_storage().data_ptr() == bucket_memory else t for n, t in shared.items()}
            )
            for g, name in zip(grads, gradients):
                g.copy_(shared[name])
        else:
            buffer.zero_()  # a failed rank sends nothing of its gradient
        world = dist.get_world_size(self.process_group)
        work = dist.all_reduce(buffer, group=self.process_group, async_op=True)
        assert work is not None
        # sum, then divide: the held path's arithmetic, so both give the same bits
        future = work.get_future().then(lambda fut: fut.value()[0].div_(world))
        step.buckets.append((gradients, future))
        if bucket.is_last():
            self._step = None
            self._finish_bucketwise(step)
        return future

    def _finish_bucketwise(self, step: _BucketwiseStep) -> None:
        """After the last bucket: the observers see the whole shared gradient, the ranks agree on
        failure once nothing is in flight, and the aggregate is recorded."""
        if step.failure is None:
            try:
                self.pipeline.observe(
                    step.shared, StageCall(self.trainer.global_rank, step.round, self.module, meta=step.meta)
                )
            except Exception as err:
                step.failure = err
        torch.futures.wait_all([future for _, future in step.buckets])
        self._agree_on_failure(
            step.failure,
            consequence="so this step is not applied (a failed rank sent zeros, never an undefended gradient)",
        )
        aggregate: dict[str, Tensor] = {}
        for gradients, future in step.buckets:
            aggregate.update(unflatten_named(future.value(), gradients))
        self.last_aggregate, self.last_buckets = aggregate, len(step.buckets)
        self.pipeline.finish_round(aggregate, round=step.round, clients=dist.get_world_size(self.process_group))

    def _agree_on_failure(self, failure: Exception | None, consequence: str = "so no rank shares this step") -> None:
        """Every rank learns whether any rank failed; then all raise the same error, or none does."""
        failed = torch.tensor([0 if failure is None else 1], dtype=torch.int64)
        dist.all_reduce(failed, group=self.process_group)
        if int(failed) == 0:
            return
        messages: list[str | None] = [None] * dist.get_world_size(self.process_group)
        mine = None if failure is None else f"{type(failure).__name__}: {failure}"
        dist.all_gather_object(messages, mine, group=self.process_group)
        report = "; ".join(f"rank {r}: {m}" for r, m in enumerate(messages) if m is not None)
        raise DistributedDefenseError(
            f"the shared-gradient pipeline failed at step {self.trainer.global_step} on "
            f"{sum(m is not None for m in messages)} of {len(messages)} DDP ranks, {consequence} ({report})"
        ) from failure

    def _any_rank_failed(self, failed: bool) -> bool:
        """Every rank says whether it failed; all learn whether any did (``agree`` of
        ``SharedGradientPipeline.begin_round``: no rank waits in a broadcast for a failed one)."""
        flag = torch.tensor([1 if failed else 0], dtype=torch.int64)
        dist.all_reduce(flag, group=self.process_group)
        return int(flag) > 0

    def _check_same_round(self, round: int) -> None:
        """Every rank must be in the same round, or a shared mask would pair the wrong rounds."""
        rounds = torch.tensor([round, -round], dtype=torch.int64)
        dist.all_reduce(rounds, op=dist.ReduceOp.MAX, group=self.process_group)
        if int(rounds[0]) != -int(rounds[1]):
            raise RuntimeError(
                f"DDP ranks disagree on the round: this rank is at step {round}, others range over "
                f"[{-int(rounds[1])}, {int(rounds[0])}]; every rank must run the same number of optimizer steps"
            )

    def _broadcast(self, source_client: int, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        """``share`` under DDP: the source rank's tensors, sent to every rank in one broadcast
        when they share a dtype (ADGP's boolean masks travel as one uint8 buffer)."""
        dtypes = {t.dtype for t in tensors.values()}
        if len(dtypes) == 1:
            flat = flatten_named(tensors)
            dist.broadcast(flat, src=source_client, group=self.process_group)
            self.broadcasts += 1
            return unflatten_named(flat, tensors)
        out = {}
        for name, tensor in tensors.items():
            tensor = tensor.clone()
            dist.broadcast(tensor, src=source_client, group=self.process_group)
            self.broadcasts += 1
            out[name] = tensor
        return out


# DDP checks this hook's annotations at runtime: they must be real objects, not strings.
def _defended_allreduce_hook(state: DefendedAllReduce, bucket: dist.GradBucket) -> Future[Tensor]:
    return state.on_bucket(bucket)


_defended_allreduce_hook.__annotations__ = {
    "state": DefendedAllReduce,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


def register_defended_allreduce(
    trainer: pl.Trainer, pl_module: pl.LightningModule, pipeline: SharedGradientPipeline
) -> DefendedAllReduce:
    """Register the defending all-reduce on the trainer's DDP-wrapped model."""
    ddp_model = trainer.strategy.model
    if not isinstance(ddp_model, DistributedDataParallel):
        raise RuntimeError(
            f"expected the DDP strategy to wrap the model in DistributedDataParallel, found {type(ddp_model).__name__}"
        )
    state = DefendedAllReduce(trainer, pl_module, pipeline, ddp_model.process_group)
    try:
        ddp_model.register_comm_hook(state, _defended_allreduce_hook)
    except RuntimeError as err:
        raise RuntimeError(
            "gradient defenses register their own DDP communication hook, and this model already has "
            "one; remove ddp_comm_hook from DDPStrategy(...) (a defense must see the gradient before "
            "any compression or all-reduce)"
        ) from err
    return state
