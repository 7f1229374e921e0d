"""``[warm_start] rl_steps``: the job trains its own base by RL before the run it was asked for.

Before the job's processes start, ``job_rl_warm_start`` runs the same config as a job of its own
(the same launcher): ``rl_steps`` steps, full fine-tuning (``trainer.lora`` off, ``trainer.lr`` =
``warm_start.lr``), ``env.args``
updated by ``warm_start.rl_env_args`` (a related task), in ``<output_dir>/warm_start_rl``, which
writes its final policy in Hugging Face's layout (``checkpoint.export_hf``). That directory becomes
``model.path`` of the resolved config: a LoRA run (``examples/reverse_text_lora.toml``) then adapts
a base the job trained itself. When resuming with the same warm-start settings, the base the
earlier run wrote is reused.
"""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import asdict
from pathlib import Path

log = logging.getLogger("primerl.launch")

RL_WARM_START_DIR = "warm_start_rl"


def warm_start_config(cfg):
    """The config of the RL warm start's own job (see the module docstring)."""
    sub = copy.deepcopy(cfg)
    w = cfg.warm_start
    sub.output_dir = str(Path(cfg.output_dir) / RL_WARM_START_DIR)
    sub.max_steps = w.rl_steps
    sub.overwrite, sub.checkpoint.resume, sub.checkpoint.interval = True, False, 0
    sub.checkpoint.export_hf = True
    sub.trainer.lora.rank = 0
    sub.trainer.lr = w.lr  # warm_start.lr: the full fine-tuning's (a LoRA run's trainer.lr is usually higher)
    sub.env.args = {**cfg.env.args, **w.rl_env_args}
    sub.warm_start.rl_steps, sub.warm_start.rl_env_args = 0, {}
    return sub


def job_rl_warm_start(cfg, run_job, *, quiet: bool = True):
    """``cfg`` itself without ``warm_start.rl_steps``; else a copy whose ``model.path`` is the base
    the RL warm start trained (now, by ``run_job(config, quiet=...)``, the launcher's, or by an
    earlier run of the same settings when resuming)."""
    w = cfg.warm_start
    if not w.rl_steps:
        return cfg

    sub = warm_start_config(cfg)
    out = Path(sub.output_dir) / "hf"
    stamp = json.loads(json.dumps({"model": asdict(cfg.model), "warm_start": asdict(w), "env": asdict(cfg.env),
                                   "seed": cfg.seed}, default=str))
    record = Path(sub.output_dir).parent / "warm_start_rl.json"
    reuse = cfg.checkpoint.resume and record.exists() and (out / "config.json").exists() \
        and json.loads(record.read_text()).get("config") == stamp
    if not reuse:
        if not quiet:
            print(f"primerl rl: RL warm start, {w.rl_steps} steps of full fine-tuning with env.args "
                  f"{sub.env.args} -> {out}", flush=True)
        rows = run_job(sub, quiet=quiet)
        last = rows[-20:] if rows else []
        mean = sum(r.get("reward/mean", 0.0) for r in last) / max(len(last), 1)
        record.write_text(json.dumps({"config": stamp, "steps": len(rows), "last_20_reward_mean": mean}, indent=1))
        log.info("RL warm start: %d steps, last-20 mean reward %.3f; base at %s", len(rows), mean, out)
        if not quiet:
            print(f"primerl rl: RL warm start done ({len(rows)} steps, last-20 mean reward {mean:.3f}); "
                  f"the run starts from {out}", flush=True)
    resolved = copy.deepcopy(cfg)
    resolved.model.path = str(out)
    resolved.warm_start.rl_steps, resolved.warm_start.rl_env_args = 0, {}
    return resolved
