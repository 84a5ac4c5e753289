"""Chat prompts per benchmark: the user turn that asks for a problem, and optional few-shot exemplar turns.

Only messages are built here; the chat template (SDAR im_start or LLaDA2 role format) is applied by
`mbd.tokenizer`. A benchmark this module does not know (e.g. one registered later by another module) gets its
`prompt_text` verbatim, so it owns its own wording, and its `solution` as an exemplar's answer.

Few-shot mode (lm-eval's `--apply_chat_template --fewshot_as_multiturn` layout): each exemplar is a user turn
(the same prompt a scored problem gets) and an assistant turn (its worked solution in the answer format that
prompt asks for). Every problem of a benchmark gets the same exemplars in the same order, so all its prompts
share one long token prefix that a prefix cache serves once.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from mbd.eval.benchmarks import Problem

GSM8K_INSTRUCTION = "Please reason step by step, and put your final answer after ####."
MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
CODE_INSTRUCTION = ("Write a self-contained Python solution and put the complete code, including the function "
                    "definition and any imports, in a single ```python code block.")
_CALCULATOR = re.compile(r"<<[^<>]*>>")  # GSM8K's calculator annotations, e.g. `<<48/2=24>>`

Message = dict[str, str]


def user_prompt(problem: Problem) -> str:
    """The user message that asks the model to solve `problem`."""
    if problem.benchmark == "gsm8k":
        return f"{problem.prompt_text}\n{GSM8K_INSTRUCTION}"
    if problem.benchmark == "math500":
        return f"{problem.prompt_text}\n{MATH_INSTRUCTION}"
    if problem.benchmark in ("humaneval_plus", "humaneval"):
        code = problem.prompt_text.rstrip()
        return f"Complete the following Python function.\n```python\n{code}\n```\n{CODE_INSTRUCTION}"
    if problem.benchmark == "mbpp_plus":
        task = problem.prompt_text.strip().strip('"').strip()
        return f"{task}\n{CODE_INSTRUCTION}"
    return problem.prompt_text


def exemplar_answer(problem: Problem) -> str:
    """The assistant turn of a few-shot exemplar: `problem` solved in the format its user prompt asks for
    (GSM8K's worked solution without calculator annotations, ending `#### N`; MATH's solution with its
    `\\boxed{}`; the canonical code in one ```python block)."""
    if problem.benchmark == "gsm8k":
        return _CALCULATOR.sub("", problem.solution)
    if problem.benchmark in ("humaneval_plus", "humaneval"):
        return _python_block(problem.prompt_text + problem.reference)
    if problem.benchmark == "mbpp_plus":
        return _python_block(problem.reference)
    if not problem.solution:
        raise ValueError(f"{problem.problem_id}: no worked solution, so it cannot be a few-shot exemplar")
    return problem.solution


def chat_messages(problem: Problem, exemplars: Sequence[Problem] = ()) -> list[Message]:
    """The conversation sent for `problem`: the exemplars' user/assistant turns, then the problem's user turn."""
    turns: list[Message] = []
    for e in exemplars:
        turns += [{"role": "user", "content": user_prompt(e)}, {"role": "assistant", "content": exemplar_answer(e)}]
    return turns + [{"role": "user", "content": user_prompt(problem)}]


def _python_block(code: str) -> str:
    return f"```python\n{code.rstrip()}\n```"
