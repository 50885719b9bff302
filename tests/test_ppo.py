"""PPO with a learned critic: GAE, the value loss and the PPO loss against numbers worked out by hand; a critic
that learns a constant reward's value; the loss registry; a PPO learner killed mid-run resumes its critic."""

from __future__ import annotations

import math
import os
import signal

import pytest
import torch

from contract.batch import Sample, batch_file, read_batch, write_batch
from finetune.config import TrainConfig
from finetune.critic import explained_variance, gae, value_loss
from finetune.losses import LOSSES, LossConfig, LossInputs, PPOConfig, grpo_loss, ppo_loss
from finetune.tiny_model import make_tiny_model

# ---- GAE ------------------------------------------------------------------------------------


def test_gae_one_turn_by_hand():
    # 3 tokens, reward 1 at the last, values [0.5, 0.6, 0.8]; after the last token the value is 0.
    rewards, values, ends = [0, 0, 1], [0.5, 0.6, 0.8], [False, False, True]
    # lambda 1: every advantage is the return (1, undiscounted inside a turn) minus the value
    adv, ret = gae(rewards, values, ends, gamma=0.9, lam=1.0)
    assert adv == pytest.approx([0.5, 0.4, 0.2]) and ret == pytest.approx([1, 1, 1])
    # lambda 0.5:  delta2 = 1 - 0.8 = 0.2                     A2 = 0.2
    #              delta1 = 0 + 0.8 - 0.6 = 0.2               A1 = 0.2 + 0.5 * 0.2 = 0.3
    #              delta0 = 0 + 0.6 - 0.5 = 0.1               A0 = 0.1 + 0.5 * 0.3 = 0.25
    adv, ret = gae(rewards, values, ends, gamma=0.9, lam=0.5)
    assert adv == pytest.approx([0.25, 0.3, 0.2]) and ret == pytest.approx([0.75, 0.9, 1.0])


def test_gae_two_turns_by_hand():
    # turn 1 = tokens 0, 1 (reward 0.5 at token 1), turn 2 = tokens 2, 3 (reward 1 at token 3); gamma 0.9
    # applies from the end of turn 1 to turn 2, not between tokens of a turn.
    rewards, values, ends = [0, 0.5, 0, 1], [0.2, 0.3, 0.4, 0.6], [False, True, False, True]
    # lambda 1:  A3 = 1 - 0.6 = 0.4
    #            A2 = (0 + 0.6 - 0.4) + 0.4 = 0.6
    #            A1 = (0.5 + 0.9 * 0.4 - 0.3) + 0.9 * 0.6 = 0.56 + 0.54 = 1.1
    #            A0 = (0 + 0.3 - 0.2) + 1.1 = 1.2
    # returns = A + V = [1.4, 1.4, 1.0, 1.0]: the turn returns G_1 = 0.5 + 0.9 * 1 and G_2 = 1
    adv, ret = gae(rewards, values, ends, gamma=0.9, lam=1.0)
    assert adv == pytest.approx([1.2, 1.1, 0.6, 0.4]) and ret == pytest.approx([1.4, 1.4, 1.0, 1.0])
    # lambda 0.5: A3 = 0.4, A2 = 0.2 + 0.5 * 0.4 = 0.4, A1 = 0.56 + 0.9 * 0.5 * 0.4 = 0.74,
    #             A0 = 0.1 + 0.5 * 0.74 = 0.47
    adv, _ = gae(rewards, values, ends, gamma=0.9, lam=0.5)
    assert adv == pytest.approx([0.47, 0.74, 0.4, 0.4])


def test_gae_truncated_episode_is_not_bootstrapped():
    # Cut at its turn limit with a -0.1 truncation reward: the critic predicted 0.5 for what would follow,
    # but the episode is over, so the target is the reward itself.
    adv, ret = gae([0, -0.1], [0.5, 0.5], [False, True], gamma=0.9, lam=1.0)
    assert adv == pytest.approx([-0.6, -0.6]) and ret == pytest.approx([-0.1, -0.1])


# ---- value loss, PPO loss, explained variance -----------------------------------------------------


def test_value_loss_by_hand():
    # clip 0.2 around the old values 0.8:
    #   t0 V=1.1 R=0:   plain 1.21, clipped V 1.0 -> 1.0;   max 1.21 -> 0.605, gradient V - R = 1.1
    #   t1 V=0.5 R=1:   plain 0.25, clipped V 0.6 -> 0.16;  max 0.25 -> 0.125, gradient -0.5
    #   t2 V=0.5 R=0.3: plain 0.04, clipped V 0.6 -> 0.09;  max 0.09 -> 0.045, clipped: no gradient
    values = torch.tensor([1.1, 0.5, 0.5], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([0.8, 0.8, 0.8], dtype=torch.float64)
    returns = torch.tensor([0.0, 1.0, 0.3], dtype=torch.float64)
    loss, clipped = value_loss(values, old, returns, 0.2)
    assert loss.tolist() == pytest.approx([0.605, 0.125, 0.045])
    assert clipped.tolist() == [False, False, True]
    (grad,) = torch.autograd.grad(loss.sum(), values)
    assert grad.tolist() == pytest.approx([1.1, -0.5, 0.0])
    plain, none = value_loss(values, old, returns, 0.0)  # no clipping
    assert plain.tolist() == pytest.approx([0.605, 0.125, 0.02]) and not none.any()


def test_ppo_loss_is_the_clipped_policy_term_plus_the_value_term():
    # The policy term is GRPO's (same clip); the value term is vf_coef x the weighted value loss.
    logp = torch.tensor([-0.5, -1.0, -2.0], dtype=torch.float64, requires_grad=True)
    behaviour = torch.tensor([-0.6, -0.9, -2.5], dtype=torch.float64)
    adv = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)
    weights = torch.full((3,), 1 / 3, dtype=torch.float64)
    values = torch.tensor([1.1, 0.5, 0.5], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([0.8, 0.8, 0.8], dtype=torch.float64)
    returns = torch.tensor([0.0, 1.0, 0.3], dtype=torch.float64)
    options = PPOConfig(vf_coef=0.5, value_clip=0.2)
    x = LossInputs(
        logp=logp,
        behaviour_logp=behaviour,
        advantages=adv,
        weights=weights,
        values=values,
        old_values=old,
        returns=returns,
    )
    out = ppo_loss(x, options)
    # ratios exp(0.1) = 1.10517, exp(-0.1) = 0.904837, exp(0.5) = 1.64872 (clipped at 1.2 with A > 0)
    pg = -(1.10517 * 1.0 + 0.904837 * -0.5 + 1.2 * 2.0) / 3
    vf = (0.605 + 0.125 + 0.045) / 3
    assert out.terms["pg_loss"].item() == pytest.approx(pg, abs=1e-5)
    assert out.terms["value_loss"].item() == pytest.approx(vf, abs=1e-9)
    assert out.loss.item() == pytest.approx(pg + 0.5 * vf, abs=1e-5)
    assert out.token_means["vf_clip_frac"].tolist() == [0, 0, 1]
    grpo = grpo_loss(LossInputs(logp=logp, behaviour_logp=behaviour, advantages=adv, weights=weights), options)
    assert out.terms["pg_loss"].item() == pytest.approx(grpo.loss.item(), abs=1e-12)
    with pytest.raises(ValueError, match="critic"):
        ppo_loss(LossInputs(logp=logp, behaviour_logp=behaviour, advantages=adv, weights=weights), options)


def test_explained_variance_by_hand():
    # R = [1, 2, 4]: Var 14/9; R - V = [0, 0, 1]: Var 2/9; 1 - (2/9) / (14/9) = 6/7
    assert explained_variance(torch.tensor([1.0, 2, 3]), torch.tensor([1.0, 2, 4])) == pytest.approx(6 / 7)
    assert explained_variance(torch.tensor([1.0, 2, 4]), torch.tensor([1.0, 2, 4])) == pytest.approx(1.0)
    assert math.isnan(explained_variance(torch.tensor([0.0, 1]), torch.tensor([1.0, 1])))


def test_every_registered_loss_has_its_section_in_the_config():
    """Adding a loss is one function and one config class: the config grows a section by itself."""
    for name, spec in LOSSES.items():
        assert issubclass(spec.config, LossConfig)
        assert TrainConfig.model_fields[name].annotation is spec.config
    cfg = TrainConfig(algorithm="ppo", ppo={"vf_coef": 0.25})
    assert cfg.loss_spec is LOSSES["ppo"] and cfg.loss_spec.critic and cfg.loss_options.vf_coef == 0.25
    assert TrainConfig.model_validate(cfg.model_dump()) == cfg  # the trainer's config file round-trips
    with pytest.raises(ValueError, match="ppo"):
        TrainConfig(algorithm="grpo", ppo={"vf_coef": 0.25})
    assert TrainConfig(algorithm="ppo", ppo={"kl_in_reward": 0.1}).needs_reference
    assert not TrainConfig(algorithm="ppo").needs_reference


# ---- the critic in the learner -----------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def constant_batch(seed: int, reward: float = 1.0) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    samples = []
    for group in range(4):
        prompt = torch.randint(0, 256, (6,), generator=g).tolist()
        for _k in range(2):
            n = int(torch.randint(2, 6, (1,), generator=g))
            samples.append(
                Sample(
                    prompt_ids=prompt,
                    completion_ids=torch.randint(0, 256, (n,), generator=g).tolist(),
                    behaviour_logprobs=[-5.5] * n,
                    reward=reward,
                    group_id=f"{seed}-{group}",
                )
            )
    return samples


@pytest.mark.parametrize("critic", ["separate", "head"])
def test_critic_learns_a_constant_rewards_value(tiny, critic):
    from finetune.learner import Learner

    cfg = TrainConfig(
        algorithm="ppo",
        lr=1e-6,
        token_budget=256,
        ppo={"critic": critic, "critic_lr": 1e-2, "vf_coef": 1.0, "value_clip": 0.0},
    )
    learner = Learner(tiny, cfg)
    means = []
    for step in range(60):
        metrics = learner.train_batch(constant_batch(step % 3), step)
        means.append(metrics[-1]["value_mean"])
    # Values start at 0 (zero-initialised head) and settle at the reward, 1 (undiscounted inside a turn).
    assert means[0] == pytest.approx(0.0, abs=1e-6)
    last = sum(means[-6:]) / 6
    assert abs(last - 1.0) < 0.1, means
    m = metrics[-1]
    for key in ("value_loss", "vf_clip_frac", "explained_variance", "returns_mean", "clip_frac", "ratio_max"):
        assert key in m, key
    assert m["returns_mean"] == pytest.approx(1.0)
    assert learner.turn_records[0]["turns"][0]["value"] == pytest.approx(1.0, abs=0.3)


def test_ppo_on_multi_turn_episodes_puts_each_turns_reward_at_its_last_token(tiny):
    """An episode in one sample, two turns: with a zero critic and lambda 1, each token's advantage (before
    whitening) is the discounted return of its turn."""
    from finetune.learner import Learner

    cfg = TrainConfig(algorithm="ppo", gamma=0.5, token_budget=256, ppo={"whiten_advantages": False, "critic": "head"})
    learner = Learner(tiny, cfg)
    sample = Sample(
        prompt_ids=[1, 2, 3],
        completion_ids=[4, 5, 6, 7, 8, 9, 10],
        behaviour_logprobs=[-5.0] * 5,
        reward=3.0,
        group_id="g",
        episode_id="e",
        turns=[
            {"index": 0, "start": 0, "length": 2, "reward": 1.0},
            {"index": 1, "start": 4, "length": 3, "reward": 2.0},
        ],
    )
    critic = learner.critic_batch([sample])
    advantages, old, returns = critic.advantages, critic.old_values, critic.returns
    assert old[0].tolist() == [0.0] * 5
    # turn 1: 1 + 0.5 * 2 = 2; turn 2: 2
    assert advantages[0].tolist() == pytest.approx([2, 2, 2, 2, 2]) and returns[0].tolist() == pytest.approx([2] * 5)


def test_kl_in_reward_at_a_temperature_compares_untempered_logprobs(tiny):
    """Sampled at T = 0.7 and scored by a reference that is the policy itself (at T = 1, as vLLM scores it):
    the KL penalty in the reward is 0, not the gap between the tempered and untempered log-probs (which
    penalised the temperature itself, and rewarded unlikely tokens)."""
    from finetune.learner import Learner

    cfg = TrainConfig(algorithm="ppo", token_budget=256, ppo={"whiten_advantages": False, "critic": "head",
                                                             "kl_in_reward": 0.5})  # fmt: skip
    learner = Learner(tiny, cfg)
    sample = Sample(prompt_ids=[1, 2, 3], completion_ids=[4, 5, 6, 7], behaviour_logprobs=[0.0] * 4, reward=0.0,
                    group_id="g", episode_id="e", temperature=0.7)  # fmt: skip
    tempered = learner.logprobs([sample])[0].tolist()
    untempered = learner.untempered_logprobs([sample])[0].tolist()
    assert max(abs(a - b) for a, b in zip(tempered, untempered)) > 0.05
    sample = sample.model_copy(update={"behaviour_logprobs": tempered, "ref_logprobs": untempered})
    critic = learner.critic_batch([sample])
    assert critic.returns[0].tolist() == pytest.approx([0.0] * 4, abs=1e-5)  # no reward, no KL: lambda 1
    with pytest.raises(ValueError, match="untempered"):
        learner.critic.rewards(sample)


def test_ppo_trains_with_its_critic_whatever_estimator_its_config_names(tiny):
    """PPO's config names an estimator like every algorithm's (finetune.algorithms), but the critic's GAE
    takes the estimator's place: another estimator trains the same step, with the same advantages."""
    from finetune.learner import Learner

    runs = []
    for estimator in ("group", "rloo"):
        cfg = TrainConfig(algorithm="ppo", estimator=estimator, lr=1e-4, token_budget=256, ppo={"critic": "head"})
        learner = Learner(tiny, cfg)
        batch = [s.model_copy(update={"reward": float(i % 3)}) for i, s in enumerate(constant_batch(0))]
        metrics = learner.train_batch(batch, 1)  # rewards that differ within groups: group and rloo differ
        runs.append((learner.turn_records, [m["loss"] for m in metrics]))
    assert runs[0] == runs[1]


@pytest.mark.slow
def test_ppo_learner_killed_mid_run_resumes_policy_and_critic(tiny, tmp_path):
    from test_finetune_process import launch, stop, wait_for, weights

    from finetune.learner import Learner

    options = [
        "--algorithm",
        "ppo",
        "--lr",
        "1e-3",
        "--epochs",
        "2",
        "--token-budget",
        "64",
        "--ppo.critic-lr",
        "1e-3",
        "--ppo.gae-lambda",
        "0.95",
        "--save-state-every",  # the full state (policy, critic, both optimizers) with every batch
        "1",
    ]
    cfg = TrainConfig(algorithm="ppo", lr=1e-3, epochs=2, token_budget=64, ppo={"critic_lr": 1e-3, "gae_lambda": 0.95})
    batches = [constant_batch(1, 1.0), constant_batch(2, 0.0)]
    for samples, reward in zip(batches, (1.0, 0.0)):  # mixed rewards inside a batch
        for s in samples[::2]:
            s.reward = 1.0 - reward

    # The same two batches in this process, without interruption: the reference.
    learner = Learner(tiny, cfg)
    for index, samples in enumerate(batches, 1):
        learner.train_batch(samples, index)
    policy = {k: v.detach().clone() for k, v in learner.accelerator.unwrap_model(learner.model).lm.state_dict().items()}
    critic = {
        k: v.detach().clone() for k, v in learner.accelerator.unwrap_model(learner.value_model).state_dict().items()
    }

    run = tmp_path / "run"
    write_batch(batch_file(run / "batches", 1), batches[0])
    proc = launch(tiny, run, options=options)
    wait_for(run / "checkpoints" / "000001" / "trainer_state" / "progress.json", proc, run)  # its full state
    os.killpg(proc.pid, signal.SIGKILL)  # kill -9, launcher and learner
    proc.wait()
    write_batch(batch_file(run / "batches", 2), batches[1])
    proc = launch(tiny, run, options=options)
    wait_for(run / "checkpoints" / "000002", proc, run)
    stop(proc, run)
    assert "resumed from" in (run / "trainer.log").read_text()

    for k, v in weights(run / "checkpoints" / "000002").items():  # the policy vLLM would load
        torch.testing.assert_close(v, policy[k], atol=1e-6, rtol=0, msg=k)
    assert not any("value_head" in k for k in weights(run / "checkpoints" / "000002"))
    resumed = Learner(tiny, cfg)
    resumed.load_trainer_state(run / "checkpoints" / "000002")
    got = resumed.accelerator.unwrap_model(resumed.value_model).state_dict()
    for k, v in critic.items():
        torch.testing.assert_close(got[k], v, atol=1e-6, rtol=0, msg=k)
    assert resumed.step == learner.step == 4
    lines = [m for m in map(__import__("json").loads, (run / "train_metrics.jsonl").read_text().splitlines())]
    assert [m["batch"] for m in lines] == [1, 1, 2, 2]
    assert all("value_loss" in m and "explained_variance" in m for m in lines)
    assert read_batch(batch_file(run / "batches", 2))  # the batch files stay


def test_critic_step_trains_the_critic_alone(tiny):
    """Learner.critic_step (bench/bench_critic.py's replay): the value loss falls towards the returns and the
    policy's weights do not move."""
    from finetune.learner import Learner

    cfg = TrainConfig(algorithm="ppo", token_budget=256, ppo={"critic_lr": 1e-2, "value_clip": 0.0})
    learner = Learner(tiny, cfg)
    samples = constant_batch(0)
    before = learner._fingerprint()
    critic = learner.critic_batch(samples)
    stats = critic.stats
    assert stats["value_mean"] == pytest.approx(0.0, abs=1e-6) and stats["returns_mean"] == pytest.approx(1.0)
    losses = [learner.critic_step(samples, critic)["value_loss"] for _ in range(5)]
    assert losses[0] == pytest.approx(0.5)  # 0.5 (V - R)^2 with V = 0, R = 1, averaged over tokens
    assert losses[-1] < 0.5 * losses[0], losses
    assert torch.equal(learner._fingerprint(), before)
    head = Learner(tiny, TrainConfig(algorithm="ppo", token_budget=256, ppo={"critic": "head"}))
    with pytest.raises(ValueError, match="separate value model"):
        head.critic_step(samples, critic)
