"""``[trainer]``: the optimizer, schedule, precision and step guards (``TrainerConfig``), the loss
(``[trainer.loss]``, ``LossConfig``) and the section's own checks. The trainer's layout
(``[trainer.parallel]``) is ``parallel.py``."""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import ConfigError, _need
from .parallel import ParallelConfig


@dataclass
class LossConfig:
    """``primerl.rl.losses.policy_loss`` as the trainer runs it; the default is prime-rl's
    (DPPO-TV, delta 0.2/0.2, KL 1e-3, zero-advantage tokens out of the loss)."""

    method: str = "dppo_tv"  # a name in primerl.rl.losses.LOSS_METHODS, or "package.module:function"
    aggregation: str = "token_mean"
    corrections: list = field(default_factory=list)
    hparams: dict = field(default_factory=dict)  # e.g. {delta_low = 0.2, delta_high = 0.2, kl_coef = 1e-3}
    drop_zero_advantage: bool = True  # tokens with advantage 0 leave the loss and its denominator
    ref_kl_coef: float = 0.0  # > 0: KL-to-reference term against a frozen copy of the initial policy
    sft_coef: float = 0.0  # > 0: cross-entropy on the loss tokens, normalised on its own tokens


@dataclass
class LoRAConfig:
    """``[trainer.lora]``: train LoRA adapters only (``primerl.models.apply_lora``), the base frozen;
    each weight update sends the adapters alone (docs/lora.md)."""

    rank: int = 0  # 0: no LoRA (full fine-tuning); >= 1: the adapters' rank
    alpha: float = 16.0  # the adapters' scale is alpha / rank
    # names of primerl.models.lora.TARGETS (attention projections, "attention", "mlp", "shared_experts",
    # "experts"); empty: every one of them the model has
    targets: list = field(default_factory=list)
    # how the embedded engine applies each version: "merge" (into the weights on receipt) or
    # "forward" (the low-rank path in every forward); bench/RESULTS.md (Issue 43) measures both
    engine: str = "merge"


# primerl.models.lora.TARGETS (config imports no models; tests/runtime/test_lora_job.py checks they agree)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
                "attention", "mlp", "shared_experts", "experts")


@dataclass
class TrainerConfig:
    lr: float = 3e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8  # AdamW's epsilon
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    lr_schedule: str = "constant"  # "constant", "linear" or "cosine" (after warmup)
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    router_replay: bool = True
    # "auto" (bf16 on CUDA with model.dtype = float32, else off), "bf16" (bf16 compute, float32 master
    # weights and optimizer state, gradients reduced in float32: FSDP2 MixedPrecisionPolicy) or "off"
    mixed_precision: str = "auto"
    mini_batches: int = 1  # optimizer steps per rollout batch (each on a slice of its micro-batches)
    fsdp: bool = True  # with several ranks: FSDP2 from primerl.parallel (False: replicated weights + all-reduce)
    attention: str = "auto"  # "kernel" (the model's varlen kernel), "padded" (dense SDPA) or "auto" (padded on CPU)
    entropy_coef: float = 0.0  # minus this times the token-mean entropy is added to the loss
    entropy_decay_steps: int = 0  # > 0: the coefficient falls linearly to 0 at this step
    loss: LossConfig = field(default_factory=LossConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    batch_timeout_s: float = 300.0
    nan_retries: int = 2  # a step with a non-finite loss is skipped (counted) this many times in a row
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    # Run the model's forward (and so its backward) under torch.compile(dynamic=True): one graph
    # serves every packing. Off by default until measured on a GPU (bench/RESULTS.md: CPU step time).
    compile: bool = False


def check_trainer(t: TrainerConfig) -> None:
    """``[trainer]`` and ``[trainer.loss]`` on their own (``[trainer.parallel]``: ``parallel.validate_parallel``)."""
    _need(t.lr > 0, "trainer.lr", "must be > 0", t.lr)
    _need(t.eps > 0, "trainer.eps", "must be > 0", t.eps)
    _need(t.max_grad_norm >= 0, "trainer.max_grad_norm", "must be >= 0 (0 disables clipping)", t.max_grad_norm)
    _need(t.lr_schedule in ("constant", "linear", "cosine"), "trainer.lr_schedule",
          "must be constant, linear or cosine", t.lr_schedule)
    _need(t.warmup_steps >= 0, "trainer.warmup_steps", "must be >= 0", t.warmup_steps)
    _need(0 <= t.min_lr_ratio <= 1, "trainer.min_lr_ratio", "must be in [0, 1]", t.min_lr_ratio)
    _need(t.batch_timeout_s > 0, "trainer.batch_timeout_s", "must be > 0", t.batch_timeout_s)
    _need(t.attention in ("auto", "kernel", "padded"), "trainer.attention", "must be auto, kernel or padded",
          t.attention)
    _need(t.entropy_coef >= 0, "trainer.entropy_coef", "must be >= 0", t.entropy_coef)
    _need(t.entropy_decay_steps >= 0, "trainer.entropy_decay_steps", "must be >= 0", t.entropy_decay_steps)
    _need(t.mini_batches >= 1, "trainer.mini_batches", "must be >= 1", t.mini_batches)
    _need(t.nan_retries >= 0, "trainer.nan_retries", "must be >= 0", t.nan_retries)
    _need(t.mixed_precision in ("auto", "bf16", "off"), "trainer.mixed_precision", "must be auto, bf16 or off",
          t.mixed_precision)
    _check_loss(t.loss)
    check_lora(t.lora)


def check_lora(lora: LoRAConfig) -> None:
    """``[trainer.lora]`` on its own (its targets against the model: ``validate.check_lora_model``)."""
    _need(isinstance(lora.rank, int) and lora.rank >= 0, "trainer.lora.rank",
          "must be an integer >= 1 (0: no LoRA)", lora.rank)
    _need(lora.alpha > 0, "trainer.lora.alpha", "must be > 0", lora.alpha)
    _need(lora.engine in ("merge", "forward"), "trainer.lora.engine", "must be merge or forward", lora.engine)
    _need(isinstance(lora.targets, list), "trainer.lora.targets", "must be a list of target names", lora.targets)
    for t in lora.targets:
        _need(t in LORA_TARGETS, "trainer.lora.targets",
              f"unknown target {t!r}; choose among {', '.join(LORA_TARGETS)}", lora.targets)


def _check_loss(loss: LossConfig) -> None:
    for key in ("ref_kl_coef", "sft_coef"):
        val = getattr(loss, key)
        _need(isinstance(val, (int, float)) and 0 <= val < float("inf"), f"trainer.loss.{key}",
              "must be a finite number >= 0", val)
    _need("tis" not in loss.corrections, "trainer.loss.corrections",
          "'tis' needs the trainer's pre-update log-probs (old_logprobs), which the job does not compute (the "
          "method's own ratio pi_theta/pi_inference already is the importance weight): bound it with 'mis' or "
          "'icepop' instead", loss.corrections)
    if loss.aggregation == "token_sum_norm":
        c = loss.hparams.get("norm_constant")
        _need(isinstance(c, (int, float)) and not isinstance(c, bool) and 0 < c < float("inf"),
              "trainer.loss.hparams.norm_constant", "aggregation 'token_sum_norm' divides the token sum by it: set a "
              "number > 0 (e.g. --trainer.loss.hparams.norm_constant 4096)", c)


def check_loss_names(loss: LossConfig) -> None:
    """Method, corrections, aggregation and hyperparameters against ``primerl.rl.losses``' lists
    (a ``package.module:function`` method is imported now, so ``--dry-run`` fails)."""
    from primerl.rl import loss_spec as losses

    try:
        losses.resolve_method(loss.method)  # a built-in name, or imports 'package.module:function'
    except ValueError as e:
        raise ConfigError(f"trainer.loss.method: {e}") from None
    bad = [c for c in loss.corrections if c not in losses.CORRECTIONS]
    _need(not bad, "trainer.loss.corrections", f"has unknown entries {bad}; choose from {losses.CORRECTIONS}",
          loss.corrections)
    _need(loss.aggregation in losses.AGGREGATIONS, "trainer.loss.aggregation",
          f"must be one of {losses.AGGREGATIONS}", loss.aggregation)
    terms = tuple(n for n, on in (("ref_kl", loss.ref_kl_coef > 0), ("sft", loss.sft_coef > 0)) if on)
    try:  # hyperparameter names and values against the method, corrections and terms in use
        losses.check_loss_spec(loss.method, loss.corrections, loss.aggregation,
                               {k: v for k, v in loss.hparams.items() if k != "norm_constant"}, terms)
    except ValueError as e:
        raise ConfigError(f"trainer.loss.hparams: {e}") from None
