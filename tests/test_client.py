"""The trainer-side client (`sglang_fp8rl.weight_sync.client`) against SGLang's real update path on CPU."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sgl_model import TINY, assert_same_params, random_state_dict, run_worker, write_checkpoint

from sglang_fp8rl.weight_sync.buckets import buckets, named_items
from sglang_fp8rl.weight_sync.client import WeightPushError, serialize_for_ranks

QUANT = ("--quantization", "fp8_online_blockwise")


def test_buckets_respect_the_byte_budget_and_order():
    """Consecutive buckets of at most bucket_bytes; a larger tensor travels alone; nothing lost or reordered."""
    sd = {f"t{i}": torch.zeros(n, dtype=torch.bfloat16) for i, n in enumerate([10, 20, 300, 5, 5, 40])}
    groups = list(buckets(sd, bucket_bytes=64))
    assert [[n for n, _ in g] for g in groups] == [["t0", "t1"], ["t2"], ["t3", "t4"], ["t5"]]
    assert all(sum(t.numel() * 2 for _, t in g) <= 64 or len(g) == 1 for g in groups)
    with pytest.raises(ValueError, match="bucket_bytes must be positive"):
        list(buckets(sd, 0))


def test_named_items_accepts_named_parameters_and_detaches():
    """named_parameters() works as well as a state_dict, and nothing keeps autograd history."""
    lin = torch.nn.Linear(4, 3)
    items = list(named_items(lin.named_parameters()))
    assert [n for n, _ in items] == ["weight", "bias"] and not any(t.requires_grad for _, t in items)


def test_payload_is_sglangs_per_rank_format():
    """One payload per TP rank that SGLang's own (safe) deserializer reads back exactly."""
    from sglang.srt.utils import MultiprocessingSerializer

    named = [("a", torch.randn(3, 5)), ("b", torch.randn(7, dtype=torch.float64).to(torch.bfloat16))]
    payloads = serialize_for_ranks(named, tp_size=2)
    assert len(payloads) == 2 and all(isinstance(p, str) for p in payloads)
    back = MultiprocessingSerializer.deserialize(payloads[1])
    assert [n for n, _ in back] == ["a", "b"] and all(torch.equal(x, y) for (_, x), (_, y) in zip(back, named))
    bucket = {"flattened_tensor": torch.arange(8, dtype=torch.uint8), "metadata": ["m"]}  # a flattened bucket: as is
    back = MultiprocessingSerializer.deserialize(serialize_for_ranks(bucket, tp_size=1)[0])
    assert set(back) == {"flattened_tensor", "metadata"}
    assert torch.equal(back["flattened_tensor"], bucket["flattened_tensor"]) and back["metadata"] == ["m"]


@pytest.mark.slow
def test_push_state_dict_to_an_engine(tmp_path):
    """Bucketed push of a full state dict equals a cold load; a NaN push raises WeightPushError naming the tensor
    and leaves every parameter as it was; push_from_disk works; no pointer moves."""
    write_checkpoint(str(tmp_path / "w0"), TINY, seed=30)
    w1 = random_state_dict(TINY, seed=31)
    write_checkpoint(str(tmp_path / "w1"), TINY, seed=31, state_dict=w1)
    torch.save(w1, tmp_path / "w1.pt")
    cold = run_worker("load", str(tmp_path / "w1"), str(tmp_path / "cold.pt"), *QUANT)
    out = run_worker("client", str(tmp_path / "w0"), str(tmp_path / "client.pt"), *QUANT,
                     extra={"state_dict": str(tmp_path / "w1.pt"), "bucket_bytes": 256 << 10,
                            "disk": str(tmp_path / "w1")})
    assert len(out["answers"]) > 3  # really bucketed
    assert_same_params(out["after_push"], cold["params"])
    assert out["bad_error"] is not None and "contains NaN/Inf" in out["bad_error"]
    assert "update_weights_from_tensor" in out["bad_error"]
    assert_same_params(out["after_bad"], cold["params"])
    assert out["disk_answer"][0]
    assert_same_params(out["final_params"], cold["params"])
    assert out["ptrs_before"] == out["ptrs_after"]
    assert issubclass(WeightPushError, RuntimeError)


# ---------------------------------------------------------------------------------------------------------------------
# payload pickling and the distributed transport


def test_cpu_tensors_pickle_after_sglangs_global_patch(tmp_path):
    """SGLang's client patch of torch's reductions breaks the pickling of CPU tensors for the rest of the process
    (a CPU push after a CUDA push, or a mixed bucket); ours is private to its pickler. Run in a fresh process: the
    patch is process-global."""
    import subprocess
    import sys

    code = (
        "from sglang_fp8rl.cpu_runner import install_cpu_stubs; install_cpu_stubs()\n"
        "import torch\n"
        "from sglang.srt.utils import MultiprocessingSerializer\n"
        "from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions\n"
        "from sglang_fp8rl.weight_sync.client import serialize_for_ranks\n"
        "monkey_patch_torch_reductions()\n"
        "named = [('a', torch.randn(3, 5)), ('b', torch.randn(4).bfloat16())]\n"
        "back = MultiprocessingSerializer.deserialize(serialize_for_ranks(named, 1)[0])\n"
        "assert all(torch.equal(x, y) for (_, x), (_, y) in zip(back, named))\n"
        "from torch.multiprocessing import reductions\n"
        "assert reductions.reduce_tensor.__name__ == '_reduce_tensor_modified'  # we left SGLang's patch alone\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_preflight_refuses_before_anything_is_sent():
    from sglang_fp8rl.weight_sync.client import push_distributed, push_state_dict

    class Target:
        calls = 0

        def update_weights_from_tensor(self, *args, **kwargs):
            self.calls += 1
            return True, "ok"

        update_weights_from_distributed = update_weights_from_tensor

    target = Target()
    good = {"a": torch.zeros(4, dtype=torch.bfloat16)}
    for bad, words in [({"b": torch.full((3,), float("nan"))}, "b: contains NaN/Inf"),
                       ({"b": torch.zeros(3, dtype=torch.float64)}, "b: torch.float64 is not accepted"),
                       ({"b": torch.zeros(3, dtype=torch.float8_e5m2)}, "float8_e5m2")]:
        for push in (push_state_dict, push_distributed):
            args = (target, {**good, **bad}) if push is push_state_dict else (target, {**good, **bad}, None)
            with pytest.raises(WeightPushError, match=words):
                push(*args, bucket_bytes=8)  # the bad tensor is in the second bucket
    assert target.calls == 0


def test_preflight_checks_a_bucket_in_one_batch(monkeypatch):
    """A good bucket is checked by the batched check alone (no per-tensor check: on a GPU that is a host sync per
    tensor); a bad one is named by the exact check, which stops at the first culprit."""
    from sglang_fp8rl.weight_sync import client

    calls = []
    exact = client.extremes
    monkeypatch.setattr(client, "extremes", lambda t: calls.append(t) or exact(t))
    bucket = [(f"w{i}", torch.randn(8, 16).to([torch.bfloat16, torch.float32, torch.float16][i % 3]))
              for i in range(50)]
    client.preflight(bucket, "push")
    assert calls == []
    bucket[7][1][3, 3] = float("inf")
    bucket[30][1][0, 0] = float("nan")
    with pytest.raises(WeightPushError, match="^push not sent: w7: contains NaN/Inf in BF16$"):
        client.preflight(bucket, "push")
    assert len(calls) == 8


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.sampled_from(["bf16", "fp16", "fp32"]),
                          st.sampled_from(["none", "nan", "inf", "-inf", "huge32", "big"])), min_size=1, max_size=6),
       st.integers(0, 2**31 - 1))
def test_preflight_refuses_exactly_what_is_not_finite_in_bf16(specs, seed):
    """Against a float64 reference (NaN, Inf, |x| past BF16's largest finite value once rounded): the bucket passes
    iff no tensor is bad, else the first bad tensor is named."""
    from sglang_fp8rl.weight_sync.client import preflight

    g = torch.Generator().manual_seed(seed)
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    bucket = []
    for i, (n, dtype, poison) in enumerate(specs):
        t = torch.randn(n, generator=g, dtype=torch.float64)
        value = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf"), "huge32": 3.4e38,
                 "big": 6.0e4}.get(poison)
        if value is not None:
            t[n // 2] = value
        bucket.append((f"t{i}", t.to(dtypes[dtype])))
    bf16_max = torch.finfo(torch.bfloat16).max
    bad = [name for name, t in bucket
           if bool((~torch.isfinite(t.double()) | (t.double().abs() > bf16_max * (1 + 2**-9))).any())]
    if not bad:
        preflight(bucket, "push")
    else:
        with pytest.raises(WeightPushError, match=f"^push not sent: {bad[0]}: contains NaN/Inf in BF16$"):
            preflight(bucket, "push")


@pytest.fixture
def fake_engine():
    import subprocess
    import sys
    import time

    import requests
    from conftest import HERE, free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, f"{HERE}/fake_engine.py", str(port)])
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            requests.post(url + "/ping", json={}, timeout=1)
            break
        except requests.ConnectionError:
            time.sleep(0.1)
    yield url
    proc.kill()
    proc.wait()


@pytest.mark.slow
def test_distributed_push_end_to_end_with_an_engine_rejection(fake_engine):
    """init_update_group joins the trainer's side concurrently with the engine's request and returns the group (the
    documented call order used to deadlock); buckets are broadcast; an engine rejection (HTTP 400) reaches the
    caller as WeightPushError with the engine's message (it used to be lost in the request thread)."""
    from conftest import free_port

    from sglang_fp8rl.weight_sync.client import init_update_group, push_distributed

    group = init_update_group(fake_engine, "127.0.0.1", free_port(), world_size=2, group_name="fp8rl_client",
                              backend="gloo", timeout=60)
    weights = {"a": torch.ones(4, dtype=torch.bfloat16), "b": torch.full((2, 3), 2.0)}
    answers = push_distributed(fake_engine, weights, group, group_name="fp8rl_client", bucket_bytes=8, timeout=60)
    assert [a["message"] for a in answers] == ["sums [4.0]", "sums [12.0]"]
    # no sessions on this engine: the step ends with a marker request after the last bucket (KV recalibration)
    import requests

    received = requests.get(fake_engine + "/get_server_info", timeout=10).json()["received"]
    assert received[-3:] == [[4.0], [12.0], ["tensor request"]]
    with pytest.raises(WeightPushError, match="reject.me: refused by the engine"):
        push_distributed(fake_engine, {"reject.me": torch.ones(2)}, group, group_name="fp8rl_client", timeout=60)


def test_cpu_payload_deserializes_in_an_unrelated_process(tmp_path):
    """An engine is not in the trainer's multiprocessing family: a CPU tensor must travel by value (torch's
    shared-memory reduction passes a file descriptor the engine may not fetch: 'digest sent was rejected')."""
    import subprocess
    import sys

    payload = tmp_path / "payload.txt"
    send = ("from sglang_fp8rl.cpu_runner import install_cpu_stubs; install_cpu_stubs()\n"
            "import torch\n"
            "from sglang_fp8rl.weight_sync.client import serialize_for_ranks\n"
            "named = [('a', torch.arange(12.).reshape(3, 4).bfloat16()), ('fp8rl.step_complete', torch.zeros(()))]\n"
            f"open({str(payload)!r}, 'w').write(serialize_for_ranks(named, 1)[0])\n")
    receive = ("from sglang_fp8rl.cpu_runner import install_cpu_stubs; install_cpu_stubs()\n"
               "import torch\n"
               "from sglang.srt.utils import MultiprocessingSerializer\n"
               f"back = MultiprocessingSerializer.deserialize(open({str(payload)!r}).read())\n"
               "assert [n for n, _ in back] == ['a', 'fp8rl.step_complete']\n"
               "assert torch.equal(back[0][1], torch.arange(12.).reshape(3, 4).bfloat16())\n"
               "print('ok')\n")
    assert subprocess.run([sys.executable, "-c", send], capture_output=True, timeout=300).returncode == 0
    out = subprocess.run([sys.executable, "-c", receive], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_the_trainer_end_of_an_nccl_group_matches_sglangs_nccl_settings(caplog):
    """SGLang's engine runs NCCL with NCCL_CUMEM_ENABLE=0 (its _set_envs_and_config, the default server args: off
    unless --enable-symm-mem, and from 0.5.23 unless KV-cache sharding's symmetric scratch asks for it); the client
    sets the same where the trainer left it unset and warns about a different value."""
    import inspect
    import logging

    from sglang.srt.entrypoints import engine

    from sglang_fp8rl.weight_sync.client import ENGINE_NCCL_ENV, match_engine_nccl_env

    source = " ".join(inspect.getsource(engine._set_envs_and_config).split())
    assert any(form in source for form in (
        'os.environ["NCCL_CUMEM_ENABLE"] = str(int(server_args.enable_symm_mem))',  # 0.5.12-0.5.21
        'os.environ["NCCL_CUMEM_ENABLE"] = str( int(cfg.enable_symm_mem or kv_shard_symmetric_scratch) )'))  # 0.5.23
    env: dict = {}
    match_engine_nccl_env(env)
    assert env == ENGINE_NCCL_ENV == {"NCCL_CUMEM_ENABLE": "0"}
    with caplog.at_level(logging.WARNING):
        other = {"NCCL_CUMEM_ENABLE": "1"}
        match_engine_nccl_env(other)
    assert other == {"NCCL_CUMEM_ENABLE": "1"} and "NCCL_CUMEM_ENABLE=1 here" in caplog.text


def test_flattened_bucket_puts_the_widest_dtypes_first():
    """flatten=True's bucket: SGLang's own class, the FP32 tensors first, then BF16, then FP8 codes, so every tensor
    starts aligned to its element size (SGLang's order would put an FP32 tensor after 3 BF16 values at byte 6, which
    the engine refuses); the engine reads back every tensor exactly. Tensors on two devices are refused here."""
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    from sglang_fp8rl.hooks.transport import check_bucket_metadata, tensors_of_bucket
    from sglang_fp8rl.weight_sync.buckets import flattened_bucket
    from sglang_fp8rl.weight_sync.validate import UpdateRejected

    named = [("a", torch.full((3,), 1.5, dtype=torch.bfloat16)), ("b", torch.arange(4, dtype=torch.float32)),
             ("c", torch.full((5,), 2.0).to(torch.float8_e4m3fn)), ("d", torch.randn(2, 3)[:, 1].to(torch.bfloat16))]
    naive = FlattenedTensorBucket(named_tensors=named)
    with pytest.raises(UpdateRejected, match="b: bucket offset 6 is not aligned"):
        check_bucket_metadata(naive.get_flattened_tensor(), naive.get_metadata())
    bucket = flattened_bucket(named, "bucket 1")
    assert [m.name for m in bucket["metadata"]] == ["b", "a", "d", "c"]
    back = dict(tensors_of_bucket(bucket))
    for name, tensor in named:
        assert back[name].dtype == tensor.dtype and torch.equal(back[name].float(), tensor.float()), name
    with pytest.raises(WeightPushError, match="bucket 1 not sent: flatten=True needs one device per bucket"):
        flattened_bucket([("a", torch.ones(2)), ("b", torch.empty(2, device="meta"))], "bucket 1")


def test_buckets_never_straddle_devices():
    """A payload spread over devices (a trainer's GPUs) goes in buckets of one device each, each device's tensors in
    their order; one bucket is open per device, so tensors that alternate between devices (a placement balanced
    tensor by tensor) still fill whole buckets instead of one bucket per tensor."""
    sd = {"a": torch.zeros(4, dtype=torch.bfloat16), "b": torch.zeros(4, dtype=torch.bfloat16, device="meta"),
          "c": torch.zeros(4, dtype=torch.bfloat16, device="meta"), "d": torch.zeros(4, dtype=torch.bfloat16)}
    groups = list(buckets(sd, bucket_bytes=1 << 20))
    assert [[n for n, _ in g] for g in groups] == [["a", "d"], ["b", "c"]]
    alternating = {f"t{i}": torch.zeros(4, dtype=torch.bfloat16, device="cpu" if i % 2 else "meta")
                   for i in range(40)}  # 8 bytes each
    groups = list(buckets(alternating, bucket_bytes=80))
    assert len(groups) == 4 and all(len(g) == 10 for g in groups)
    assert all(len({t.device for _, t in g}) == 1 for g in groups)
    assert sorted(n for g in groups for n, _ in g) == sorted(alternating)
    for g in groups:  # each device's tensors keep their order
        assert [int(n[1:]) for n, _ in g] == sorted(int(n[1:]) for n, _ in g)


def test_a_bucket_that_cannot_be_flattened_is_refused_before_anything_is_sent():
    """flatten=True with a weight and its scale on two devices (one unit, so one bucket): refused with the reason
    before the first request, not after earlier buckets were written."""
    from sglang_fp8rl.weight_sync.client import push_state_dict

    class Target:
        calls = 0

        def update_weights_from_tensor(self, *args, **kwargs):
            self.calls += 1
            return True, "ok"

    target = Target()
    weights = {"first.weight": torch.zeros(4, dtype=torch.bfloat16),
               "l.weight": torch.zeros(128, 128, dtype=torch.float8_e4m3fn),
               "l.weight_scale_inv": torch.ones(1, 1, device="meta")}
    for atomic in (True, False):
        with pytest.raises(WeightPushError, match="not sent: flatten=True needs one device per bucket"):
            push_state_dict(target, weights, bucket_bytes=8, atomic=atomic, flatten=True)
    assert target.calls == 0
