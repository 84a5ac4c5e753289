"""User-turn prompts per benchmark (code extraction from completions is in `mbd.eval.code_extract`).

Only the user message is built here; the chat template (SDAR im_start or LLaDA2 role format) is
applied by `mbd.tokenizer`. A benchmark this module does not know (e.g. one registered later by
another module) gets its `prompt_text` verbatim, so it owns its own wording.
"""

from __future__ import annotations

from mbd.eval.benchmarks import Problem

GSM8K_INSTRUCTION = "Please reason step by step, and put your final answer after ####."
MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
CODE_INSTRUCTION = ("Write a self-contained Python solution and put the complete code, including the function "
                    "definition and any imports, in a single ```python code block.")


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
