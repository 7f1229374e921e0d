"""The bucketed weight transfer (issue 42): wire format, FP8 in transit, deltas with checksums and
repair, sources that must agree, and FSDP2 ranks each sending their own shards (gloo)."""

from __future__ import annotations

import datetime
import os
import socket
import sys
import threading
from pathlib import Path

import pytest
import torch

from primerl.runtime.inference.weight_buckets import (
    FP8_BLOCK, DeltaDecodeError, Piece, decode_bucket, decode_delta, encode_bucket, encode_delta, fp8_transferable,
    plan_buckets, split_pieces, wire_bytes
)
from primerl.runtime.inference.weight_receive import SourceReceiver, receive_version
from primerl.runtime.inference.weight_transfer import BucketSender, join_transfer_groups

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
from _parallel_dist import start_ranks  # noqa: E402


def _port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def _whole(name, t, dtype="bfloat16", fp8=False):
    return Piece(name, dtype, tuple(t.shape), (0,) * t.dim(), tuple(t.shape), fp8)


# ------------------------------------------------------------------------------- wire format
def test_buckets_hold_at_most_bucket_bytes_and_round_trip_exactly():
    g = torch.Generator().manual_seed(0)
    w = {"a.weight": torch.randn(300, 64, generator=g), "a.bias": torch.randn(300, generator=g),
         "steps": torch.tensor([3, 4]), "s": torch.tensor(2.5)}
    cap = 10_000
    pieces = [s for n, t in w.items() for s in split_pieces(_whole(n, t, "bfloat16" if t.is_floating_point()
                                                                   else "int64"), cap)]
    assert [p.size[0] for p in pieces if p.name == "a.weight"] == [78, 78, 78, 66]  # 128 B rows, <= 10 kB
    buckets = plan_buckets(pieces, cap)
    assert all(wire_bytes(b) <= cap for b in buckets)
    out = {n: torch.zeros_like(t, dtype=torch.bfloat16 if t.is_floating_point() else t.dtype) for n, t in w.items()}
    for b in buckets:
        buf = encode_bucket(b, [w[p.name][p.index] for p, _ in b])
        for p, region in decode_bucket(b, buf):
            out[p.name][p.index] = region
    for n, t in w.items():
        assert torch.equal(out[n], t.to(out[n].dtype)), n


def test_fp8_pieces_are_deepgemm_blocks_within_fp8_error_and_about_half_the_bytes():
    from primerl.kernels.fp8 import dequant, quant_per_block

    g = torch.Generator().manual_seed(1)
    w = torch.randn(384, 256, generator=g) * torch.rand(384, 1, generator=g)  # rows of different scales
    p = _whole("layers.0.attn.wq.weight", w, fp8=True)
    subs = split_pieces(p, 40_000)  # cut in whole 128-row blocks: the blocks are those of the whole tensor
    assert [s.size[0] for s in subs] == [128, 128, 128]
    got = torch.cat([r for b in plan_buckets(subs, 40_000)
                     for _, r in decode_bucket(b, encode_bucket(b, [w[s.index] for s, _ in b]))])
    q, sf = quant_per_block(w, FP8_BLOCK)
    assert torch.equal(got, dequant(q, sf, group_shape=FP8_BLOCK, out_dtype=torch.bfloat16))
    blocks = (got.float() - w).abs().reshape(3, 128, 2, 128).amax(dim=(1, 3))
    amax = w.abs().reshape(3, 128, 2, 128).amax(dim=(1, 3))
    assert (blocks <= amax / 16).all(), "e4m3 rounds to 3 mantissa bits: error <= 1/16 of the block's amax"
    assert p.nbytes <= 0.55 * _whole("x", w).nbytes
    assert fp8_transferable("layers.0.ffn.experts.w1", torch.float32, (4, 8, 8))
    assert fp8_transferable("embed.weight", torch.float32, (10, 8))
    assert not fp8_transferable("layers.0.norm.weight", torch.float32, (8,))
    assert not fp8_transferable("steps", torch.int64, (10, 8))


def test_a_delta_is_bitwise_and_a_wrong_base_or_corruption_is_detected():
    g = torch.Generator().manual_seed(2)
    old = torch.randn(4096, generator=g).bfloat16()
    new = old.clone()
    new[::50] += 0.01
    a, b = old.view(torch.uint8).numpy(), new.view(torch.uint8).numpy()
    from primerl.runtime.inference.weight_buckets import checksum

    payload = encode_delta(b, a)
    assert len(payload) < b.nbytes / 4
    assert (decode_delta(payload, a, checksum(b)) == b).all()
    with pytest.raises(DeltaDecodeError, match="checksum"):
        decode_delta(payload, b, checksum(b))  # applied to the wrong base
    with pytest.raises(DeltaDecodeError, match="does not decompress"):
        decode_delta(payload[:-3] + b"xyz", a, checksum(b))


# ------------------------------------------------------------------------------- the protocol
def _run(sources: int, receivers: int, send, *, timeout=60):
    """Sources and receivers as threads of this process (each its own gloo ranks); returns
    ``({receiver j: [(version, {name: tensor})]}, {receiver j: corrupt}, {source r: sender})``."""
    port = _port()
    got, corrupt, senders, errors = {}, {}, {}, []

    def receiver(j):
        try:
            groups = join_transfer_groups("127.0.0.1", port, sources=sources, receivers=receivers, receiver=j,
                                          store_master=j == 0, timeout_s=timeout)
            rx = [SourceReceiver(groups[r], r) for r in range(sources)]
            got[j] = []
            while True:
                v, weights = receive_version(rx, "cpu")
                if v == -1:
                    break
                got[j].append((v, {k: t.clone() for k, t in weights.items()}))
            corrupt[j] = sum(r.corrupt for r in rx)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    def source(r):
        try:
            group = join_transfer_groups("127.0.0.1", port, sources=sources, receivers=receivers, source=r,
                                         store_master=False, timeout_s=timeout)[r]
            senders[r] = send(r, group)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=receiver, args=(j,)) for j in range(receivers)]
    threads += [threading.Thread(target=source, args=(r,)) for r in range(sources)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout * 2)
    return got, corrupt, senders, errors


def _halves(w: dict, r: int):
    """Source r's regions: its half of dim 0 of every tensor."""
    out = []
    for n, t in w.items():
        h = t.shape[0] // 2
        lo, hi = (0, h) if r == 0 else (h, t.shape[0])
        out.append((Piece(n, "bfloat16", tuple(t.shape), (lo, *[0] * (t.dim() - 1)), (hi - lo, *t.shape[1:])),
                    t[lo:hi]))
    return out


def _versions(n: int):
    g = torch.Generator().manual_seed(3)
    w = {"a.weight": torch.randn(96, 64, generator=g), "a.bias": torch.randn(96, generator=g),
         "embed.weight": torch.randn(20, 16, generator=g)}
    out = []
    for _ in range(n):
        out.append({k: t.clone() for k, t in w.items()})
        for t in w.values():  # an RL step: a few weights move
            idx = torch.randint(0, t.numel(), (t.numel() // 20,), generator=g)
            t.view(-1)[idx] += 1e-2
    return out


def test_deltas_from_two_sources_are_bitwise_the_full_update_and_a_corrupt_one_is_repaired():
    versions = _versions(5)

    def corrupt_v3_bucket0(i, payload: bytes) -> bytes:
        """A delta that decompresses fine but whose xor is wrong in one byte: only the checksum sees it."""
        import zstandard

        x = bytearray(zstandard.ZstdDecompressor().decompress(payload))
        x[7] ^= 0x10
        return zstandard.ZstdCompressor().compress(bytes(x))

    def send(r, group):
        s = BucketSender(group, bucket_bytes=4096, delta=True, full_every=4)
        modes = []
        for v, w in enumerate(versions):
            s.corrupt_hook = corrupt_v3_bucket0 if (r == 0 and v == 3) else None
            regions = _halves(w, r)
            modes.append(s.send(v, [p for p, _ in regions], [t for _, t in regions])["mode"])
        s.close()
        s.modes = modes
        return s

    got, corrupt, senders, errors = _run(2, 2, send)
    assert not errors, errors
    for j in range(2):
        assert [v for v, _ in got[j]] == list(range(5))
        for v, weights in got[j]:
            for k, t in versions[v].items():
                assert torch.equal(weights[k], t.bfloat16()), (j, v, k)
        assert corrupt[j] == 1  # detected once by each receiver, never loaded (bitwise equal above)
    assert senders[0].modes == ["full", "delta", "delta", "delta+repair", "full"]  # full_every = 4
    assert senders[1].modes == ["full", "delta", "delta", "delta", "full"]
    assert senders[0].stats.repairs == 1 and senders[1].stats.repairs == 0
    s = senders[1].stats
    assert s.delta_versions == 3 and s.wire_bytes < 0.6 * s.raw_bytes


def test_sources_that_disagree_on_the_version_are_never_loaded():
    w = _versions(1)[0]

    def send(r, group):
        s = BucketSender(group, bucket_bytes=1 << 20)
        regions = _halves(w, r)
        s.send(7 + r, [p for p, _ in regions], [t for _, t in regions])
        s.close()
        return s

    got, _, _, errors = _run(2, 1, send, timeout=5)  # the senders' goodbye then times out: nobody listens
    assert any("the sources sent versions [7, 8]: not loaded" in str(e) for e in errors), errors
    assert got[0] == []


def test_sources_that_leave_elements_out_are_never_loaded():
    w = _versions(1)[0]

    def send(r, group):
        s = BucketSender(group, bucket_bytes=1 << 20)
        regions = _halves(w, r)[: 3 if r == 0 else 2]  # source 1 forgets its half of embed.weight
        s.send(0, [p for p, _ in regions], [t for _, t in regions])
        s.close()
        return s

    got, _, _, errors = _run(2, 1, send, timeout=5)
    assert any("did not cover ['embed.weight (160/320 elements)']" in str(e) for e in errors), errors
    assert got[0] == []


# ------------------------------------------------------------------------------- FSDP2 shards
class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 8)
        self.proj = torch.nn.Linear(8, 7)  # 7 rows over 2 ranks: 4 + 3
        self.experts = torch.nn.Parameter(torch.randn(4, 130, 128) * 0.1)


def _fsdp_worker(rank, world, store, ports):
    from torch.distributed.fsdp import fully_shard

    from primerl.runtime.inference.weight_channels import BucketedBroadcast
    from primerl.runtime.trainer.publish import WeightStream

    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    torch.manual_seed(0)
    model = _Model()
    fully_shard(model)
    channels = []
    # one receiver each: raw bf16 as pieces (sent from the shards, received into the full tensors), FP8 in
    # transit with deltas (packed buckets)
    for port, fp8 in zip(ports, (False, True)):
        join = lambda r, port=port: join_transfer_groups(  # noqa: E731
            "127.0.0.1", port, sources=world, receivers=1, source=r, store_master=False, timeout_s=300)[r]
        channels.append(BucketedBroadcast(join, None, rank=rank, dtype=torch.bfloat16, bucket_bytes=20_000, fp8=fp8,
                                          delta=fp8))
    for ch in channels:
        ch.publish(0, WeightStream(model))
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().mul_(2)
    for ch in channels:
        ch.publish(1, WeightStream(model))
        ch.close()
        assert ch.stats.last["mode"] == ("delta" if ch.delta else "full")
    dist.destroy_process_group()


def test_every_fsdp2_rank_sends_its_own_shards_and_the_receiver_assembles_them(tmp_path):
    """Two FSDP2 ranks, two channels (bf16 as pieces; FP8 in transit with deltas), a receiver each in
    this process."""
    from primerl.kernels.fp8 import dequant, quant_per_block

    ports, world = [_port(), _port()], 2
    got, errors = {False: [], True: []}, []

    def receive(port, fp8):
        try:
            groups = join_transfer_groups("127.0.0.1", port, sources=world, receivers=1, receiver=0, store_master=True,
                                          timeout_s=300)
            rx = [SourceReceiver(groups[r], r) for r in range(world)]
            while (out := receive_version(rx, "cpu"))[0] != -1:
                got[fp8].append(out)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=receive, args=(p, f)) for p, f in zip(ports, (False, True))]
    for t in threads:
        t.start()
    os.environ["OMP_NUM_THREADS"] = "1"
    start_ranks(_fsdp_worker, (world, str(tmp_path / "store"), ports), world)
    for t in threads:
        t.join(300)
    assert not errors, errors
    torch.manual_seed(0)
    ref = _Model().state_dict()
    for fp8 in (False, True):
        assert [v for v, _ in got[fp8]] == [0, 1]
        for v, weights in got[fp8]:
            assert set(weights) == set(ref)
            for k, t in ref.items():
                want = t * (1 + v)
                if not fp8:
                    assert torch.equal(weights[k], want.bfloat16()), (v, k)
                elif k == "experts":  # sharded along the experts: the blocks of the full tensor, bitwise
                    q, sf = quant_per_block(want.float(), FP8_BLOCK)
                    assert torch.equal(weights[k], dequant(q, sf, group_shape=FP8_BLOCK, out_dtype=torch.bfloat16))
                elif t.dim() >= 2:  # 4 + 3 / 5 + 5 rows: other blocks than the full tensor's, within FP8 error
                    assert (weights[k].float() - want).abs().max() <= want.abs().max() / 16, k
                    assert not torch.equal(weights[k], want.bfloat16()), k  # it did go as FP8
                else:
                    assert torch.equal(weights[k], want.bfloat16()), (v, k)


# ------------------------------------------------------------------------------- the plan
def test_update_plan_full_fp8_delta_and_the_command(capsys):
    from primerl.runtime.cli import main
    from primerl.runtime.update_plan import estimate_update

    one = {e.form: e for e in estimate_update(1e9, senders=1, receiver_gpus=8, link_gbps=400)}
    four = {e.form: e for e in estimate_update(1e9, senders=4, receiver_gpus=8, link_gbps=400)}
    assert one["full"].bytes == 2e9 and 0.5 <= one["fp8"].bytes / one["full"].bytes <= 0.51
    assert one["full"].seconds == pytest.approx(2e9 / 50e9) and one["full"].bound == "senders"
    assert four["full"].seconds == pytest.approx(one["full"].seconds / 4)  # sharded: every rank's link
    assert estimate_update(1e9, senders=64, receiver_gpus=8)[0].bound == "receiver"
    assert main(["plan", "--config", "examples/reverse_text_4rank.toml", "--link-gbps", "100"]) == 0
    out = capsys.readouterr().out
    assert "# weight update (predicted" in out and "4 sending rank(s)" in out
    assert all(f"#   {f}" in out for f in ("full ", "fp8  ", "delta"))
    assert main(["plan", "--config", "examples/reverse_text_4rank.toml", "--link-gbps", "-1"]) == 2
    assert "--link-gbps must be > 0" in capsys.readouterr().err


def test_fp8_or_delta_with_a_receiver_that_cannot_take_them_is_refused_at_dry_run(capsys):
    from primerl.runtime.cli import main

    base = ["rl", "--config", "examples/reverse_text.toml", "--dry-run"]
    assert main([*base, "--inference.weight_transfer.dtype", "fp8"]) == 2  # files on one machine's CPU
    assert "inference.weight_transfer.dtype: is a form of the broadcast" in capsys.readouterr().err
    assert main([*base, "--inference.weight_transfer.delta", "true", "--inference.num_servers", "2"]) == 2
    assert "inference.weight_transfer.delta: is a form of the broadcast" in capsys.readouterr().err  # a pool by files
    pool = ["--inference.num_servers", "2", "--inference.weight_update", "broadcast"]
    assert main([*base, *pool, "--inference.weight_transfer.delta", "true", "--inference.weight_transfer.dtype",
                 "fp8"]) == 0  # a pool by broadcast takes both (pool_broadcast: a pair per server)
    capsys.readouterr()
    pd = ["--inference.pd.prefill", "1", "--inference.pd.decode", "1", "--inference.weight_update", "broadcast"]
    assert main([*base, *pd, "--inference.weight_transfer.delta", "true"]) == 2
    assert "inference.weight_transfer.delta: P/D servers take weights as files" in capsys.readouterr().err
    assert main([*base, "--inference.weight_transfer.dtype", "fp8", "--inference.backend", "vllm"]) == 2
    assert "inference.weight_transfer.dtype" in capsys.readouterr().err
    assert main([*base, "--inference.weight_transfer.full_every", "0"]) == 2
    assert "inference.weight_transfer.full_every: must be an integer >= 1" in capsys.readouterr().err
    assert main([*base, "--inference.weight_transfer.dtype", "fp8", "--inference.weight_transfer.delta", "true",
                 "--inference.weight_update", "broadcast"]) == 0


# ------------------------------------------------------------------------------- through the job
def test_the_job_with_delta_transfer_trains_exactly_as_with_files_and_fp8_runs(tmp_path):
    """The main task (synchronous, so the same versions are sampled) through the threads launcher:
    deltas (a full version every 2) give bitwise the run of files; FP8 in transit runs its steps."""
    from pathlib import Path

    from primerl.runtime.launch.threads import run_threads
    from primerl.runtime.validate import load_config

    root = Path(__file__).resolve().parents[2]
    small = ["--max_steps", "4", "--orchestrator.batch_size", "4", "--orchestrator.group_size", "4",
             "--orchestrator.max_async_level", "0", "--checkpoint.interval", "0", "--log.plot", "false",
             "--log.progress", "false", "--orchestrator.weights_timeout_s", "60", "--trainer.batch_timeout_s", "60"]

    def cfg(name, *over):
        return load_config(root / "examples" / "reverse_text.toml", ["--output_dir", str(tmp_path / name), *small,
                                                                     *over])

    files = run_threads(cfg("files"))
    parts: dict = {}
    delta = run_threads(cfg("delta", "--inference.weight_update", "broadcast", "--inference.broadcast_port",
                            str(_port()), "--inference.weight_transfer.delta", "true",
                            "--inference.weight_transfer.full_every", "2",
                            "--inference.weight_transfer.bucket_mb", "0.05"), parts=parts)
    for a, b in zip(files, delta, strict=True):
        assert (a["reward/mean"], a["loss"], a["policy_version"]) == (b["reward/mean"], b["loss"], b["policy_version"])
    assert parts["client"].receiver.corrupt == 0 and parts["client"].receiver.last_version == 4
    assert [r["weights/delta_versions"] for r in delta] == [1, 1, 2, 2]  # versions 1..4: delta, full, delta, full
    assert all(r["weights/wire_fraction"] < 1 for r in delta[::2]) and delta[1]["weights/wire_fraction"] == 1
    fp8 = run_threads(cfg("fp8", "--inference.weight_update", "broadcast", "--inference.broadcast_port", str(_port()),
                          "--inference.weight_transfer.dtype", "fp8"))
    assert [r["step"] for r in fp8] == list(range(4))
