"""metrics.jsonl is strict JSON: non-finite values are written as null."""

import json

from primerl.runtime.metrics import MetricsLogger, read_metrics


def _strict(line: str):
    def refuse(name):
        raise ValueError(f"non-JSON constant {name}")

    return json.loads(line, parse_constant=refuse)


def test_nan_and_inf_are_written_as_null(tmp_path):
    log = MetricsLogger(tmp_path)
    base = {"reward/mean": 0.5, "mismatch_kl/mean": 1e-3, "off_policy/max": 0, "tokens_per_s": 10.0}
    log.log({"step": 0, **base, "grad_norm": float("nan"), "loss": float("inf"), "x": [1.0, float("-inf")],
             "nested": {"a": float("nan"), "b": 2}})
    log.log({"step": 1, **base, "grad_norm": 0.5})
    log.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    rows = [_strict(line) for line in lines]
    assert rows[0]["grad_norm"] is None and rows[0]["loss"] is None and rows[0]["x"] == [1.0, None]
    assert rows[0]["nested"] == {"a": None, "b": 2} and rows[1]["grad_norm"] == 0.5
    # a resumed logger rewrites the kept lines, still strictly
    MetricsLogger(tmp_path, start_step=1).close()
    assert [_strict(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [0]
    assert read_metrics(tmp_path / "metrics.jsonl")[0]["grad_norm"] is None
