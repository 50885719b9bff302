from orchestrate.metrics import append_metrics, plot_metrics, read_metrics, rollout_metrics
from tapes.tape import FinalAnswerAction, LLMCall, ParseFailureStep, Tape, TapeMetadata


def tape(reward, final, n_tokens, finish="stop", ref=None):
    t = Tape(metadata=TapeMetadata(reward=reward))
    call = LLMCall(output_token_ids=list(range(n_tokens)), logprobs=[-1.0] * n_tokens, finish_reason=finish,
                   ref_logprobs=ref)
    return t.append(final, llm_call=call)


def test_rollout_metrics():
    tapes = [
        tape(1.0, FinalAnswerAction(answer="1"), 10, ref=[-1.0] * 10),
        tape(0.0, FinalAnswerAction(answer="2"), 20, ref=[-1.0] * 20),
        tape(-1.0, ParseFailureStep(error="x"), 30, finish="length", ref=[-2.0] * 30),
        tape(-1.0, ParseFailureStep(error="x"), 40, ref=[-1.0] * 40),
    ]
    m = rollout_metrics(tapes, prefix="")
    assert m["reward_mean"] == -0.25 and m["success_rate"] == 0.25
    assert m["parse_failure_rate"] == 0.5 and m["truncation_rate"] == 0.25
    assert m["completion_tokens_mean"] == 25 and m["completion_tokens_max"] == 40
    # k3 on 30 of 100 tokens with ref - logp = -1: exp(-1) + 1 - 1
    import math

    assert abs(m["kl_ref"] - 30 * math.exp(-1) / 100) < 1e-9
    assert rollout_metrics(tapes, prefix="eval_")["eval_success_rate"] == 0.25


def test_metrics_file_survives_a_torn_line_and_plots(tmp_path):
    path = tmp_path / "metrics.jsonl"
    for i in range(3):
        append_metrics(path, {"iteration": i, "success_rate": 0.1 * i, "eval_success_rate": 0.2 if i == 2 else None,
                              "time_generate": 3.0, "time_train": 2.0, "time_other": 0.5})
    with open(path, "a") as f:
        f.write('{"iteration": 3, "succ')  # killed mid-write
    records = read_metrics(path)
    assert [r["iteration"] for r in records] == [0, 1, 2]
    png = plot_metrics(records, tmp_path / "plots" / "curves.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
