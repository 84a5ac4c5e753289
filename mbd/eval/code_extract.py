"""The program to test from a model's completion: fenced or bare code, sanitised as EvalPlus does.

Scoring-side parsing of completions for the code benchmarks (`mbd.eval.benchmarks`); prompts are built in
`mbd.eval.prompts`.
"""

from __future__ import annotations

import ast
import re

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_KEEP = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Assign,
         ast.AnnAssign)
_CODE_START = re.compile(r"^(def |async def |class |import |from |@)")
_PARSE_BUDGET = 2000  # ast.parse attempts before giving up on finding code inside prose


def extract_code(completion: str, prompt: str, entry_point: str) -> str:
    """The program to test: the prompt's context (imports, helpers) plus the model's code.

    Handles a fenced block (the one defining `entry_point`, else all blocks), a bare full function
    and a bare function body continuing `prompt` (base-model style). Top-level statements other
    than imports, definitions and assignments (demo prints, asserts, `if __name__ == ...`) are
    dropped, as EvalPlus's sanitizer does; later definitions override the prompt's stub.
    """
    blocks = [m.group(2) for m in _FENCE.finditer(completion) if m.group(1).lower() in ("", "python", "py", "python3")]
    defines = re.compile(rf"^\s*(async\s+)?def\s+{re.escape(entry_point)}\s*\(", re.MULTILINE)
    if blocks:
        chosen = [b for b in blocks if defines.search(b)][:1] or blocks
        code = "\n".join(chosen)
    else:
        code = completion
    if defines.search(code) or code.lstrip().startswith(("import ", "from ", "class ")):
        program = f"{prompt}\n{_longest_parsable(code)}"
    else:
        program = _longest_parsable(prompt + code)  # a body continuing the prompt's signature
    return _sanitize(program)


def _longest_parsable(code: str) -> str:
    """`code` if it parses, else the longest parsable span that starts at a code-looking line.

    Models often add prose before or after the code; EvalPlus likewise keeps the longest
    syntactically valid span.
    """
    if _parses(code):
        return code
    lines = code.split("\n")
    starts = [i for i, ln in enumerate(lines) if _CODE_START.match(ln)] or [0]
    best = (0, 0)  # (start, length)
    budget = _PARSE_BUDGET
    for s in starts:
        for n in range(len(lines) - s, best[1], -1):  # longest first, only spans that would beat `best`
            budget -= 1
            if budget < 0:
                break
            if lines[s + n - 1].strip() and _parses("\n".join(lines[s: s + n])):
                best = (s, n)
                break
    return "\n".join(lines[best[0]: best[0] + best[1]]) if best[1] else code


def _parses(code: str) -> bool:
    try:
        ast.parse(code)
    except (SyntaxError, ValueError):
        return False
    return True


def _sanitize(program: str) -> str:
    """Keep imports, definitions and assignments at top level, in source order."""
    try:
        tree = ast.parse(program)
    except (SyntaxError, ValueError):
        return program  # let it fail in the sandbox with its own SyntaxError
    lines = program.split("\n")
    kept = []
    for node in tree.body:
        if isinstance(node, _KEEP):
            start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
            kept.append("\n".join(lines[start - 1: node.end_lineno]))
    return "\n".join(kept) + "\n"
