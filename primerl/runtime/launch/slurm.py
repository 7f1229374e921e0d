"""``deployment.kind = "slurm"``: ``primerl rl`` renders an sbatch script from a Jinja2 template
(``templates/sbatch.sh.j2``, or ``deployment.sbatch_template``), writes it to
``<output_dir>/primerl.sbatch`` and submits it with ``sbatch`` (``--dry-run`` prints it).

The script runs one srun step per (node, role) of the plan: ``primerl node`` with the node's
index in the allocation (``--relative``), inference first, then the trainer nodes (torchrun
``--nnodes`` with c10d rendezvous on the first node), then the orchestrator. Each step logs to
``<output_dir>/logs/node<i>-<role>.log`` (appended across restarts). ``wait -n`` notices the
first step to fail; the others then get ``deployment.grace_s`` seconds to stop before they are
killed. Then the script restarts every step (``deployment.max_restarts``, auto resolved by
``effective_max_restarts``; issue 45) with ``--checkpoint.resume true`` and
``PRIMERL_JOB_RESTARTS`` = the round (the trainer's ``job/restarts``; the agents run one round
each: ``PRIMERL_NODE_SUPERVISED=launcher``), and past that budget it fails naming the step and
the failure line of every round. ``output_dir`` (the config, metrics, checkpoints) must be on a
path every node sees.

The preparation is every launcher's (``launcher.prepare_job``), on the submitting machine: the
``[warm_start]`` runs there before ``sbatch`` (a supervised warm start of the random init, minutes
on a CPU), into ``<output_dir>/warm_start``, and the written ``config.toml`` names it as
``model.path``: every node starts from it through the shared ``output_dir``.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

from ..config import ConfigError, RLConfig
from ..config.deployment import effective_max_restarts
from .common import JobFailed
from .deployment import DEFAULT_RDZV_PORT, Node, describe_nodes, node_plan, split_endpoint
from .launcher import LauncherCapabilities, PreparedJob, check_spans_nodes, register_launcher

__all__ = ["TEMPLATE", "SlurmLauncher", "render_sbatch"]

TEMPLATE = Path(__file__).with_name("templates") / "sbatch.sh.j2"


def render_sbatch(cfg: RLConfig, config_path: str, *, python: str = sys.executable) -> str:
    """The sbatch script of a ``kind = "slurm"`` config whose resolved TOML is at ``config_path``."""
    import jinja2

    d = cfg.deployment
    template = Path(d.sbatch_template) if d.sbatch_template else TEMPLATE
    if not template.is_file():
        raise ConfigError(f"deployment.sbatch_template: no such file, got {str(template)!r}")
    plan = node_plan(cfg)
    if d.rdzv_endpoint:
        split_endpoint(d.rdzv_endpoint)
        rdzv = shlex.quote(d.rdzv_endpoint)
    else:
        rdzv = f'"${{NODES[0]}}:{DEFAULT_RDZV_PORT}"'
    out = Path(cfg.output_dir).resolve()
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    try:
        tmpl = env.from_string(template.read_text())
    except jinja2.TemplateSyntaxError as e:
        raise ConfigError(f"deployment.sbatch_template: {template}:{e.lineno}: {e.message}") from None
    try:
        return _render(tmpl, template, d, plan, out, python, config_path, rdzv, cfg)
    except jinja2.TemplateError as e:  # e.g. a name the template uses that primerl does not pass
        raise ConfigError(f"deployment.sbatch_template: {template}: {type(e).__name__}: {e}") from None


def _render(tmpl, template, d, plan, out, python, config_path, rdzv, cfg) -> str:
    return tmpl.render(
        template=str(template), job_name=f"primerl-{out.name}", num_nodes=len(plan.nodes),
        gpus_per_node=d.gpus_per_node, sbatch_args=list(d.sbatch_args), grace_s=f"{d.grace_s:g}",
        max_restarts=effective_max_restarts(cfg), log_dir=shlex.quote(str(out / "logs")), python=shlex.quote(python),
        config=shlex.quote(config_path),
        rdzv=rdzv, trainer_nodes=[n.index for n in plan.trainer_nodes],
        inference_nodes=[n.index for n in plan.with_role("inference")],
        orchestrator_node=plan.with_role("orchestrator")[0].index, plan=plan, cfg=cfg,
        trainer_commands=_trainer_commands(plan, rdzv, python), inference_commands=_inference_commands(cfg, plan))


def _inference_commands(cfg: RLConfig, plan) -> list[str]:
    """Which server `primerl node --role inference` runs on each inference node (a comment in the script)."""
    from .deployment import inference_server

    return [f"node {n.index} (inference) runs: " + inference_server(cfg, f"${{NODES[{n.index}]}}")
            for n in plan.with_role("inference")]


def _trainer_commands(plan, rdzv: str, python: str) -> list[str]:
    """What `primerl node --role trainer` runs on each trainer node (a comment in the script)."""
    from .node import trainer_command

    lines = []
    for n in plan.trainer_nodes:
        node = Node(n.index, f"${{NODES[{n.index}]}}", n.roles, n.trainer_node, n.ranks, n.gpus)
        cmd = trainer_command(plan, node, ["-m", "primerl.runtime.cli", "trainer", "--config", "CONFIG"], python=python,
                              run_id="$SLURM_JOB_ID")
        cmd = [c.replace(plan.rdzv_endpoint, rdzv.strip('"')) for c in cmd]
        lines.append(f"node {n.index} (trainer) runs: " + " ".join(cmd))
    return lines


class SlurmLauncher:
    """Render the sbatch script into ``output_dir`` and submit it; the job runs later, under SLURM."""

    name = "slurm"
    capabilities = LauncherCapabilities(spans_nodes=True, server_pool=False, job_restarts=True)

    def check(self, cfg: RLConfig) -> None:
        check_spans_nodes(cfg)
        if cfg.deployment.hosts:
            raise ConfigError("deployment.hosts: comes from SLURM_JOB_NODELIST under kind = 'slurm'; leave it empty, "
                              f"got {cfg.deployment.hosts!r}")
        # deployment.sbatch_template exists, parses and renders (before --dry-run prints the plan or
        # anything is written)
        render_sbatch(cfg, str(Path(cfg.output_dir).resolve() / "config.toml"))

    def describe(self, cfg: RLConfig) -> str:
        script = render_sbatch(cfg, str(Path(cfg.output_dir).resolve() / "config.toml"))
        return (describe_nodes(cfg) + "# sbatch script (written to output_dir/primerl.sbatch and submitted by "
                "`primerl rl`):\n" + script)

    def start(self, job: PreparedJob) -> None:
        """Write ``<output_dir>/primerl.sbatch`` and ``sbatch`` it."""
        script = job.output_dir / "primerl.sbatch"
        script.write_text(render_sbatch(job.cfg, str(job.config_path)))
        try:
            res = subprocess.run(["sbatch", str(script)], capture_output=True, text=True)
        except FileNotFoundError:
            raise JobFailed(f"sbatch is not on PATH; the script is at {script}") from None
        if res.returncode != 0:
            raise JobFailed(f"sbatch {script} failed (exit {res.returncode}): {res.stderr.strip()}")
        job.state["submitted"] = res.stdout.strip()
        if not job.quiet:
            print(f"primerl rl: {res.stdout.strip()} ({script}; logs in {job.output_dir / 'logs'})", flush=True)

    def wait(self, job: PreparedJob) -> list[dict]:
        """Nothing to wait for here: the job runs under SLURM (sbatch's answer is ``job.state["submitted"]``)."""
        return []

    def stop(self, job: PreparedJob) -> None:
        """Nothing of the submitted job runs on this machine."""


register_launcher("slurm", SlurmLauncher())
