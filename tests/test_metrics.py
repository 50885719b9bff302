import math

from orchestrate.loop.metrics import append_metrics, plot_metrics, read_metrics, rollout_metrics
from tapes.tape import EnvAction, EnvObservation, LLMCall, Tape, TapeMetadata, ToolCallAction, ToolResultObservation


def tape(rewards, n_tokens, finish="stop", ref=None, success=None, format_error=False, error=None, chain_ok=True):
    """An episode with one call per reward; the last observation carries success / format_error."""
    t = Tape(metadata=TapeMetadata(reward=sum(rewards), turns=len(rewards), success=success, error=error))
    t.append(EnvObservation(text="start"))
    for turn, reward in enumerate(rewards, start=1):
        call = LLMCall(
            output_token_ids=list(range(n_tokens)),
            logprobs=[-1.0] * n_tokens,
            finish_reason=finish,
            ref_logprobs=ref,
            turn=turn,
            extends_previous=None if turn == 1 else chain_ok,
        )
        t.append(EnvAction(text="x", turn=turn), llm_call=call)
        last = turn == len(rewards)
        t.append(
            EnvObservation(
                text="y", turn=turn, reward=reward, terminated=last, info={"format_error": format_error and last}
            )
        )
    return t


def test_rollout_metrics():
    tapes = [
        tape([1.0], 10, ref=[-1.0] * 10, success=True),
        tape([0.0, 0.0], 20, ref=[-1.0] * 20, success=False),  # two turns: two calls
        tape([-1.0], 30, finish="length", ref=[-2.0] * 30, success=False),
        tape([-1.0], 40, ref=[-1.0] * 40, success=False, format_error=True, chain_ok=False),
        tape([0.0], 5, success=False, error="RuntimeError: env crashed"),  # counted, not scored
    ]
    m = rollout_metrics(tapes, prefix="")
    assert m["reward_mean"] == -0.25 and m["success_rate"] == 0.25 and m["infra_errors"] == 1 and m["tapes"] == 5
    assert m["turns_mean"] == 1.25 and m["parse_failure_rate"] == 0.25
    assert m["truncation_rate"] == 0.2  # 1 of 5 calls cut by max_tokens
    assert m["completion_tokens_mean"] == (10 + 20 + 20 + 30 + 40) / 5 and m["completion_tokens_max"] == 40
    assert m["prompt_mismatches"] == 0  # one-turn episodes have no previous call; the 2-turn one chains
    # k3 on 30 of 120 tokens with ref - logp = -1: exp(-1) + 1 - 1
    assert abs(m["kl_ref"] - 30 * math.exp(-1) / 120) < 1e-9
    assert rollout_metrics(tapes, prefix="eval_")["eval_success_rate"] == 0.25
    broken = tape([0.0, 1.0], 3, chain_ok=False)
    assert rollout_metrics([broken])["prompt_mismatches"] == 1


def tool_tape(errors: list[bool]) -> Tape:
    """An episode that calls the python tool once per entry of `errors` (True: that run failed), then answers."""
    t = Tape(metadata=TapeMetadata(reward=1.0, turns=len(errors) + 1, success=True))
    t.append(EnvObservation(text="What is 123 * 456?"))
    for turn, failed in enumerate(errors, start=1):
        t.append(ToolCallAction(text="<python>x</python>", turn=turn, tool="python", call="x"))
        t.append(
            ToolResultObservation(
                text="<output></output>", turn=turn, tool="python", reward=0.0, info={"tool_error": failed}
            )
        )
    t.append(EnvAction(text="\\boxed{56088}", turn=len(errors) + 1))
    t.append(EnvObservation(text="", turn=len(errors) + 1, reward=1.0, terminated=True, info={"success": True}))
    return t


def test_tool_metrics_count_calls_per_episode_and_failed_runs():
    tapes = [tool_tape([True, False]), tool_tape([False]), tool_tape([])]
    m = rollout_metrics(tapes, prefix="eval_")
    assert m["eval_tool_calls_mean"] == 1.0  # 3 calls over 3 episodes
    assert abs(m["eval_tool_episode_rate"] - 2 / 3) < 1e-12 and abs(m["eval_tool_error_rate"] - 1 / 3) < 1e-12
    assert "tool_calls_mean" not in rollout_metrics([tape([1.0], 3)])  # no tools, no tool metrics


def test_metrics_file_survives_a_torn_line_and_plots(tmp_path):
    path = tmp_path / "metrics.jsonl"
    for i in range(3):
        append_metrics(
            path,
            {
                "iteration": i,
                "success_rate": 0.1 * i,
                "eval_success_rate": 0.2 if i == 2 else None,
                "time_generate": 3.0,
                "time_train": 2.0,
                "time_other": 0.5,
                "tool_calls_mean": 0.5 * i,
                "tool_error_rate": 0.1,
            },
        )
    with open(path, "a") as f:
        f.write('{"iteration": 3, "succ')  # killed mid-write
    records = read_metrics(path)
    assert [r["iteration"] for r in records] == [0, 1, 2]
    png = plot_metrics(records, tmp_path / "plots" / "curves.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_busy_fractions_split_an_iterations_wall_time():
    from orchestrate.loop.report import busy_fractions

    record = {"time_total": 100.0, "train_seconds": 80.0, "time_generate": 30.0, "time_eval": 10.0}
    assert busy_fractions(record) == {"trainer_busy_frac": 0.8, "generator_busy_frac": 0.4,
                                      "trainer_wait_s": 20.0, "generator_idle_s": 60.0}  # fmt: skip
    # the trainer's seconds of a batch can exceed a short record's window (it trained during the previous one)
    assert busy_fractions({"time_total": 10.0, "train_seconds": 15.0})["trainer_busy_frac"] == 1.0
    assert busy_fractions({"time_total": 0.0}) == {}
