"""The trainer: reads packed micro-batches, optimises the policy, publishes versioned weights.

One optimizer step per batch: for every micro-batch, the model's hidden states (with the
sampler's routing replayed when ``trainer.router_replay``), fused log-probs of each next token,
the policy loss normalised by the batch's global loss-token count, backward; then gradient
clipping, AdamW and the learning-rate schedule. Weights after step n are published as version
n+1 through the backend's ``WeightChannel`` (``inference.weight_channels``: files, or a broadcast;
the trainer does not know which). A non-finite loss skips the update (counted, logged) up to
``trainer.nan_retries`` steps in a row, then stops the run with an error.

Launched as one process, or with ``torchrun --nproc-per-node N`` (gloo on CPU, nccl on GPU).
Placement (``placement.resolve_placement``): rank r on the GPU of its LOCAL_RANK, the mesh on
that device type, micro-batches moved there after packing-side preparation on the CPU. Under
``trainer.mixed_precision = bf16`` the model is always an FSDP2 module (one rank: a one-rank
mesh of a process group the trainer opens itself) whose ``MixedPrecisionPolicy`` computes in
bf16 and keeps float32 master weights, optimizer state and gradient reduction.
Over several ranks the trainer is the composition of the parallel layer (``trainer.parallel``):
``ParallelDims`` + ``build_mesh``, FP8 (``primerl.models.convert_to_fp8``) and then
``primerl.models.parallelize`` (expert parallel, ring attention, activation checkpointing,
FSDP2). The ranks of one ``cp`` group read the same micro-batches (file ``rank_<b>``, b = the
rank's index in the mesh's ``batch`` view); each micro-batch's loss-side fields are first moved
one token earlier (entry t is scored from the hidden state at t, so no shift crosses a shard),
then every per-token tensor, replayed expert ids included, is cut by one ``ContextShardPlan``
over ``mesh["cp"]``: a rank holds seq_len / cp tokens and computes hidden states, fused
log-probs and the loss on them. The loss divides by one global loss-token count per optimizer
step (counted on the shards, all-reduced over every rank), so FSDP sums gradients and every
layout optimises the same objective as one process.

Host reads (GPU synchronisations): ``prepare_step`` plans a batch on the host from the payload's
packed CPU tensors (loss counts, loss tokens per micro-batch, padded-attention plans) before the
batch moves to the device; ``run_step``, the device work, accumulates every metric and guard flag
on the device (AdamW is fused: step counts on the device, a non-finite update skipped through its
``found_inf``) and reads the host once per optimizer step: the ``.tolist()`` of the step's packed
metrics, grad norm and guard flags (tests/runtime/test_trainer_compile.py counts it).
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from primerl.kernels.logprobs import fused_logprobs
from primerl.rl.next_token import FORWARD_FIELDS, next_token_batch, next_token_targets, token_aligned  # noqa: F401

from . import _rl
from . import full_state
from .checkpoint import latest_checkpoint, load_checkpoint
from .dcp_checkpoint import is_dcp_checkpoint, load_dcp_checkpoint, save_dcp_checkpoint
from ..config import RLConfig, cp_degrees, parallel_dims
from .guards import nonfinite_parameters, raise_nonfinite_parameters
from .padded_attention import PaddedPlan, padded_forward
from ..heartbeat import beat
from ..lifetime import JOB_RESTARTS_ENV
from ..placement import resolve_placement
from ..policy import base_model_name, build_model
from ..zmq_transport import make_transport
from .publish import WeightStream

log = logging.getLogger("primerl.trainer")


class NonFiniteLossError(RuntimeError):
    pass


@dataclass
class PreparedStep:
    """One optimizer step planned on the host (``Trainer.prepare_step``): per micro-batch (batch,
    targets, PaddedPlan or None, loss tokens, longest sequence or None); the loss counts summed
    over ranks (Python floats, ``_rl.loss_counts``); ``total``: the global loss-token count (>= 1);
    this rank's loss tokens and tokens."""

    micro_batches: list[tuple]
    counts: list[float]
    total: int
    n_loss: int
    n_tok: int


def lr_lambda(cfg: RLConfig) -> Callable[[int], float]:
    t = cfg.trainer

    def f(step: int) -> float:
        if t.warmup_steps and step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        if t.lr_schedule == "constant":
            return 1.0
        span = max(cfg.max_steps - t.warmup_steps, 1)
        frac = min(max(step - t.warmup_steps, 0) / span, 1.0)
        decay = 1 - frac if t.lr_schedule == "linear" else 0.5 * (1 + math.cos(math.pi * frac))
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * decay

    return f


def shifted_logprobs(model, mb, *, replay: bool, chunk_size: int | None = None, padded: bool = False):
    """Per-token log-probs aligned with ``mb.input_ids`` (token t from the hidden state at t-1;
    0 at each sequence's first token) and entropies, both [T] float32."""
    ids = mb.input_ids
    replay_ids = mb.replay_ids if replay else None
    if padded:
        hidden = padded_forward(model, ids, mb.position_ids, mb.cu_seqlens, replay_ids=replay_ids)
    else:
        hidden = model(ids, mb.position_ids, mb.cu_seqlens, replay_ids=replay_ids)
    temperature = 1.0 if mb.temperatures is None else next_token_targets(mb.temperatures)
    lp, ent = fused_logprobs(hidden, model.lm_head.weight, next_token_targets(ids), temperature=temperature,
                             chunk_size=chunk_size)
    return token_aligned(lp, mb.cu_seqlens), token_aligned(ent, mb.cu_seqlens)


def next_token_logprobs(model, mb, targets, *, replay: bool, plan=None, padded: bool = False,
                        chunk_size: int | None = None, padded_plan: PaddedPlan | None = None,
                        max_seqlen: int | None = None, return_hidden: bool = False):
    """Fused log-probs of ``targets`` and entropies from each hidden state of ``mb`` (a
    ``next_token_batch``, sharded by ``plan`` under context parallelism), both [t] float32.
    ``padded_plan``: the ``PaddedPlan`` of ``mb.cu_seqlens`` built beforehand (else built here,
    which reads ``cu_seqlens`` on the host); ``max_seqlen``: the longest sequence of ``mb`` (passed to
    the model, whose sparse-attention form reads it on the device otherwise). ``return_hidden``:
    the hidden states [t, D] come third (the teacher's top-k term scores more tokens from them)."""
    replay_ids = mb.replay_ids if replay else None
    if padded:
        hidden = padded_forward(model, mb.input_ids, mb.position_ids,
                                mb.cu_seqlens if padded_plan is None else padded_plan, replay_ids=replay_ids)
    else:
        sparse = getattr(getattr(model, "config", None), "is_sparse", False)  # only it uses the value
        extra = {"max_seqlen": max_seqlen} if sparse and max_seqlen is not None and plan is None else {}
        hidden = model(mb.input_ids, mb.position_ids, mb.cu_seqlens if plan is None else plan, replay_ids=replay_ids,
                       **extra)
    temperature = 1.0 if mb.temperatures is None else mb.temperatures
    lp, ent = fused_logprobs(hidden, model.lm_head.weight, targets, temperature=temperature, chunk_size=chunk_size)
    return (lp, ent, hidden) if return_hidden else (lp, ent)


LORA_SEED_OFFSET = 0x10AA  # the adapters' init draws from seed + this (not the model init's numbers again)


class Trainer:
    def __init__(self, cfg: RLConfig, vocab_size: int, *, rank: int = 0, world_size: int = 1):
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        if world_size != cfg.num_trainer_ranks:
            raise ValueError(f"num_trainer_ranks = {cfg.num_trainer_ranks} but the trainer runs with {world_size} "
                             "process(es)")
        t, par = cfg.trainer, cfg.trainer.parallel
        self.dims = parallel_dims(cfg)
        self.placement = resolve_placement(cfg)
        self.device = self.placement.trainer_device(int(os.environ.get("LOCAL_RANK", "0")) if world_size > 1 else 0)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.mixed_precision = self.placement.mixed_precision
        self.fsdp = (world_size > 1 and t.fsdp) or self.mixed_precision
        # a single process under mixed precision shards nothing but needs FSDP2's policy: one rank
        self._own_group = self.fsdp and world_size == 1 and open_single_rank_group(self.placement.dist_backend)
        self.model = build_model(cfg, vocab_size, device=self.device)
        self.model.train()
        # frozen initial policy, when the loss needs one (LoRA: the policy itself with its adapters off, below)
        self.ref_model = None if t.lora.rank else _rl.reference_model(t.loss, self.model)
        # the teacher's top-k term (distill.topk): its batches carry the teacher's k tokens per position
        self.topk_coef = cfg.distill.topk_coef if cfg.distill.topk else 0.0
        if par.fp8 != "off":
            from primerl.models import convert_to_fp8

            convert_to_fp8(self.model, par.fp8)
        if t.lora.rank:  # the adapters only train; the KL reference is the frozen base: the policy, adapters off
            from primerl.models import apply_lora

            # the same A on every rank and in every run: seeded, apart from the model init's stream (seed)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(cfg.seed + LORA_SEED_OFFSET)
                apply_lora(self.model, t.lora.rank, t.lora.alpha, targets=t.lora.targets or None)
            self.ref_model = _rl.reference_model(t.loss, self.model, lora=True)
        self.mesh = None
        if world_size > 1 or self.fsdp:
            self.mesh = self.dims.build_mesh(self.device.type)
        from primerl.models import parallelize

        param_dtype = self.placement.param_dtype  # bf16 under mixed precision, else the stored dtype
        if par.cpu_offload and not self.fsdp:
            raise ValueError("trainer.parallel.cpu_offload: needs FSDP2 (more than one trainer rank, or mixed "
                             "precision); this trainer runs one rank without it")
        cp_kw = dict(cp_kind=par.cp_kind, cp_ulysses=cp_degrees(par, self.dims.cp)[0] if self.dims.cp > 1 else 0,
                     cpu_offload=par.cpu_offload)
        parallelize(self.model, self.dims, self.mesh, fsdp=self.fsdp,
                    activation_checkpointing=(None if par.activation_checkpointing == "none"
                                              else par.activation_checkpointing),
                    ac_every=2, param_dtype=param_dtype, reduce_dtype=torch.float32,
                    activation_offload=par.activation_offload, **cp_kw)
        if self.ref_model is not None and self.ref_model is not self.model:  # the same layout: same micro-batches
            parallelize(self.ref_model, self.dims, self.mesh, fsdp=self.fsdp,
                        param_dtype=param_dtype, reduce_dtype=torch.float32, **cp_kw)
        # which packed batch this rank reads (the ranks of a cp group read the same one)
        self.data_rank = self.mesh["batch"].get_local_rank() if self.mesh is not None else 0
        self.cp_group = self.mesh["cp"].get_group() if self.dims.cp > 1 else None
        self.cp_rank = self.mesh["cp"].get_local_rank() if self.dims.cp > 1 else 0
        self.ep_group = self.mesh["ep"].get_group() if self.dims.ep > 1 else None
        # fused: step counts live on the device (the default AdamW reads one per parameter on the host
        # every step) and ``found_inf`` skips a non-finite update without a host read
        self.optimizer = torch.optim.AdamW(self.trainable_parameters(), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
                                           weight_decay=t.weight_decay, fused=True)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg))
        self.padded = self.dims.cp == 1 and (
            t.attention == "padded" or (t.attention == "auto" and self.model.embed.weight.device.type == "cpu"))
        if t.compile:
            compile_model(self.model)
        self.step = 0
        self.nan_streak = 0
        self.nan_skipped = 0

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """What AdamW updates: every parameter, or under ``trainer.lora`` the adapters alone."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def lora_meta(self) -> dict:
        """What a checkpoint records of ``trainer.lora``: rank, alpha, targets and the base it adapts."""
        lo = self.cfg.trainer.lora
        if not lo.rank:
            return {}
        return {"lora": {"rank": lo.rank, "alpha": lo.alpha, "targets": list(self.model.lora.targets),
                         "base": base_model_name(self.cfg)}}

    def close(self) -> None:
        """Close the one-rank process group this trainer opened for mixed precision (if any)."""
        if self._own_group and dist.is_initialized():
            dist.destroy_process_group()
        self._own_group = False

    # ---------------------------------------------------------------- state
    def state_dict_for_publish(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) weights at their global shapes. Collective when distributed: every rank
        calls it; rank 0 gets them (the others get {})."""
        if self.world_size == 1 and not self.fsdp:
            return {k: v.detach() for k, v in self.model.state_dict().items()}
        return full_state.full_model_state(self.model, ep_group=self.ep_group, keep=self.rank == 0)

    def train_state(self) -> dict:
        """Optimizer (keyed by parameter name, global shapes), scheduler and counters; collective
        like ``state_dict_for_publish``."""
        opt = full_state.full_optimizer_state(self.model, self.optimizer, ep_group=self.ep_group,
                                              keep=self.rank == 0 or self.world_size == 1)
        return {"optimizer": opt, "scheduler": self.scheduler.state_dict(),
                "nan_skipped": self.nan_skipped, "nan_streak": self.nan_streak}

    def save_checkpoint(self, root, step: int, *, async_save: bool = False) -> None:
        """Write a sharded DCP checkpoint after ``step`` optimizer steps (collective: every rank
        writes its own shard, see ``dcp_checkpoint``); ``async_save`` writes it in the background."""
        group = None
        if async_save and self.world_size > 1:  # its own gloo group: training collectives go on meanwhile
            if getattr(self, "_ckpt_group", None) is None:
                self._ckpt_group = dist.new_group(backend="gloo")
            group = self._ckpt_group
        state = {"scheduler": self.scheduler.state_dict(), "nan_skipped": self.nan_skipped,
                 "nan_streak": self.nan_streak}
        save_dcp_checkpoint(root, step, self.model, self.optimizer, state, keep=self.cfg.checkpoint.keep,
                            async_save=async_save, process_group=group, meta=self.lora_meta())

    def load(self, path) -> None:
        """Resume from a checkpoint written on any layout: a sharded DCP one (each rank reads its
        slices) or a full-state one (every rank reads the files)."""
        check_checkpoint_lora(path, self.lora_meta())
        if is_dcp_checkpoint(path):
            step, state = load_dcp_checkpoint(path, self.model, self.optimizer)
        else:
            step, model_sd, state = load_checkpoint(path)
            full_state.load_model_state(self.model, model_sd, ep_group=self.ep_group)
            full_state.load_optimizer_state(self.model, self.optimizer, state["optimizer"], ep_group=self.ep_group)
        self.scheduler.load_state_dict(state["scheduler"])
        self.nan_skipped, self.nan_streak = state["nan_skipped"], state["nan_streak"]
        self.step = step

    def _grad_norm(self, params) -> float:
        return _grad_norm_of(params, self.fsdp, self.dims.dp_replicate)

    def _local_batch(self, mb):
        """-> (this rank's part of ``next_token_batch(mb)``, its targets [t])."""
        mb, targets = next_token_batch(mb)
        if self.dims.cp == 1:
            return mb, targets
        from primerl.parallel.context import ContextShardPlan

        if self.device.type != "cpu":  # the plan's index tensors live where its cu_seqlens do
            mb, targets = mb.to(self.device), targets.to(self.device)

        plan = ContextShardPlan(mb.cu_seqlens, self.cp_group, layout=self.cfg.trainer.parallel.cp_layout)
        return mb.shard_for_context(plan), plan.shard(targets)

    def entropy_coef(self) -> float:
        t = self.cfg.trainer
        if not t.entropy_decay_steps:
            return t.entropy_coef
        return t.entropy_coef * max(0.0, 1.0 - self.step / t.entropy_decay_steps)

    # ---------------------------------------------------------------- one step
    def train_step(self, payload: dict) -> dict:
        """One rollout batch: ``trainer.mini_batches`` optimizer steps over slices of its micro-batches.
        ``mismatch_kl/mean`` is measured on the first slice, before any update of this batch.
        ``prepare_step`` (host-side planning on the payload's CPU tensors) then ``run_step`` (the
        device work: one host read per optimizer step, for its metrics and guards)."""
        return self.run_step(self.prepare_step(payload))

    def prepare_step(self, payload: dict) -> list[PreparedStep]:
        """Plan each optimizer step of ``payload`` on the host, before any device work: the shifted
        (and cp-sharded) micro-batches, the loss counts used for normalisation (all-reduced over
        ranks), each micro-batch's loss tokens and the padded-attention plan, all read from the
        packed CPU tensors; then the micro-batches move to the trainer's device."""
        mbs = payload["micro_batches"]
        n = min(self.cfg.trainer.mini_batches, len(mbs))
        bounds = [round(i * len(mbs) / n) for i in range(n + 1)]
        return [self._prepare(mbs[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]

    def run_step(self, prepared: list[PreparedStep]) -> dict:
        """The device work of ``prepare_step``'s optimizer steps, then the scheduler; -> the metrics."""
        rows = [self._optimizer_step(p) for p in prepared]
        self.scheduler.step()
        self.step += 1
        out = dict(rows[0])
        out["loss"] = sum(r["loss"] for r in rows) / len(rows)
        out["tokens"] = sum(r["tokens"] for r in rows)
        out["loss_tokens"] = sum(r["loss_tokens"] for r in rows)
        out["grad_norm"] = max(r["grad_norm"] for r in rows)
        out["nan_skipped"] = self.nan_skipped
        return out

    def _prepare(self, mbs: list) -> PreparedStep:
        t = self.cfg.trainer
        if self.fsdp:  # every rank must run the same forwards/backwards: padding becomes a 2-token dummy
            mbs = [_dummy_like(mb) if mb.is_padding or mb.num_tokens == 0 else mb for mb in mbs]
        else:  # grads are all-reduced after the loop, so a padding micro-batch can be skipped
            mbs = [mb for mb in mbs if not mb.is_padding and mb.num_tokens > 0]
        mbs = [self._local_batch(mb) for mb in mbs]  # (shifted and cp-sharded micro-batch, targets)
        counts = _rl.loss_counts([mb for mb, _ in mbs], t.loss)  # [loss tokens, loss sequences, ...]
        if self.world_size > 1:
            dist.all_reduce(counts, op=dist.ReduceOp.SUM)
        counts = counts.tolist()
        loss_tokens = [int(mb.loss_mask.sum()) for mb, _ in mbs]
        plans = [PaddedPlan(mb.cu_seqlens) if self.padded else None for mb, _ in mbs]
        # the longest sequence, for a sparse-attention model's dense/sparse choice (else it reads
        # cu_seqlens on the device once per forward); not under context parallelism or padding
        longest = [int(mb.cu_seqlens.diff().max()) if mb.context_plan is None and not self.padded
                   and mb.cu_seqlens.numel() > 1 else None for mb, _ in mbs]
        n_tok = 0
        if self.cp_rank == 0:  # the ranks of a cp group hold parts of the same tokens
            n_tok = sum(0 if mb.is_padding else (mb.num_real_tokens or mb.num_tokens) for mb, _ in mbs)
        if self.device.type != "cpu":  # planned on the host above (no syncs); the model reads them here
            mbs = [(mb.to(self.device, non_blocking=True), tg.to(self.device, non_blocking=True)) for mb, tg in mbs]
            plans = [p if p is None else p.to(self.device, non_blocking=True) for p in plans]
        return PreparedStep([(mb, tg, plan, k, n) for (mb, tg), plan, k, n in zip(mbs, plans, loss_tokens, longest)],
                            counts, max(int(counts[0]), 1), sum(loss_tokens), n_tok)

    def _optimizer_step(self, prep: PreparedStep) -> dict:
        """Forward, loss and backward of each micro-batch, accumulating every metric on the device;
        gradient clipping, the non-finite guards and AdamW (fused: its ``found_inf`` skips a
        non-finite update on the device) with no host read; then ONE host read of the step's
        metrics, grad norm and guard flags, and the host's decisions on them."""
        t = self.cfg.trainer
        replay = t.router_replay
        dev = self.device
        self.optimizer.zero_grad(set_to_none=False)
        if self.world_size > 1 and not self.fsdp:  # a rank with only padding still joins every all-reduce
            for p in self.trainable_parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
        # [loss, mismatch_kl, entropy, clip_frac_low, clip_frac_high, ess] sums (the means weighted by
        # each micro-batch's loss tokens), float64 on the device
        acc = torch.zeros(6, dtype=torch.float64, device=dev)
        ratio_max = torch.zeros((), dtype=torch.float64, device=dev)
        loss_metrics = _rl.LossMetrics(t.loss, self.world_size, device=dev,
                                       extra=("distill_topk_kl",) if self.topk_coef else ())
        zero = torch.zeros((), device=dev)
        for mb, targets, plan, k, longest in prep.micro_batches:
            # the reference first: under LoRA it is this model (adapters off), run before the policy's graph
            ref_lp = _rl.reference_logprobs(self.ref_model, lambda ref: next_token_logprobs(
                ref, mb, targets, replay=False, plan=mb.context_plan, padded=self.padded, padded_plan=plan,
                max_seqlen=longest)[0])
            lp, ent, hidden = next_token_logprobs(self.model, mb, targets, replay=replay, plan=mb.context_plan,
                                                  padded=self.padded, padded_plan=plan, max_seqlen=longest,
                                                  return_hidden=True)
            loss, m = _rl.policy_loss(lp, mb, t.loss, prep.counts, entropy=ent, ref_logprobs=ref_lp)
            if self.topk_coef and mb.teacher_topk_ids is not None:
                term, m["distill_topk_kl"] = _rl.topk_distill_term(self.model, hidden, mb, targets, lp,
                                                                   self.topk_coef, prep.counts, k)
                loss = loss + term
            coef = self.entropy_coef()
            if coef:
                loss = loss - coef * (ent * mb.loss_mask).sum() / prep.total
            loss.backward()
            loss_metrics.add(m, k)
            row = [loss.detach().double()] + [m.get(key, zero).double() * k for key in
                                              ("mismatch_kl", "entropy", "clip_frac_low", "clip_frac_high", "ess")]
            acc += torch.stack(row)
            ratio_max = torch.maximum(ratio_max, m.get("ratio_max", zero).to(torch.float64))
        if self.world_size > 1 and not self.fsdp:  # FSDP already reduce-scattered (summed) the gradients
            for p in self.model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
        grads = [_local(p.grad) for p in self.model.parameters() if p.grad is not None]
        local_bad = ~torch.stack([torch.isfinite(g).all() for g in grads]).all() if grads else zero.bool()
        # summed over ranks: [6 sums, loss tokens, tokens, ranks with a non-finite gradient, LossMetrics' sums]
        # (host numbers enter as scalar operands: a tensor built from a list would be a blocking copy)
        z = acc.new_zeros(())
        counts = torch.stack([z + prep.n_loss, z + prep.n_tok, local_bad.to(torch.float64)])
        stats = torch.cat([acc, counts, loss_metrics.sums()])
        if self.world_size > 1:
            dist.all_reduce(stats, op=dist.ReduceOp.SUM)
        bad = (stats[8] > 0) | ~torch.isfinite(stats[0])
        params = [p for p in self.model.parameters() if p.grad is not None]
        gn = _grad_norm_tensor(params, self.fsdp, self.dims.dp_replicate, dev)
        if t.max_grad_norm > 0:  # scale by max / (norm + 1e-6) only where norm > max (a factor 1 is exact)
            clip = torch.where(gn > t.max_grad_norm, t.max_grad_norm / (gn + 1e-6), torch.ones_like(gn))
            for p in params:
                p.grad.mul_(clip.to(p.grad.dtype))
        # fused AdamW skips every parameter's update (and its step count) when found_inf is 1.0
        self.optimizer.found_inf = bad.to(torch.float32)
        self.optimizer.step()
        params_bad = nonfinite_parameters(self.model, distributed=self.world_size > 1)
        _, custom = loss_metrics.custom()
        # the step's one host read: every metric, the grad norm and both guards' flags
        packed = torch.cat([stats, gn.reshape(1).to(torch.float64), ratio_max.reshape(1),
                            params_bad.to(torch.float64).reshape(1), custom])
        values = packed.tolist()
        loss_all, kl_all, ent_all, cl, ch, ess, n_loss_all, n_tok_all, _ = values[:9]
        n_lm = len(loss_metrics.keys) + 2
        lm_sums, (gn_v, ratio_v, params_bad_v), custom_v = (values[9:9 + n_lm], values[9 + n_lm:12 + n_lm],
                                                            values[12 + n_lm:])
        finite = values[8] == 0 and math.isfinite(loss_all)
        denom = max(n_loss_all, 1)
        metrics = {"loss": loss_all, "mismatch_kl/mean": kl_all / denom, "entropy/mean": ent_all / denom,
                   "clip_frac_low": cl / denom, "clip_frac_high": ch / denom, "ess": ess / denom,
                   "ratio_max": ratio_v, "tokens": int(n_tok_all), "loss_tokens": int(n_loss_all),
                   "lr": self.scheduler.get_last_lr()[0], **loss_metrics.result(lm_sums, custom_v)}
        if not finite:
            self.nan_streak += 1
            self.nan_skipped += 1
            self.optimizer.zero_grad(set_to_none=True)
            log.warning("step %d: non-finite loss or gradient (loss=%s); update skipped (%d in a row, limit %d)",
                        self.step, loss_all, self.nan_streak, t.nan_retries)
            if self.nan_streak > t.nan_retries:
                raise NonFiniteLossError(
                    f"step {self.step}: loss or gradients were non-finite for {self.nan_streak} updates in a row "
                    f"(trainer.nan_retries = {t.nan_retries}); last loss = {loss_all}. Lower trainer.lr, check the "
                    "rewards/advantages for NaN, or raise trainer.nan_retries.")
            metrics["grad_norm"] = float("nan")
            return metrics
        self.nan_streak = 0
        metrics["grad_norm"] = gn_v
        if params_bad_v:
            raise_nonfinite_parameters(self.model, self.step)
        return metrics


def export_hf(model, path) -> None:
    """``checkpoint.export_hf``: ``model``'s policy in Hugging Face's layout at ``path``, LoRA
    adapters merged in for the save (collective under FSDP)."""
    lora = getattr(model, "lora", None) is not None
    if lora:
        from primerl.models import merge_lora

        merge_lora(model)
    try:
        model.save_pretrained(path)
    finally:
        if lora:
            from primerl.models import unmerge_lora

            unmerge_lora(model)


def check_checkpoint_lora(path, expected: dict) -> None:
    """A checkpoint resumes only the run it came from: LoRA or not, the same rank / alpha / targets
    and the same base (its ``meta.json`` records them)."""
    import json
    from pathlib import Path

    meta_file = Path(path) / "meta.json"
    if not meta_file.exists():
        return
    saved = json.loads(meta_file.read_text()).get("lora", {})
    want = expected.get("lora", {})
    if saved != want:
        raise ValueError(f"checkpoint {path}: its trainer.lora is {saved or 'off'}, this run's is {want or 'off'} "
                         "(resume with the config that wrote it)")


def compile_model(model, backend: str | Callable = "inductor") -> None:
    """``trainer.compile``: the model's forward under ``torch.compile(dynamic=True)``, in place
    (``nn.Module.compile``: parameter names, checkpoints and weight publishing are unchanged). Token
    and sequence counts are symbolic from the first call, so a new packing reuses the graph instead
    of recompiling; autograd compiles the backward alongside.

    Python floats (norm eps, rope theta, softmax scale, route scale) are traced as constants
    (dynamo's ``specialize_float``, thread-local while the compiled call runs): under
    ``dynamic=True`` dynamo otherwise makes each module float symbolic, the model's float-only uses
    (``route_scale != 1.0``, float op arguments) cannot become tensors, and dynamo traces the whole
    forward and backward a second time with them specialized (one restart per graph; 34 -> 19 CPU
    s for tests/runtime/test_trainer_compile.py's compiled-trainer test). The floats never change
    between steps, so the graphs and guards are otherwise the same."""
    import torch._dynamo

    model.compile(backend=backend, dynamic=True)
    compiled = getattr(model, "_compiled_call_impl", None)
    if compiled is None:
        raise RuntimeError("trainer.compile: nn.Module.compile left no _compiled_call_impl on the model "
                           f"(torch {torch.__version__}); compile_model needs updating for this torch")

    def call_with_constant_floats(*args, **kwargs):
        with torch._dynamo.config.patch(specialize_float=True):
            return compiled(*args, **kwargs)

    model._compiled_call_impl = call_with_constant_floats


def open_single_rank_group(backend: str) -> bool:
    """Open a one-rank default process group (a TCP store on a free local port) unless one is open;
    True when this call opened it (its caller destroys it)."""
    if dist.is_initialized():
        return False
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group(backend, store=store, rank=0, world_size=1)
    return True


def _grad_norm_of(params, fsdp: bool, dp_replicate: int = 1) -> float:
    return float(_grad_norm_tensor(params, fsdp, dp_replicate))


def _grad_norm_tensor(params, fsdp: bool, dp_replicate: int = 1, device=None) -> torch.Tensor:
    """The global gradient norm as a float64 0-d tensor on the gradients' device (no host read).
    FSDP2 shards every parameter (on two meshes: dense and experts, which DTensor cannot mix in
    one op), so the global norm is the square root of the all-reduced sum of local squares;
    every shard (an expert-parallel slice too) exists once per dp_replicate replica."""
    grads = [_local(p.grad) for p in params]
    sq = torch.zeros((), dtype=torch.float64, device=grads[0].device if grads else (device or "cpu"))
    for g in grads:
        sq += g.double().pow(2).sum()
    if fsdp:
        dist.all_reduce(sq, op=dist.ReduceOp.SUM)
        sq /= dp_replicate
    return sq.sqrt()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _dummy_like(mb):
    """A 2-token micro-batch with no loss token (keeps FSDP's collectives in step on a padding rank)."""
    from dataclasses import replace

    two = torch.zeros(2, dtype=mb.input_ids.dtype)
    topk = 0 if mb.teacher_topk_ids is None else mb.teacher_topk_ids.shape[1]
    replay = (None if mb.replay_ids is None
              else torch.arange(mb.replay_ids.shape[-1]).expand(2, *mb.replay_ids.shape[1:]))
    return replace(mb, input_ids=two, position_ids=torch.arange(2), cu_seqlens=torch.tensor([0, 2], dtype=torch.int32),
                   loss_mask=torch.zeros(2, dtype=torch.bool), advantages=torch.zeros(2),
                   inference_logprobs=torch.zeros(2), temperatures=None if mb.temperatures is None else torch.ones(2),
                   replay_ids=replay, loss_weights=None if mb.loss_weights is None else torch.zeros(2),
                   teacher_topk_ids=None if mb.teacher_topk_ids is None else mb.teacher_topk_ids.new_zeros(2, topk),
                   teacher_topk_logprobs=None if mb.teacher_topk_ids is None else torch.zeros(2, topk),
                   is_padding=True, num_real_tokens=0)


def run_trainer(cfg: RLConfig, vocab_size: int, *, orchestrator_alive: Callable[[], bool] | None = None,
                on_step: Callable[[dict], None] | None = None) -> Trainer:
    """The trainer process's main loop (rank 0 publishes weights, writes metrics and checkpoints)."""
    from pathlib import Path

    from ..metrics import MetricsLogger, progress_line

    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    out = Path(cfg.output_dir)
    transport = make_transport(cfg, out / "transport", "trainer")
    trainer = Trainer(cfg, vocab_size, rank=rank, world_size=world)
    log.info("trainer rank %d/%d started (%s) on %s, mesh %s, %s, reading batches rank_%d", rank, world,
             dist.get_backend() if dist.is_initialized() else "single process", trainer.device,
             trainer.dims.view_sizes(), "bf16 mixed precision" if trainer.mixed_precision else "no mixed precision",
             trainer.data_rank)
    ckpt_root = out / "checkpoints"
    if cfg.checkpoint.resume:
        found = latest_checkpoint(ckpt_root)
        if found is not None:
            trainer.load(found[1])
            log.info("resumed from %s (step %d)", found[1], trainer.step)
    start = trainer.step
    from ..inference.backend import get_backend

    logger = None
    if rank == 0:
        transport.drop_weights_after(start)
    channel = get_backend(cfg).weight_channel(cfg, model=trainer.model, transport=transport, rank=rank)
    channel.publish(start, WeightStream(trainer.model))  # collective: one full tensor at a time to rank 0
    if rank == 0:
        logger = MetricsLogger(out, start_step=start, tensorboard=cfg.log.tensorboard, wandb=cfg.log.wandb,
                               wandb_project=cfg.log.wandb_project)
    t_prev = time.perf_counter()
    restarts = int(os.environ.get(JOB_RESTARTS_ENV, "0"))  # the launcher's supervised restarts so far
    try:
        for step in range(start, cfg.max_steps):
            t0 = time.perf_counter()
            payload = transport.get_batch(step, trainer.data_rank, timeout=cfg.trainer.batch_timeout_s,
                                          alive=orchestrator_alive)
            t1 = time.perf_counter()
            m = trainer.train_step(payload)
            t2 = time.perf_counter()
            channel.publish(step + 1, WeightStream(trainer.model))
            if rank == 0:
                transport.drop_weights_before(step + 1 - cfg.orchestrator.max_async_level - 1)
                transport.drop_batches_before(step)
            if bool(cfg.checkpoint.interval) and (step + 1) % cfg.checkpoint.interval == 0 and step + 1 < cfg.max_steps:
                trainer.save_checkpoint(ckpt_root, step + 1, async_save=cfg.checkpoint.async_save)
            now = time.perf_counter()
            row = {"step": step, **payload["metrics"], **m, "job/restarts": restarts,
                   "tokens_per_s": m["tokens"] / max(now - t_prev, 1e-9),
                   "time/step_s": now - t_prev, "time/wait_s": t1 - t0, "time/train_s": t2 - t1,
                   **channel.metrics()}
            if getattr(channel, "last_bytes", None) is not None:  # bytes one update moved (LoRAChannel)
                row["weights/update_bytes"] = channel.last_bytes
            if trainer.device.type == "cuda":
                row["memory/trainer_peak_gb"] = torch.cuda.max_memory_allocated(trainer.device) / 2**30
            t_prev = now
            if rank == 0:
                logger.log(row)
                if cfg.log.progress:
                    print(progress_line(row, cfg.max_steps), flush=True)
            if on_step is not None:
                on_step(row)
            beat(f"step {step}")
        trainer.save_checkpoint(ckpt_root, cfg.max_steps)
        if cfg.checkpoint.export_hf:  # the policy (adapters merged) as a Hugging Face directory (collective)
            export_hf(trainer.model, out / "hf")
        if cfg.trainer.lora.rank:  # the final adapters in PEFT's format, naming their base (collective)
            from ..inference.weight_channels import write_lora_version

            write_lora_version(trainer.model, out / "lora", base_model_name_or_path=base_model_name(cfg))
    finally:
        if logger is not None:
            logger.close()
        channel.close()
        transport.close()  # ZeroMQ: its sockets, before the interpreter tears the context down
        trainer.close()
    return trainer
