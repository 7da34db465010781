"""CPU tests of scripts/rl_regression.py: reward, GRPO advantages and loss, rollout packing, the step record,
server command lines (parsed by SGLang's real parser), outputs, arguments, and a --dry-run end to end."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

import pytest
import rl_engines as RE
import rl_grpo as RG
import rl_policy as RP
import rl_regression as RL
import rl_report as RR
import torch
import train_toy_policy as TT

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ANSWER = TT.answer_ids(123, 4567)  # 4690 -> "096400" reversed, + <eos>: 7 tokens
TINY_RUN = ["--dry-run", "--model-size", "tiny", "--prompts-per-step", "3", "--group-size", "4", "--sft-max-steps", "2",
            "--sft-batch-size", "8", "--sft-check-every", "1", "--eval-n", "8", "--log-every", "1"]


# ---------------------------------------------------------------------------------------------------------------
# reward and GRPO
# ---------------------------------------------------------------------------------------------------------------

def test_reward_partial_credit_and_exact():
    assert len(ANSWER) == 7 and ANSWER[-1] == TT.EOS
    assert RG.reward(ANSWER, ANSWER) == 1.0
    assert RG.reward(ANSWER, ANSWER, "exact") == 1.0
    wrong_digit = list(ANSWER)
    wrong_digit[2] = TT.VOCAB["9"] if ANSWER[2] != TT.VOCAB["9"] else TT.VOCAB["1"]
    assert RG.reward(wrong_digit, ANSWER) == pytest.approx(6 / 7)
    assert RG.reward(wrong_digit, ANSWER, "exact") == 0.0
    early_eos = ANSWER[:3] + [TT.EOS]
    assert RG.reward(early_eos, ANSWER) == pytest.approx(3 / 7)  # positions 4..7 missing or wrong
    assert RG.reward([], ANSWER) == 0.0
    shifted = [TT.VOCAB["0"]] + ANSWER[:-1]
    assert RG.reward(shifted, ANSWER) < 1.0
    with pytest.raises(ValueError, match="reward kind"):
        RG.reward(ANSWER, ANSWER, "partial")


def test_group_advantages_normalize_within_groups():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5, 0.2, 0.4, 0.6, 0.8])
    adv = RG.group_advantages(r, 4)
    g = adv.reshape(3, 4)
    assert g.sum(dim=1).abs().max() < 1e-6
    assert torch.equal(g[1], torch.zeros(4))  # no signal in a group with one reward
    assert g[0].std().item() == pytest.approx(1.0, rel=1e-4)
    assert g[0, 0] > 0 > g[0, 1]
    want = (torch.tensor([0.2, 0.4, 0.6, 0.8]) - 0.5) / (torch.tensor([0.2, 0.4, 0.6, 0.8]).std() + 1e-6)
    assert torch.allclose(g[2], want)
    for bad, gs in ((r, 5), (r, 1), (r.reshape(3, 4), 4)):
        with pytest.raises(ValueError, match="groups"):
            RG.group_advantages(bad, gs)


def _grad(logp_old, rollout, adv, mask, clip_eps=0.2, tis_cap=None, shift=0.0):
    new = (logp_old + shift).clone().requires_grad_(True)
    loss, stats = RG.grpo_loss(new, logp_old, rollout, adv, mask, clip_eps, tis_cap)
    loss.backward()
    return new.grad, loss, stats


def test_grpo_loss_on_policy_gradient_is_advantage_over_token_count():
    old = torch.tensor([[-0.5, -1.0, -2.0], [-0.1, -0.2, -0.3]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    adv = torch.tensor([2.0, -1.0])
    grad, loss, stats = _grad(old, old, adv, mask)
    n = mask.sum()
    assert torch.allclose(grad, -adv[:, None] * mask / n)
    assert float(loss.detach()) == pytest.approx(float(-(adv[:, None] * mask).sum() / n))
    assert stats["ppo_clip_fraction"] == 0.0


def test_grpo_loss_tis_scales_each_token_by_its_truncated_ratio():
    old = torch.tensor([[-0.5, -1.0, -2.0]])
    rollout = torch.tensor([[-0.5, -2.0, -1.0]])  # ratios 1, e (truncated to 2), 1/e
    mask = torch.ones(1, 3)
    adv = torch.tensor([1.0])
    grad, _, _ = _grad(old, rollout, adv, mask, tis_cap=2.0)
    w = torch.tensor([[1.0, 2.0, math.exp(-1.0)]])
    assert torch.allclose(grad, -w / 3)
    plain, _, _ = _grad(old, rollout, adv, mask, tis_cap=None)
    assert torch.allclose(plain, -torch.ones(1, 3) / 3)  # without TIS the rollout log-probs do not enter


def test_grpo_loss_clips_moves_beyond_eps_in_the_advantage_direction():
    old = torch.zeros(2, 2)
    mask = torch.ones(2, 2)
    adv = torch.tensor([1.0, -1.0])
    grad, _, stats = _grad(old, old, adv, mask, clip_eps=0.2, shift=0.5)  # ratio e^0.5 ~ 1.65 > 1.2
    assert torch.equal(grad[0], torch.zeros(2))  # positive advantage, ratio above 1 + eps: clipped, no gradient
    assert torch.all(grad[1] > 0)  # negative advantage: the unclipped term is the pessimistic one
    assert stats["ppo_clip_fraction"] == 1.0


# ---------------------------------------------------------------------------------------------------------------
# rollouts and log-probs
# ---------------------------------------------------------------------------------------------------------------

def test_pack_rollouts_layout():
    prompts = [[1, 5, 6], [1, 7, 8]]
    samples = [([4, 2], [-0.1, -0.2]), ([9, 9, 2], [-1.0, -2.0, -3.0])]
    b = RG.pack_rollouts(prompts, samples, max_new=4)
    assert b["ids"].tolist() == [[1, 5, 6, 4, 2, TT.PAD, TT.PAD], [1, 7, 8, 9, 9, 2, TT.PAD]]
    assert b["attn"].tolist() == [[1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 0]]
    assert b["mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 0]]
    assert torch.equal(b["rollout_logp"], torch.tensor([[-0.1, -0.2, 0, 0], [-1.0, -2.0, -3.0, 0]]))
    assert int(b["prompt_len"]) == 3
    with pytest.raises(ValueError, match="one length"):
        RG.pack_rollouts([[1, 2], [1]], samples, 4)
    with pytest.raises(ValueError, match="logprobs"):
        RG.pack_rollouts(prompts, [([4, 2], [-0.1]), samples[1]], 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        RG.pack_rollouts(prompts, samples, 2)


def test_trainer_logprobs_align_with_the_sampler():
    """response_logprobs (teacher forcing on the packed batch) must reproduce the sampler's own log-probs: this pins
    the off-by-one between positions and predicted tokens that every mismatch metric depends on."""
    model = RP.build_policy("tiny", seed=1, device=torch.device("cpu")).eval()
    prompts = [TT.prompt_ids(a, b) for a, b in [(123, 4567), (98765, 4321), (500, 500)]]
    samples = RP.sample_torch(model, prompts, TT.max_answer_tokens(TT.DEFAULT_TASK), 1.0,
                              torch.Generator().manual_seed(0))
    b = RG.pack_rollouts(prompts, samples, TT.max_answer_tokens(TT.DEFAULT_TASK))
    with torch.no_grad():
        lp = RP.response_logprobs(model, b["ids"], b["attn"], int(b["prompt_len"]))
    m = b["mask"].bool()
    assert torch.allclose(lp[m], b["rollout_logp"][m], atol=1e-5)
    assert all(len(t) == len(lps) and (t[-1] == TT.EOS or len(t) == 7) for t, lps in samples)


def test_parse_generate_output():
    out = {"output_ids": [5, 2], "meta_info": {"output_token_logprobs": [[-0.5, 5, None], [-0.01, 2, None]]}}
    assert RE.parse_generate_output(out) == ([5, 2], [-0.5, -0.01])
    with pytest.raises(ValueError, match="differ"):
        RE.parse_generate_output({**out, "output_ids": [5, 3]})
    with pytest.raises(KeyError, match="output_token_logprobs"):
        RE.parse_generate_output({"output_ids": [5], "meta_info": {}})


def test_fake_fp8_rounds_only_decoder_linears():
    model = RP.build_policy("tiny", seed=0, device=torch.device("cpu"))
    named = RP.named_bf16(model)
    out = dict(RE.fake_fp8(named))
    src = dict(named)
    q = src["model.layers.0.self_attn.q_proj.weight"].float()
    dq = out["model.layers.0.self_attn.q_proj.weight"].float()
    assert not torch.equal(q, dq)
    assert ((dq - q).abs().max() / q.abs().max()).item() < 0.07  # E4M3 keeps 3 mantissa bits
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                 "model.layers.0.input_layernorm.weight"):
        assert torch.equal(out[name], src[name])


# ---------------------------------------------------------------------------------------------------------------
# records, summaries, outputs
# ---------------------------------------------------------------------------------------------------------------

MISMATCH = {"token_mult_prob_error": 1.01, "kl_k1": 1e-3, "kl_k2": 1e-4, "kl_k3": 2e-4, "tis_clip_fraction": 0.0,
            "is_ratio_mean": 1.0, "max_abs_log_ratio": 0.2, "seq_geo_log_ratio_abs_max": 0.05, "tokens": 28.0}


def _record(step, reward, kl3=2e-4, tmpe=1.01):
    mm = dict(MISMATCH, kl_k3=kl3, token_mult_prob_error=tmpe)
    return RG.step_record(step, [reward, reward], [0.0, 1.0], [7, 6], mm,
                          {"ppo_clip_fraction": 0.1, "loss": -0.2, "grad_norm": 0.5},
                          {"push_s": 0.02, "rollout_s": 0.2, "train_s": 0.05})


def test_step_record_has_every_key_and_the_means():
    rec = _record(3, 0.5)
    assert tuple(rec) == RG.STEP_KEYS
    assert rec["reward"] == 0.5 and rec["exact_match"] == 0.5 and rec["response_len"] == 6.5
    assert rec["kl_k3"] == 2e-4 and rec["push_s"] == 0.02
    with pytest.raises(KeyError):
        RG.step_record(1, [1.0], [1.0], [7], {k: v for k, v in MISMATCH.items() if k != "kl_k1"},
                       {"ppo_clip_fraction": 0, "loss": 0, "grad_norm": 0}, {"push_s": 0, "rollout_s": 0, "train_s": 0})


def _results(rewards_by_arm):
    arms = {}
    for name, rewards in rewards_by_arm.items():
        arm = RL.parse_arm(name)
        kl3 = 1e-6 if arm.server == "bf16" else 1e-4
        arms[name] = {"server": arm.server, "tis": arm.tis, "evals": {"start": 0.1, "end": 0.4},
                      "records": [_record(i + 1, r, kl3=kl3) for i, r in enumerate(rewards)]}
    meta = {"steps_done": 4, "prompts_per_step": 2, "group_size": 4, "reward": "digits", "device": "cpu",
            "tis_cap": 2.0, "summary_window": 2, "timing": {"total": 12.0}}
    return {"meta": meta, "arms": arms}


def test_summaries_and_comparison_lines():
    res = _results({"bf16": [0.5, 0.5, 0.6, 0.8], "fp8_tis": [0.5, 0.5, 0.6, 0.75]})
    s = {k: RR.summarize_arm(a["records"], 2) for k, a in res["arms"].items()}
    assert s["bf16"]["reward_first"] == pytest.approx(0.5) and s["bf16"]["reward_last"] == pytest.approx(0.7)
    assert s["fp8_tis"]["kl_k3_mean"] == pytest.approx(1e-4)
    assert s["bf16"]["rollout_s_median"] == pytest.approx(0.2)
    lines = RR.compare_arms(s)
    assert len(lines) == 1 and lines[0].startswith("fp8_tis vs bf16: final reward -2.5 points")
    assert RR.compare_arms({"fp8": s["fp8_tis"]}) == []  # no baseline, no comparison
    assert RR.summarize_arm([], 10) == {"steps": 0}


def test_write_outputs_json_markdown_and_plot_message(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails: the numbers still come out
    res = _results({"bf16": [0.4, 0.6], "fp8": [0.4, 0.5], "fp8_tis": []})
    RR.write_outputs(res, str(tmp_path))
    data = json.loads((tmp_path / "rl_results.json").read_text())
    assert data["arms"]["bf16"]["summary"]["reward_last"] == pytest.approx(0.5)
    assert len(data["arms"]["fp8"]["records"]) == 2 and data["arms"]["fp8_tis"]["summary"] == {"steps": 0}
    md = (tmp_path / "summary.md").read_text()
    assert "| bf16 | bf16 | no | 0.500 -> 0.500 | 0.500 -> 0.500 | 0.100 -> 0.400 |" in md
    assert "| fp8_tis | fp8 | yes | no step |" in md
    assert "fp8 vs bf16: final reward -5.0 points" in md
    assert not (tmp_path / "rl_curves.png").exists()
    assert "matplotlib is not installed" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------
# arms, arguments, server command lines
# ---------------------------------------------------------------------------------------------------------------

def test_parse_arm():
    assert RL.parse_arm("fp8_tis") == RL.Arm("fp8_tis", "fp8", True)
    assert RL.parse_arm("bf16") == RL.Arm("bf16", "bf16", False)
    assert RL.parse_arm("fp8kv_tis") == RL.Arm("fp8kv_tis", "fp8kv", True)
    for bad in ("fp4", "fp8_tiss", "_tis"):
        with pytest.raises(ValueError, match="unknown arm"):
            RL.parse_arm(bad)


def test_parse_args_defaults_and_refusals(capsys):
    a = RL.parse_args(["--out", "x"])
    assert a.arms == ["bf16", "fp8", "fp8_tis"] and a.tis_cap == 2.0 and a.reward == "digits"
    assert a.max_seconds <= 600 and not a.dry_run
    for argv in (["--arms", "bf16", "int4"], ["--group-size", "1"], ["--minibatches", "0"]):
        with pytest.raises(SystemExit):
            RL.parse_args(["--out", "x", *argv])
    assert "unknown arm 'int4'" in capsys.readouterr().err


@pytest.fixture(scope="module")
def sglang_parser():
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import ServerArgs

    load_plugins()
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser


@pytest.mark.parametrize("kind", sorted(RE.SERVER_KINDS))
def test_server_commands_parse_with_sglangs_own_parser(kind, sglang_parser):
    args = RL.parse_args(["--out", "x", "--prompts-per-step", "32", "--group-size", "4", "--server-args",
                          "--log-level warning", "--fp8kv-server-args", "--kv-cache-dtype fp8_e5m2"])
    cmd = RE.server_command(kind, "/m", 30123, args)
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    ns = sglang_parser.parse_args(cmd[3:])
    assert ns.model_path == "/m" and ns.port == 30123 and ns.skip_tokenizer_init
    assert ns.max_total_tokens == args.max_total_tokens and ns.mem_fraction_static == args.mem_fraction_static
    assert list(ns.cuda_graph_bs_decode) == [128]  # one graph at the rollout batch size
    assert ns.log_level == "warning"  # --server-args reach every server
    assert ns.quantization == (None if kind == "bf16" else "fp8_online_blockwise")
    # --fp8kv-server-args come last on the fp8kv server only (so they win), e.g. a future --fp8rl-kv-scales
    assert ns.kv_cache_dtype == {"bf16": "auto", "fp8": "auto", "fp8kv": "fp8_e5m2"}[kind]


# ---------------------------------------------------------------------------------------------------------------
# end to end without a server
# ---------------------------------------------------------------------------------------------------------------

def test_dry_run_end_to_end(tmp_path):
    out = tmp_path / "rl"
    assert RL.main(["--out", str(out), "--steps", "2", "--arms", "bf16", "fp8", "fp8_tis", *TINY_RUN]) == 0
    data = json.loads((out / "rl_results.json").read_text())
    assert data["meta"]["steps_done"] == 2 and data["meta"]["dry_run"]
    for name in ("bf16", "fp8", "fp8_tis"):
        recs = data["arms"][name]["records"]
        assert [r["step"] for r in recs] == [1, 2]
        assert all(math.isfinite(r[k]) for r in recs for k in RG.STEP_KEYS)
        assert all(r["token_mult_prob_error"] >= 1.0 and r["kl_k3"] >= 0 for r in recs)
        assert set(data["arms"][name]["evals"]) == {"start", "end"}
    # the FP8 round trip adds to the BF16 copy's own mismatch with the fp32 trainer
    kl = {n: sum(r["kl_k3"] for r in data["arms"][n]["records"]) for n in ("bf16", "fp8")}
    assert kl["fp8"] > 3 * kl["bf16"] > 0
    rows = [ln for ln in (out / "summary.md").read_text().splitlines() if ln.startswith("| fp8")]
    assert [r.split(" | ")[1:3] for r in rows] == [["fp8", "no"], ["fp8", "cap 2.0"]]


def test_time_budget_cuts_every_arm_at_the_same_step(monkeypatch):
    """Arms run interleaved; a step starts only if the slowest recent step still fits before the deadline."""
    now = [1000.0]
    calls = []

    def fake_step(run, engine, problems, step, args, task, device):
        now[0] += 4.0  # every arm-step takes 4 s on the fake clock
        calls.append((run.arm.name, step, engine, tuple(problems)))
        return _record(step, 0.5)

    monkeypatch.setattr(RL, "run_step", fake_step)
    args = RL.parse_args(["--out", "x", "--steps", "10", "--prompts-per-step", "2"])
    runs = [RL.ArmRun(RL.parse_arm(n), None, None, None) for n in ("bf16", "fp8", "fp8_tis")]
    engines = {"bf16": "engine-bf16", "fp8": "engine-fp8"}
    deadline = now[0] + RL.RESERVE_S + 30.0  # room for two 12-s steps, not three
    done = RL.run_arms(runs, engines, args, dict(TT.DEFAULT_TASK), torch.device("cpu"), deadline, clock=lambda: now[0])
    assert done == 2
    assert [len(r.records) for r in runs] == [2, 2, 2]
    assert [(c[0], c[1], c[2]) for c in calls] == [
        ("bf16", 1, "engine-bf16"), ("fp8", 1, "engine-fp8"), ("fp8_tis", 1, "engine-fp8"),
        ("bf16", 2, "engine-bf16"), ("fp8", 2, "engine-fp8"), ("fp8_tis", 2, "engine-fp8")]
    assert len({c[3] for c in calls if c[1] == 1}) == 1  # the same prompts in every arm of a step
    assert {c[3] for c in calls if c[1] == 1} != {c[3] for c in calls if c[1] == 2}


def test_without_cuda_the_server_path_says_so(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    assert RL.main(["--out", str(tmp_path), "--steps", "1"]) == 2
    assert "--dry-run" in capsys.readouterr().err


def test_wait_ready_reports_a_server_that_exits(tmp_path):
    log = tmp_path / "server.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-c", "print('boom: no GPU'); raise SystemExit(3)"], stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)
    proc.wait(30)
    with pytest.raises(RuntimeError, match=r"exited with 3(.|\n)*boom: no GPU"):
        RL.wait_ready("http://127.0.0.1:9", proc, 30.0, str(log))


def test_stop_server_ends_the_whole_process_group():
    # a parent that starts a child in its own group, as launch_server's server starts its scheduler processes
    code = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
            " print(p.pid, flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    child = int(proc.stdout.readline())
    RL.stop_server(proc)
    assert proc.poll() is not None
    for _ in range(100):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        try:  # where this process is the reaper of orphans (PID 1 in a container), reap it
            os.waitpid(child, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.1)
    else:
        pytest.fail("the server's child process survived stop_server")
