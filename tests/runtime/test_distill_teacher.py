"""[distill]: the teacher from a primerl run or checkpoint, its scoring in-process and through
`primerl inference --role teacher` (the same per-token log-probs), the scoring route's 400s, the
dry-run refusals naming the key, and the orchestrator's per-token advantages with a teacher."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from primerl.rl.envs import ReverseText
from primerl.runtime.config import load_config as load_raw, to_toml
from primerl.runtime.inference.teacher import load_teacher, resolve_teacher, score_logprobs
from primerl.runtime.inference.teacher_clients import InProcessTeacher, ServerTeacher
from primerl.runtime.validate import load_config

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--model.dim", "32", "--model.n_layers", "1", "--model.n_heads", "2", "--model.n_kv_heads", "1",
        "--model.head_dim", "16", "--model.moe_dim", "16", "--model.num_experts", "2", "--model.top_k", "1",
        "--env.args", '{"num_symbols": 4, "min_length": 3, "max_length": 3}']


def make_teacher_run(root: Path, *, seed: int = 7, extra=()) -> Path:
    """A primerl run directory as `primerl rl` leaves it: config.toml + a DCP checkpoint."""
    from primerl.runtime.policy import build_model
    from primerl.runtime.trainer.dcp_checkpoint import save_dcp_checkpoint

    run = root / f"teacher{seed}"
    cfg = load_raw(None, ["--output_dir", str(run), "--seed", str(seed), *TINY, *extra], check=False)
    run.mkdir(parents=True)
    (run / "config.toml").write_text(to_toml(cfg))
    model = build_model(cfg, ReverseText(**cfg.env.args).vocab_size)
    with torch.no_grad():  # weights unlike any seeded init
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    opt = torch.optim.AdamW(model.parameters())
    save_dcp_checkpoint(run / "checkpoints", 5, model, opt, {})
    return run


@pytest.fixture(scope="module")
def teacher_run(tmp_path_factory):
    return make_teacher_run(tmp_path_factory.mktemp("distill"))


def _student_cfg(tmp_path, teacher, *over):
    return load_config(None, ["--output_dir", str(tmp_path / "student"), *TINY, "--distill.teacher", str(teacher),
                              *over])


def _seqs():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 7, (n,), generator=g).tolist() for n in (5, 9, 2, 7)]


def test_teacher_loads_from_a_run_and_a_checkpoint(teacher_run):
    from primerl.runtime.trainer.dcp_checkpoint import load_dcp_checkpoint

    src = resolve_teacher(str(teacher_run))
    assert src.kind == "primerl" and src.checkpoint.name == "step_000005"
    model = load_teacher(src)
    ref = load_teacher(resolve_teacher(str(teacher_run / "checkpoints" / "step_000005")))
    from primerl.runtime.policy import build_model

    fresh = build_model(src.run_config, 7)
    load_dcp_checkpoint(src.checkpoint, fresh, torch.optim.AdamW(fresh.parameters()))
    for (k, a), b, c in zip(model.state_dict().items(), ref.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b) and torch.equal(a, c), k
    seeded = build_model(src.run_config, 7)  # the checkpoint's weights, not the run's seeded init
    assert not torch.equal(seeded.embed.weight, model.embed.weight)


def test_score_logprobs_is_the_per_sequence_log_softmax(teacher_run):
    model = load_teacher(resolve_teacher(str(teacher_run)))
    seqs = _seqs()
    got = score_logprobs(model, seqs, temperature=0.7, max_tokens=10)  # several forwards
    for s, lp in zip(seqs, got):
        ids = torch.tensor(s)
        logits = model(ids, torch.arange(len(s)), torch.tensor([0, len(s)], dtype=torch.int32), return_logits=True)
        want = torch.log_softmax(logits.float() / 0.7, -1)[torch.arange(len(s) - 1), ids[1:]]
        assert lp[0] == 0.0 and len(lp) == len(s)
        torch.testing.assert_close(torch.tensor(lp[1:]), want, rtol=1e-5, atol=1e-5)


def _post(url, body):
    req = urllib.request.Request(url + "/v1/score", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_primerl_inference_teacher_server_matches_the_in_process_teacher(tmp_path, teacher_run):
    """`primerl inference --role teacher` serves distill.teacher: the same per-token log-probs as the
    embedded teacher; bad input is answered 400 naming the field."""
    cfg = _student_cfg(tmp_path, teacher_run)
    (tmp_path / "c.toml").write_text(to_toml(cfg))
    proc = subprocess.Popen([sys.executable, "-m", "primerl.runtime.cli", "inference", "--config",
                             str(tmp_path / "c.toml"), "--role", "teacher", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        url = None
        for line in proc.stdout:
            if "serving on" in line:
                url = line.split("serving on ")[1].split()[0]
                break
        assert url, "the teacher server did not start"
        seqs = _seqs()
        teacher = load_teacher(resolve_teacher(str(teacher_run)))
        embedded = InProcessTeacher(teacher).score(seqs)
        served = ServerTeacher(url).score(seqs)
        assert [len(x) for x in served] == [len(s) for s in seqs]
        torch.testing.assert_close(torch.tensor(sum(served, [])), torch.tensor(sum(embedded, [])),
                                   rtol=1e-5, atol=1e-5)
        status, body = _post(url, {"sequences": [[1, 2, 3]]})
        assert status == 200 and body["logprobs"][0][0] is None and len(body["logprobs"][0]) == 3
        # distill.topk: the same k most likely tokens and log-probs from both (ties aside: fresh random weights)
        emb_top, served_top = InProcessTeacher(teacher).score_topk(seqs, 3), ServerTeacher(url).score_topk(seqs, 3)
        for (lp_e, ids_e, top_e), (lp_s, ids_s, top_s), sq in zip(emb_top, served_top, seqs):
            assert ids_s == ids_e and len(ids_s) == len(sq) and all(len(r) == 3 for r in ids_s)
            torch.testing.assert_close(torch.tensor(top_s), torch.tensor(top_e), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(torch.tensor(lp_s), torch.tensor(lp_e), rtol=1e-5, atol=1e-5)
            full = torch.tensor(top_e)[1:]
            assert (full[:, :-1] >= full[:, 1:]).all() and (torch.tensor(lp_e)[1:] <= full[:, 0] + 1e-6).all()
        for bad, field in [({"sequences": []}, "sequences"), ({"sequences": [[1, 99]]}, "sequences[0]"),
                           ({"sequences": [[1], "x"]}, "sequences[1]"), ({"sequences": [[1, 2]], "temperature": 0},
                                                                        "temperature"),
                           ({"sequences": [[1, 2]], "top_k": -1}, "top_k"), ({"sequences": [[1, 2]], "top_k": "3"},
                                                                              "top_k"),
                           ({"sequences": [[1, 2]], "top_k": 10_000}, "top_k"), ({"sequences": [[1, 2]], "k": 3}, "k"),
                           ({"token_ids": [1]}, "sequences")]:
            status, body = _post(url, bad)
            assert status == 400 and field in body["error"], (bad, body)
        assert _post(url, {"sequences": [[1, 2, 3]]})[0] == 200  # still serving
    finally:
        proc.terminate()
        proc.wait(10)


def _dry_run(tmp_path, *over) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "primerl.runtime.cli", "rl", "--dry-run", "--output_dir",
                           str(tmp_path / "s"), *TINY, *over], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_dry_run_refuses_a_teacher_with_another_vocabulary(tmp_path, teacher_run):
    other = make_teacher_run(tmp_path, seed=3, extra=["--env.args", '{"num_symbols": 6, "min_length": 3, '
                                                      '"max_length": 3}'])
    r = _dry_run(tmp_path, "--distill.teacher", str(other))
    assert r.returncode == 2 and "distill.teacher" in r.stderr and "vocabulary" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    ok = _dry_run(tmp_path, "--distill.teacher", str(teacher_run), "--distill.only", "true")
    assert ok.returncode == 0, ok.stderr
    no_teacher = _dry_run(tmp_path, "--distill.topk", "4")
    assert no_teacher.returncode == 2 and "config error: distill.topk:" in no_teacher.stderr, no_teacher.stderr
    assert 'teacher = "' in ok.stdout


@pytest.mark.parametrize("over,key", [
    (["--distill.teacher", "/nonexistent/teacher"], "distill.teacher"),
    (["--distill.teachers", '{"other-env": "/x"}'], "distill.teachers.other-env"),
    (["--distill.only", "true"], "distill.only"),
    (["--distill.coef", "0"], "distill.coef"),
    (["--distill.normalize", "batch"], "distill.normalize"),
    (["--distill.backend", "nope"], "distill.backend"),
    (["--distill.topk", "-1"], "distill.topk"),
    (["--distill.topk", "100000"], "distill.topk"),
    (["--distill.topk", "2", "--distill.topk_coef", "0"], "distill.topk_coef"),
])
def test_config_checks_name_the_key(tmp_path, teacher_run, over, key):
    from primerl.runtime.config import ConfigError

    base = [] if over[0] in ("--distill.teacher", "--distill.teachers", "--distill.only") else \
        ["--distill.teacher", str(teacher_run)]
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, ["--output_dir", str(tmp_path / "s"), *TINY, *base, *over])


def test_vocabulary_check_of_a_hugging_face_teacher(tmp_path):
    from primerl.runtime.config import ConfigError
    from primerl.models import MoETransformer, MoETransformerConfig

    MoETransformer(MoETransformerConfig.tiny(vocab_size=32)).save_pretrained(tmp_path / "hf32")
    with pytest.raises(ConfigError, match=r"distill\.teacher: the teacher's vocabulary \(32"):
        load_config(None, ["--output_dir", str(tmp_path / "s"), *TINY, "--distill.teacher", str(tmp_path / "hf32")])
    MoETransformer(MoETransformerConfig.tiny(vocab_size=7)).save_pretrained(tmp_path / "hf7")
    cfg = load_config(None, ["--output_dir", str(tmp_path / "s"), *TINY, "--distill.teacher", str(tmp_path / "hf7")])
    assert resolve_teacher(cfg.distill.teacher).kind == "hf"


class TableTeacher:
    """log pi_T(token t) = -scale * token id (a teacher whose numbers the test can predict); it
    records the sequences it scored."""

    def __init__(self, scale: float = 0.1):
        self.scale, self.calls, self.seqs = scale, 0, []

    def score(self, seqs):
        self.calls += 1
        self.seqs += [list(s) for s in seqs]
        return [[0.0] + [-self.scale * t for t in s[1:]] for s in seqs]

    def score_topk(self, seqs, k):
        """Top-k rows the test can predict too: at token t, ids t, t + 1, ... and log-probs -scale * id."""
        rows = [[[t + j for j in range(k)] for t in s[1:]] for s in seqs]
        return [(lp, [[0] * k] + r, [[0.0] * k] + [[-self.scale * i for i in ids] for ids in r])
                for lp, r in zip(self.score(seqs), rows)]


@pytest.mark.parametrize("only", [True, False])
def test_orchestrator_hands_over_per_token_distill_advantages(tmp_path, teacher_run, only):
    from test_orchestrator import FakeClient, fake_trainer

    from primerl.runtime.orchestrator import Orchestrator
    from primerl.runtime.transport import FileTransport

    cfg = load_config(None, ["--output_dir", str(tmp_path), "--orchestrator.batch_size", "3",
                             "--orchestrator.group_size", "4", "--orchestrator.seq_len", "64", "--max_steps", "3",
                             "--env.args", '{"num_symbols": 4}', "--distill.teacher", str(teacher_run),
                             "--distill.only", str(only).lower(), "--distill.coef", "0.5",
                             *(["--distill.topk", "2"] if only else []),
                             "--orchestrator.max_async_level", "1"], check=False)
    tr = FileTransport(cfg.output_dir)
    seen = []
    th = threading.Thread(target=fake_trainer, args=(tr, 3, seen), daemon=True)
    th.start()
    teacher = TableTeacher()
    Orchestrator(cfg, ReverseText(num_symbols=4), FakeClient(), tr, teachers={str(teacher_run): teacher}).run()
    th.join(10)
    assert [s for s, _ in seen] == [0, 1, 2] and teacher.calls >= 1
    for s, m in seen:
        assert {"distill/reverse_kl", "distill/score_s", "distill/wait_s", "distill/behind_seqs"} <= set(m)
    mbs = FileTransport(cfg.output_dir).get_batch(2, 0, timeout=5)["micro_batches"]
    num = den = 0.0
    reward_part = []
    for mb in mbs:
        cu = mb.cu_seqlens.tolist()
        lt = torch.cat([torch.tensor([0.0] + [-0.1 * t for t in mb.input_ids[a + 1:b].tolist()])
                        for a, b in zip(cu[:-1], cu[1:])])
        ls = mb.inference_logprobs
        distill = torch.where(mb.loss_mask, 0.5 * (lt - ls), 0.0)
        if only:
            torch.testing.assert_close(mb.advantages, distill)
            # distill.topk 2: each loss token's row is the teacher's for that very token
            m = mb.loss_mask
            want = torch.stack([mb.input_ids[m], mb.input_ids[m] + 1], 1)
            assert torch.equal(mb.teacher_topk_ids[m], want)
            torch.testing.assert_close(mb.teacher_topk_logprobs[m], -0.1 * want.float())
        else:  # what is left after removing A_distill is the reward advantage: constant over a sequence
            rest = mb.advantages - distill
            for a, b in zip(cu[:-1], cu[1:]):
                assert torch.allclose(rest[a:b], rest[a:b][0].expand(b - a))
            reward_part.append(rest)
        num += float(torch.where(mb.loss_mask, ls - lt, 0.0).sum())
        den += float(mb.loss_mask.sum())
    assert seen[2][1]["distill/reverse_kl"] == pytest.approx(num / den, rel=1e-5)
    assert only or torch.cat(reward_part).abs().sum() > 0  # mixed: the reward advantage is in


def test_primerl_rl_with_a_teacher_logs_distill_metrics(tmp_path, teacher_run):
    """`primerl rl` with [distill] and the teacher's top-2 (distill.topk): the in-process teacher
    scores every batch, the trainer trains on the per-token advantages and the top-k term, and every
    step logs distill/reverse_kl, the top-k KL and the scoring times."""
    from primerl.runtime.metrics import read_metrics

    steps = 3
    r = subprocess.run([sys.executable, "-m", "primerl.runtime.cli", "rl", "--output_dir", str(tmp_path / "job"),
                        *TINY, "--max_steps", str(steps), "--orchestrator.batch_size", "4",
                        "--orchestrator.group_size", "4", "--checkpoint.interval", "0", "--log.plot", "false",
                        "--distill.teacher", str(teacher_run), "--distill.only", "true", "--distill.topk", "2"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-3000:]
    rows = read_metrics(tmp_path / "job" / "metrics.jsonl")
    assert [x["step"] for x in rows] == list(range(steps))
    for x in rows:
        assert x["distill/reverse_kl"] != 0 and x["distill/score_s"] > 0 and x["distill/wait_s"] >= 0
        assert x["loss/distill_topk_kl"] > 0
        assert math.isfinite(x["loss"])


def test_vllm_teacher_reads_prompt_logprobs_from_a_vllm_style_server():
    """VLLMTeacher against a stand-in answering as vLLM does (prompt_logprobs: null, then one
    {token id: {logprob}} per prompt token); what it sends, what it reads, a malformed answer."""
    import http.server

    from primerl.runtime.inference.teacher_clients import TeacherError, VLLMTeacher

    bodies = []

    class H(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            bodies.append(body)
            p = body["prompt"]
            k = body["prompt_logprobs"]  # top-k (rank 1..k) and the prompt's own token (its rank), as vLLM
            pl = None if p == [9, 9] else [None] + [
                {**{str(100 + j): {"logprob": -0.1 * (j + 1), "rank": j + 1} for j in range(k)},
                 str(t): {"logprob": -0.5 * t, "rank": k + 1 if k else 1}} for t in p[1:]]
            out = json.dumps({"choices": [{"prompt_logprobs": pl, "text": ""}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        t = VLLMTeacher(f"http://127.0.0.1:{srv.server_port}", "teacher-model", temperature=1.0)
        assert t.score([[1, 2, 3], [4, 5]]) == [[0.0, -1.0, -1.5], [0.0, -2.5]]
        assert bodies[0] == {"model": "teacher-model", "prompt": [1, 2, 3], "max_tokens": 1, "prompt_logprobs": 0,
                             "temperature": 1.0}
        with pytest.raises(TeacherError, match="prompt_logprobs"):
            t.score([[9, 9]])
        lp, ids, tops = t.score_topk([[1, 2, 3]], 3)[0]  # distill.topk: prompt_logprobs = k
        assert bodies[-1]["prompt_logprobs"] == 3 and lp == [0.0, -1.0, -1.5]
        assert ids == [[0, 0, 0], [100, 101, 102], [100, 101, 102]]
        assert tops[1:] == [[-0.1, -0.2, pytest.approx(-0.3)]] * 2
        with pytest.raises(TeacherError, match="prompt_logprobs"):
            t.score_topk([[9, 9]], 3)
    finally:
        srv.shutdown()
    with pytest.raises(TeacherError, match="teacher at http://127.0.0.1:9"):
        ServerTeacher("http://127.0.0.1:9", timeout_s=2).score([[1, 2]])


class SlowTeacher(TableTeacher):
    def __init__(self, delay=0.0, fail=False):
        super().__init__()
        self.delay, self.fail = delay, fail

    def score(self, seqs):
        if self.fail:
            raise RuntimeError("teacher server unreachable")
        threading.Event().wait(self.delay)
        return super().score(seqs)


def _orch_run(tmp_path, teacher_run, teacher, steps=2, trainer=True):
    from test_orchestrator import FakeClient, fake_trainer

    from primerl.runtime.orchestrator import Orchestrator
    from primerl.runtime.transport import FileTransport

    cfg = load_config(None, ["--output_dir", str(tmp_path), "--orchestrator.batch_size", "2",
                             "--orchestrator.group_size", "2", "--orchestrator.seq_len", "64",
                             "--max_steps", str(steps),
                             "--env.args", '{"num_symbols": 4}', "--distill.teacher", str(teacher_run)], check=False)
    tr = FileTransport(cfg.output_dir)
    seen = []
    if trainer:  # a trainer thread left waiting for a batch that never comes times out later, in another test
        threading.Thread(target=fake_trainer, args=(tr, steps, seen), daemon=True).start()
    Orchestrator(cfg, ReverseText(num_symbols=4), FakeClient(), tr, teachers={str(teacher_run): teacher}).run()
    return seen


def test_a_slow_teacher_delays_the_hand_over_and_says_so(tmp_path, teacher_run):
    seen = _orch_run(tmp_path, teacher_run, SlowTeacher(delay=0.2))
    deadline = time.monotonic() + 10
    while len(seen) < 2 and time.monotonic() < deadline:
        threading.Event().wait(0.05)
    assert [s for s, _ in seen] == [0, 1]
    assert all(m["distill/wait_s"] > 0 and m["distill/score_s"] > 0 for _, m in seen)


def test_a_failing_teacher_stops_the_orchestrator_naming_it(tmp_path, teacher_run):
    with pytest.raises(RuntimeError, match="teacher scoring failed: teacher server unreachable"):
        _orch_run(tmp_path, teacher_run, SlowTeacher(fail=True), trainer=False)
