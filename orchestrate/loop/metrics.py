"""Per-iteration metrics: computed from tapes, appended to metrics.jsonl, drawn as a PNG.

One line per iteration, so a run can be followed with `tail -f` and its
curves redrawn at any time from the file alone. When a run resumes, `repair_metrics` drops the torn
tail and the records state.json does not count yet (a crash between the metrics append and state.json), so
that iteration's record is written once, when it is redone.
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agents.agent import role_rewards
from contract.durable import atomic_write_bytes
from contract.kl import k3
from tapes.tape import EnvObservation, Tape, ToolCallAction, ToolResultObservation

# Where an iteration's time goes; "other" is the rest of its wall time.
PHASES = ("generate", "reward", "reference", "train", "weight_sync", "eval")


def server_metrics(requests: list[int], retries: int, taken_out: int) -> dict[str, int]:
    """The policy servers' share of the work since the last record: requests answered by each (in the
    order of --server.policy_urls, or of the servers started), requests retried on another server or after
    an error, and times a server was taken out of the pool."""
    out = {f"server_{i}_requests": n for i, n in enumerate(requests)}
    out.update(server_retries=retries, server_taken_out=taken_out)
    return out


def rollout_metrics(tapes: list[Tape], prefix: str = "") -> dict[str, float]:
    """Episode returns, success (the environment's own notion), turns, format errors, truncations,
    completion lengths and the tokens generated (a fork's own calls: those it replayed are its parent's),
    prompt chaining, infrastructure failures, KL to the reference."""
    if not tapes:
        return {}
    ok = [t for t in tapes if not t.metadata.error]  # infrastructure failures are counted, not scored
    calls = [c for t in ok for c in t.llm_calls[t.metadata.branch_at or 0 :]]  # a fork's own: not the replayed
    lengths = [len(c.output_token_ids) for c in calls]
    observations = [s for t in ok for s in t.steps if isinstance(s, EnvObservation) and s.turn > 0]
    out = {
        "reward_mean": statistics.fmean(t.metadata.reward or 0.0 for t in ok) if ok else 0.0,
        "success_rate": sum(bool(t.metadata.success) for t in ok) / max(1, len(ok)),
        "turns_mean": statistics.fmean(t.metadata.turns for t in ok) if ok else 0.0,
        # share of episodes with an action the environment could not parse (no \boxed{}, ...)
        "parse_failure_rate": sum(
            any(isinstance(s, EnvObservation) and s.info.get("format_error") for s in t.steps) for t in ok
        )
        / max(1, len(ok)),
        "truncation_rate": sum(c.finish_reason == "length" for c in calls) / max(1, len(calls)),
        "episode_truncated_rate": sum(t.metadata.truncated for t in ok) / max(1, len(ok)),
        "completion_tokens_mean": statistics.fmean(lengths) if lengths else 0.0,
        "completion_tokens_max": max(lengths, default=0),
        "generated_tokens": sum(lengths),
        "env_reward_per_turn": statistics.fmean(s.reward or 0.0 for s in observations) if observations else 0.0,
        # calls whose prompt is not exactly the previous prompt + output + the observation's tokens
        "prompt_mismatches": sum(c.extends_previous is False for c in calls),
        "tapes": len(tapes),
        "infra_errors": len(tapes) - len(ok),
    }
    tool_calls = [sum(isinstance(s, ToolCallAction) for s in t.steps) for t in ok]
    if any(tool_calls):  # an environment with tools: how much the agent uses them, and how often they fail
        results = [s for t in ok for s in t.steps if isinstance(s, ToolResultObservation)]
        out["tool_calls_mean"] = statistics.fmean(tool_calls)
        out["tool_episode_rate"] = sum(n > 0 for n in tool_calls) / len(ok)
        # share of tool calls whose run failed (exception, non-zero exit, timeout, limit)
        out["tool_error_rate"] = sum(bool(s.info.get("tool_error")) for s in results) / max(1, len(results))
    by_role: dict[str, list[float]] = {}
    for t in ok:  # several agents in one episode (agent.roles): each role's reward and success
        for role, reward in role_rewards(t).items():
            by_role.setdefault(role, []).append(reward)
    for role, rewards in by_role.items():
        out[f"reward_mean_{role}"] = statistics.fmean(rewards)
        out[f"success_rate_{role}"] = sum(r > 0 for r in rewards) / len(rewards)
    swapped = [c for c in calls if c.version_changes]
    if swapped:  # --run.in_flight_swaps: calls that new weights took over before they ended
        out["swapped_call_rate"] = len(swapped) / len(calls)
    with_ref = [c for c in calls if c.ref_logprobs]
    if with_ref:  # k3 estimate of KL(policy || reference) on the sampled tokens
        kls = [k3(p, r) for c in with_ref for p, r in zip(c.logprobs, c.ref_logprobs)]
        out["kl_ref"] = statistics.fmean(kls)
    return {f"{prefix}{k}": v for k, v in out.items()}


def append_metrics(path: str | os.PathLike, record: dict[str, Any]) -> None:
    """Append one JSON line and fsync it: whole or not at all, a torn tail cut first (contract/durable.py)."""
    from contract.durable import append_line

    append_line(path, json.dumps(record))


def version_clock(records: list[dict[str, Any]]) -> dict[int, tuple[float, float]]:
    """When each version of a run came, from its metrics: version N is served from the end of iteration N (its
    record's elapsed_s, less the evaluation of version N recorded with it; version 0 from the start) ->
    (seconds of the run's commands so far, the same less the held-out evaluations' seconds before it: the time
    training took). A resumed run's clock goes on from where the killed command's last record left it; a new
    command is known by its start (wall_time - elapsed_s), else by elapsed_s going back. Evaluations that
    overlapped training (eval.overlap, async_level) are left out of the training seconds whole."""
    clock, offset, last, evaluating, command = {0: (0.0, 0.0)}, 0.0, 0.0, 0.0, None
    for r in records:
        if "elapsed_s" not in r or "iteration" not in r:
            continue
        started = r["wall_time"] - r["elapsed_s"] if "wall_time" in r else None
        new = abs(started - command) > 1.0 if started is not None and command is not None else r["elapsed_s"] < last
        if new:  # a resumed run's next command: its elapsed_s starts again
            offset += last
        command, last = started, r["elapsed_s"]
        own = r.get("time_eval") or 0.0
        seconds = offset + last - own
        if r["iteration"] > 0:  # iteration 0's record is the initial evaluation: version 0 was there before it
            clock[int(r["iteration"])] = (seconds, seconds - evaluating)
        evaluating += own
    return clock


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line torn by a crash mid-write
    return records


def _legend(ax, **kw) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, **kw)


def plot_metrics(records: list[dict[str, Any]], out: str | os.PathLike) -> Path | None:
    """Draw reward, success (train and held-out), KL, lengths and the time split into one PNG."""
    if not records:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    _success_panel(axes[0][0], records)
    _reward_panel(axes[0][1], records)
    _lengths_panel(axes[1][0], records)
    _time_panel(axes[1][1], records)
    for ax in axes.flat:
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return save_figure(fig, out)


def save_figure(fig, out: str | os.PathLike) -> Path:
    """`fig` as a PNG at `out`, written whole (a reader never sees a half-drawn plot), then closed."""
    import matplotlib.pyplot as plt

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.stem}.tmp.png")
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    os.replace(tmp, out)
    return out


def _curve(ax, records: list[dict[str, Any]], key: str, label: str, **kw) -> None:
    """`key` per iteration, over the iterations that recorded it."""
    pts = [(r["iteration"], r[key]) for r in records if r.get(key) is not None]
    if pts:
        ax.plot(*zip(*pts), marker="o", markersize=3, label=label, **kw)


def _success_panel(ax, records: list[dict[str, Any]]) -> None:
    _curve(ax, records, "success_rate", "train success")
    _curve(ax, records, "eval_success_rate", "held-out success", linewidth=2)
    _curve(ax, records, "parse_failure_rate", "parse failures", linestyle=":")
    ax.set_title("success")
    ax.set_ylim(-0.02, 1.02)
    _legend(ax)
    if any(r.get("tool_calls_mean") is not None for r in records):  # an environment with tools
        ax2 = ax.twinx()
        _curve(ax2, records, "tool_calls_mean", "tool calls per episode", color="tab:olive", linestyle="--")
        _curve(ax2, records, "tool_error_rate", "tool errors (share of calls)", color="tab:red", linestyle="--")
        ax2.set_ylim(bottom=0)
        _legend(ax2, loc="lower right")


def _reward_panel(ax, records: list[dict[str, Any]]) -> None:
    _curve(ax, records, "reward_mean", "reward mean")
    _curve(ax, records, "eval_reward_mean", "held-out reward mean")
    ax.set_title("reward")
    _legend(ax)
    if any(r.get("train_explained_variance") is not None for r in records):  # PPO's critic
        ax2 = ax.twinx()
        _curve(
            ax2, records, "train_explained_variance", "critic: explained variance", color="tab:purple", linestyle="--"
        )
        _curve(ax2, records, "train_value_mean", "critic: value mean", color="tab:brown", linestyle="--")
        _legend(ax2, loc="lower right")


def _lengths_panel(ax, records: list[dict[str, Any]]) -> None:
    _curve(ax, records, "completion_tokens_mean", "completion tokens (mean)")
    ax2 = ax.twinx()
    _curve(ax2, records, "kl_ref", "KL to reference", color="tab:red")
    _curve(ax2, records, "train_entropy", "entropy", color="tab:green")
    ax.set_title("lengths, KL, entropy")
    _legend(ax, loc="upper left")
    _legend(ax2, loc="upper right")


def _time_panel(ax, records: list[dict[str, Any]]) -> None:
    """Seconds per iteration, stacked by phase."""
    x = [r["iteration"] for r in records]
    bottom = [0.0] * len(records)
    for phase in (*PHASES, "other"):
        values = [r.get(f"time_{phase}", 0.0) for r in records]
        if any(values):
            ax.bar(x, values, bottom=bottom, label=phase)
            bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_title("seconds per iteration")
    _legend(ax)


def repair_jsonl(path: str | os.PathLike, keep: Callable[[dict], bool]) -> int:
    """Keep the whole records that `keep` accepts, each iteration once; returns how many lines were dropped."""
    path = Path(path)
    if not path.exists():
        return 0
    data = path.read_bytes()
    lines = [raw for raw in data.split(b"\n") if raw.strip()]
    kept, seen = [], set()
    for raw in lines:
        try:
            record = json.loads(raw)
        except ValueError:
            continue
        if not isinstance(record, dict) or not keep(record):
            continue
        if (key := record.get("iteration")) is not None:
            if key in seen:
                continue
            seen.add(key)
        kept.append(raw)
    new = b"".join(raw + b"\n" for raw in kept)
    if new != data:
        atomic_write_bytes(path, new)
    return len(lines) - len(kept)


def repair_metrics(path: str | os.PathLike, completed_iteration: int, evaluated: list[int]) -> int:
    """metrics.jsonl as state.json knows it: iteration records up to `completed_iteration`, the
    evaluation before training (iteration 0) only if it is in `evaluated`."""

    def keep(record: dict) -> bool:
        it = record.get("iteration")
        if not isinstance(it, int):
            return True  # not ours to judge
        return it in evaluated if it == 0 else it <= completed_iteration

    return repair_jsonl(path, keep)
