"""What used to be refused only after ``primerl rl`` had written config.toml, logs/ and transport/
(or after ``--dry-run`` had printed the plan) is refused at validation: one line naming the key,
exit 2, nothing written, with and without ``--dry-run``: a missing or broken
``deployment.sbatch_template``, an ``inference.vllm.python`` that is not there, an
``orchestrator.metrics_port`` without prometheus-client."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from primerl.runtime import cli

ROOT = Path(__file__).resolve().parents[2]
TWO_NODE = str(ROOT / "examples" / "reverse_text_2node.toml")
SLURM = ["--deployment.kind", "slurm", "--deployment.hosts", "[]"]


def _refused(capsys, tmp_path, config, over, message):
    out = tmp_path / "run"
    for dry in (True, False):
        capsys.readouterr()
        rc = cli.main(["rl", "--config", config, "--output_dir", str(out), *(["--dry-run"] if dry else []), *over])
        cap = capsys.readouterr()
        err = cap.err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and message in err[0], (dry, err)
        assert "# sbatch script" not in cap.out and "# deployment" not in cap.out  # refused before the plan
        assert not out.exists()


def test_a_missing_sbatch_template_is_refused_before_anything(capsys, tmp_path):
    _refused(capsys, tmp_path, TWO_NODE, [*SLURM, "--deployment.sbatch_template", str(tmp_path / "none.j2")],
             "deployment.sbatch_template: no such file")


@pytest.mark.parametrize("text, message", [("{% if %}", "deployment.sbatch_template:"),
                                           ("{{ no_such_name }}", "'no_such_name' is undefined")])
def test_a_template_that_does_not_render_is_refused_before_anything(capsys, tmp_path, text, message):
    t = tmp_path / "bad.j2"
    t.write_text(text)
    _refused(capsys, tmp_path, TWO_NODE, [*SLURM, "--deployment.sbatch_template", str(t)], message)


def test_a_missing_vllm_python_is_refused_before_anything(capsys, tmp_path):
    _refused(capsys, tmp_path, str(ROOT / "examples" / "reverse_text_vllm.toml"),
             ["--inference.vllm.python", str(tmp_path / "no-venv" / "bin" / "python")],
             "inference.vllm.python: is not an executable file")


def test_metrics_port_without_prometheus_client_is_refused_before_anything(capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # find_spec: not installed
    _refused(capsys, tmp_path, str(ROOT / "examples" / "reverse_text.toml"), ["--orchestrator.metrics_port", "9"],
             "orchestrator.metrics_port: GET /metrics needs the prometheus-client package")
