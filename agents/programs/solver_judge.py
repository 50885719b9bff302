"""Two agents in one episode, each a role of the run (`--preset solver_judge`, `--agent.roles`): a solver answers
an arithmetic task, then a judge reads the task and the solver's answer and says whether it is right.

Each role calls the gateway by its own `model` name ("solver", "judge"), so each call is recorded on the tape
with its role, and the run credits each role apart: the solver's reward is the environment's (its answer
scored, on the solver's turn), the judge's is 1 when its verdict matches that score, 0 when it does not, and
-0.1 when no verdict can be read (`task.reward(value, role="judge")`). Both roles are bound to the policy
here: one set of weights plays both parts, each role's calls grouped and normalised with the same role's.
"""

from __future__ import annotations

import re

SOLVER, JUDGE = "solver", "judge"
ROLES = (SOLVER, JUDGE)  # the `model` names it sends: a run refuses to start without each bound (--agent.roles)
INSTRUCTION = "Put the final answer in \\boxed{}."
SOLVER_EXAMPLE = [
    {"role": "user", "content": f"What is 31 + 46?\n{INSTRUCTION}"},
    {"role": "assistant", "content": "31 + 46 = 77. The answer is \\boxed{77}."},
]
QUESTION = "Task: {task}\nProposed answer: {answer}\nIs the proposed final answer correct? Reply \\boxed{{yes}} or \\boxed{{no}}."
JUDGE_EXAMPLE = [
    {"role": "user", "content": QUESTION.format(task="What is 12 + 30?", answer="12 + 30 = 42. \\boxed{42}")},
    {"role": "assistant", "content": "12 + 30 = 42, so the answer is right: \\boxed{yes}"},
    {"role": "user", "content": QUESTION.format(task="What is 25 + 18?", answer="25 + 18 = 33. \\boxed{33}")},
    {"role": "assistant", "content": "25 + 18 = 43, not 33: \\boxed{no}"},
]
VERDICT = re.compile(r"\\boxed\{\s*(yes|no)\s*\}", re.IGNORECASE)
UNREAD = -0.1  # the judge's reward when no verdict can be read


def verdict_reward(text: str, right: bool) -> float:
    """The judge's reward for `text` about an answer that is `right` (its last verdict counts)."""
    found = VERDICT.findall(text)
    if not found:
        return UNREAD
    return float((found[-1].lower() == "yes") == right)


async def play(task, client):
    solved = await client.chat.completions.create(
        model=SOLVER, messages=[*SOLVER_EXAMPLE, {"role": "user", "content": f"{task.observation}\n{INSTRUCTION}"}]
    )
    answer = solved.choices[0].message.content or ""
    scored = await task.step(answer)  # the environment scores the solver's answer, on the solver's turn
    judged = await client.chat.completions.create(
        model=JUDGE,
        messages=[*JUDGE_EXAMPLE, {"role": "user", "content": QUESTION.format(task=task.observation, answer=answer)}],
    )
    task.reward(verdict_reward(judged.choices[0].message.content or "", scored.reward > 0), role=JUDGE)
    return None  # the rewards given stand
