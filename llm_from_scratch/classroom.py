"""The classroom kit: any function of the library, or any course notebook, becomes an auto-graded assignment.

    python -m llm_from_scratch.classroom list
    python -m llm_from_scratch.classroom make attention.CausalSelfAttention.forward data.sft_collate --out hw3/
    python -m llm_from_scratch.classroom make notebooks/02_attention.ipynb --out hw2/
    python -m llm_from_scratch.classroom nbgrader --out course/

A function assignment is a folder a student can run anywhere, offline:

- the named modules with exactly the package files they (and their grader) import, each chosen function's body
  replaced by the stub Jupyter's nbgrader uses, `# YOUR CODE HERE` and `raise NotImplementedError(...)`; its
  signature, docstring (the math) and the shapes of the reference's intermediate values are kept;
- the grader, `tests/`: the project's own unit tests that say they grade those functions, with
  `@pytest.mark.grades("module.Class.function")`, and only those;
- a README.md for the student: what to implement, in which order, how to run the grader (`python -m pytest`).

`--solution` writes the same folder with the reference bodies between `### BEGIN SOLUTION` and `### END SOLUTION`,
nbgrader's markers: clearing those regions (`clear_solutions`) gives the student version.

A notebook's exercises are nbgrader's own cells: each answer between the same markers in a solution cell, then a
locked autograder-tests cell worth points, with hidden tests between `### BEGIN HIDDEN TESTS` / `### END HIDDEN TESTS`
(`exercises` reads and checks the pairs). `make` on a notebook writes the student's copy exactly as nbgrader's
`generate_assignment` would (`release_notebook`: answers cleared, hidden tests removed, outputs cleared, nbgrader's
metadata kept), beside the files it runs on and a grader that scores it as nbgrader's autograder does. `nbgrader`
lays out a course folder for nbgrader itself: `source/<notebook>/` and `nbgrader_config.py`.

This file is the instructor's tool: it reads the repository (the package, `tests/` and `notebooks/`) and is never
copied into an assignment. It imports nothing from the package, and needs no nbgrader.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import re
import shutil
import sys
import textwrap
import tokenize
from dataclasses import dataclass, field
from io import StringIO
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "llm_from_scratch"
TESTS = REPO / "tests"
PACKAGE = "llm_from_scratch"
MARKER = "grades"  # @pytest.mark.grades("attention.CausalSelfAttention.forward", ...)
BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
STUB = "# YOUR CODE HERE"

# module -> chapter (0: cross-cutting helpers; the classroom kit itself, an appendix, as 14)
CHAPTER = {
    "device": 0, "reproducible": 0, "checkpoint": 0, "course": 0, "plots": 0, "distributed": 0,
    "tinyworld": 1, "tasks": 1, "gold_rewards": 1, "preferences": 1, "dataset_files": 1, "tokenizer": 1, "data": 1,
    "attention": 2, "model": 3, "generation": 3, "train": 4, "sft": 5, "evaluation": 5, "reward_model": 6,
    "policy_gradient": 7, "ppo": 8, "dpo": 9, "arena": 10,
    "lora": 11, "async_rollouts": 12, "gpt2_weights": 13,  # appendices A, B and C: after the ten chapters (B's
    # distributed.py is a helper every trainer imports, so chapter 0)
    "classroom": 14,
}
TAUGHT_IN = {"data.sft_collate": 5}  # functions that live in an earlier module than the chapter that teaches them
THIRD_PARTY = ("torch", "numpy", "tiktoken", "safetensors", "matplotlib", "tqdm", "pytest", "hypothesis", "nbclient",
               "nbformat", "ipykernel")


class KitError(Exception):
    """Bad input to the kit: the CLI prints it as one line, `error: ...`, and exits with code 2."""


# ----------------------------------------------------------------------------- which files a module needs


def package_imports(path: Path) -> set[str]:
    """Names of the llm_from_scratch modules that the Python file `path` imports (absolute or relative imports)."""
    return imports_in(path.read_text())


def imports_in(source: str) -> set[str]:
    """Names of the llm_from_scratch modules that this Python source imports."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 or node.module == PACKAGE:  # from . import x / from llm_from_scratch import x
                if node.module and node.level == 1:
                    found.add(node.module.split(".")[0])
                else:
                    found.update(alias.name for alias in node.names)
            elif node.module and node.module.startswith(PACKAGE + "."):
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(PACKAGE + "."):
                    found.add(alias.name.split(".")[1])
    return found


def import_graph(pkg: Path = PKG) -> dict[str, set[str]]:
    """Every module of the package -> the package modules it imports directly (each file parsed once)."""
    return {path.stem: package_imports(path) for path in sorted(pkg.glob("*.py"))}


def closure(*modules: str, pkg: Path = PKG, graph: dict[str, set[str]] | None = None) -> set[str]:
    """The modules given and every package module they import, directly or not (`graph`: import_graph(pkg), when
    the caller asks for many closures)."""
    graph = import_graph(pkg) if graph is None else graph
    todo, seen = list(modules), set()
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(graph[m])
    return seen


def third_party_imports(paths: list[Path]) -> list[str]:
    """The pip packages these files import, of those the project uses (for the student's install line)."""
    names = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return [n for n in THIRD_PARTY if n in names]


# ----------------------------------------------------------------------------- functions and the tests that grade them


@dataclass
class Target:
    """One function that can be handed out: `module.function` or `module.Class.method`."""

    name: str  # "attention.CausalSelfAttention.forward"
    module: str  # "attention"
    qualname: str  # "CausalSelfAttention.forward"
    tests: list[tuple[str, str]] = field(default_factory=list)  # (test file name, test function name)

    @property
    def chapter(self) -> int:
        return TAUGHT_IN.get(self.name, CHAPTER.get(self.module, 99))


def find_function(tree: ast.Module, qualname: str) -> ast.FunctionDef | None:
    """The def of `f` or `C.f` at the top level of a module's syntax tree."""
    scope: list[ast.stmt] = tree.body
    *outer, name = qualname.split(".")
    for cls in outer:
        found = [n for n in scope if isinstance(n, ast.ClassDef) and n.name == cls]
        if not found:
            return None
        scope = found[0].body
    defs = [n for n in scope if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name]
    return defs[0] if defs else None


def marked_targets(test_fn: ast.FunctionDef) -> list[str]:
    """The names in a test's @pytest.mark.grades("...", ...) decorators."""
    names = []
    for dec in test_fn.decorator_list:
        if (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute) and dec.func.attr == MARKER
                and isinstance(dec.func.value, ast.Attribute) and dec.func.value.attr == "mark"):
            names += [a.value for a in dec.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    return names


def grading_tests(tests: Path = TESTS) -> dict[str, list[tuple[str, str]]]:
    """Every function some test grades -> the (file, test) pairs that grade it, from the tests' markers."""
    graded: dict[str, list[tuple[str, str]]] = {}
    for path in sorted(tests.glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(isinstance(n, ast.FunctionDef) and marked_targets(n)
                                                      for n in node.body):
                raise KitError(f"{path.name}: class {node.name} holds tests marked @pytest.mark.{MARKER}; "
                               f"the kit grades with top-level test functions only")
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
                for name in marked_targets(node):
                    graded.setdefault(name, []).append((path.name, node.name))
    return graded


def offered(tests: Path = TESTS, pkg: Path = PKG) -> list[Target]:
    """Every function that can be handed out (a test grades it), in the order to implement them: by chapter, then
    a module before the modules that import it, then in file order."""
    targets, graph = [], import_graph(pkg)
    for name, pairs in grading_tests(tests).items():
        module, _, qualname = name.partition(".")
        source = pkg / f"{module}.py"
        node = find_function(ast.parse(source.read_text()), qualname) if source.is_file() else None
        if node is None:
            raise KitError(f"{pairs[0][0]}::{pairs[0][1]} grades {name!r}, which is not in {PACKAGE}/")
        target = Target(name, module, qualname, pairs)
        # a module's import closure contains every module it depends on: its size orders them dependencies first
        targets.append((target.chapter, len(closure(module, graph=graph)), module, node.lineno, target))
    return [t for *_, t in sorted(targets, key=lambda x: x[:4])]


def resolve(names: list[str], tests: Path = TESTS, pkg: Path = PKG) -> list[Target]:
    """The targets for names as an instructor types them; a clear KitError for anything that cannot be handed out."""
    by_name = {t.name: t for t in offered(tests, pkg)}
    chosen = []
    for raw in names:
        name = raw.removeprefix(PACKAGE + ".")
        module, _, qualname = name.partition(".")
        if not (pkg / f"{module}.py").is_file() or module == "__init__":
            raise KitError(f"{raw}: there is no module {module!r} in {PACKAGE}/ (try `list`)")
        if not qualname or find_function(ast.parse((pkg / f"{module}.py").read_text()), qualname) is None:
            elsewhere = [p.stem for p in sorted(pkg.glob("*.py"))
                         if qualname and find_function(ast.parse(p.read_text()), qualname) is not None]
            hint = (f"; did you mean {' or '.join(f'{m}.{qualname}' for m in elsewhere)}?" if elsewhere
                    else " (name it as module.function or module.Class.method; `list` shows them all)")
            raise KitError(f"{raw}: {PACKAGE}/{module}.py has no function {qualname or '(none given)'!r}{hint}")
        if name not in by_name:
            raise KitError(f"{raw}: no test grades this function (mark a test with @pytest.mark.grades({name!r}) "
                           f"before handing it out)")
        if by_name[name] not in chosen:
            chosen.append(by_name[name])
    return sorted(chosen, key=lambda t: list(by_name).index(t.name))


# ----------------------------------------------------------------------------- solution regions: mark and clear


SHAPE = re.compile(r"\((?:[A-Z][\w+\-*/ ]*|\d+)(?:,\s*(?:[A-Za-z][\w+\-*/ ]*|\d+))*,?\)")


def shape_notes(lines: list[str]) -> list[str]:
    """`name: (B, T, C)` for each line of a body whose comment gives a shape: the shapes a solution passes through."""
    notes = []
    try:
        tokens = list(tokenize.generate_tokens(StringIO("\n".join(lines) + "\n").readline))
    except (tokenize.TokenError, IndentationError):
        return notes
    for tok in tokens:
        if tok.type != tokenize.COMMENT or not SHAPE.search(tok.string):
            continue
        code = lines[tok.start[0] - 1][: tok.start[1]].strip()
        comment = tok.string.lstrip("#").strip()
        if not code:
            continue
        if code.startswith("return"):
            notes.append(f"returns: {comment}")
        elif re.match(r"^[\w\s,.\[\]:]+?(?<![=!<>])=(?!=)", code):
            notes.append(f"{code.split('=')[0].strip()}: {comment}")
    return notes


def has_docstring(node: ast.FunctionDef) -> bool:
    """Whether the function's first statement is its docstring."""
    return ast.get_docstring(node, clean=False) is not None


def mark_solution(source: str, qualname: str) -> str:
    """The module source with the body of `qualname` (after its docstring) between nbgrader's solution markers,
    preceded by the shapes its reference computes."""
    node = find_function(ast.parse(source), qualname)
    if node is None:
        raise KitError(f"no function {qualname!r}")
    lines = source.splitlines()
    body = node.body
    has_doc = has_docstring(node)
    if has_doc and len(body) == 1:
        raise KitError(f"{qualname} has no body to hand out")
    if body[0].lineno == node.lineno:
        raise KitError(f"{qualname}: a one-line function cannot be handed out")
    start = body[0].end_lineno if has_doc else body[0].lineno - 1  # 0-based index of the region's first line
    end = node.end_lineno  # 0-based index one past the region's last line
    indent = " " * body[1 if has_doc else 0].col_offset
    region = lines[start:end]
    notes = shape_notes(region)
    head = [f"{indent}# Shapes the reference passes through:"] + [f"{indent}#   {n}" for n in notes] if notes else []
    new = lines[:start] + head + [f"{indent}{BEGIN}"] + region + [f"{indent}{END}"] + lines[end:]
    return "\n".join(new) + "\n"


def clear_solutions(text: str, messages: list[str] | None = None) -> str:
    """Replace each `### BEGIN SOLUTION` ... `### END SOLUTION` region by nbgrader's stub, at the marker's indentation:
    `# YOUR CODE HERE` and `raise NotImplementedError()` (with messages[i] as the i-th region's message, where
    given)."""
    out, inside, n = [], None, 0
    for i, line in enumerate(text.split("\n"), 1):
        stripped = line.strip()
        if stripped == BEGIN:
            if inside is not None:
                raise KitError(f"line {i}: {BEGIN} inside another solution region")
            inside = line[: len(line) - len(line.lstrip())]
            message = repr(messages[n]) if messages else ""
            out += [f"{inside}{STUB}", f"{inside}raise NotImplementedError({message})"]
            n += 1
        elif stripped == END:
            if inside is None:
                raise KitError(f"line {i}: {END} without {BEGIN}")
            inside = None
        elif inside is None:
            out.append(line)
    if inside is not None:
        raise KitError(f"{BEGIN} never closed")
    return "\n".join(out)


def strip_markers(text: str) -> str:
    """The text with the marker lines removed (the reference exactly as the library holds it)."""
    return "\n".join(line for line in text.split("\n") if line.strip() not in (BEGIN, END))


# ----------------------------------------------------------------------------- the grader


def grader_source(path: Path, names: set[str]) -> str:
    """A test file cut down to the tests that grade any of `names`, with everything they may need (imports,
    helpers, fixtures, constants) kept as it is."""
    source = path.read_text()
    lines = source.splitlines()
    drop = []
    for node in ast.parse(source).body:
        is_test = isinstance(node, ast.FunctionDef) and node.name.startswith("test")
        is_test_class = isinstance(node, ast.ClassDef) and node.name.startswith("Test")  # never a grading test
        if is_test_class or (is_test and not set(marked_targets(node)) & names):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            drop.append((first - 1, node.end_lineno))
    for start, end in reversed(drop):
        del lines[start:end]
        while start < len(lines) and start > 0 and not lines[start].strip() and not lines[start - 1].strip():
            del lines[start]  # no runs of blank lines where tests were
    return "\n".join(lines).rstrip() + "\n"


PYTEST_INI = f"""[pytest]
testpaths = tests
pythonpath = .
addopts = -p no:cacheprovider
markers =
    {MARKER}(*functions): the functions of the assignment this test grades
    slow: a longer test
"""


def signature_and_docstring(t: Target, pkg: Path = PKG) -> list[str]:
    """The lines of a function from its `def` to the end of its docstring, dedented: what the student is given."""
    lines = (pkg / f"{t.module}.py").read_text().splitlines()
    node = find_function(ast.parse("\n".join(lines)), t.qualname)
    first = node.body[0]
    block = lines[node.lineno - 1: first.end_lineno if has_docstring(node) else first.lineno - 1]
    return textwrap.dedent("\n".join(block)).split("\n")


def student_readme(targets: list[Target], modules: set[str], needs: list[str], solution: bool) -> str:
    """The README.md of an assignment: what to implement, in which order, and how to check it."""
    title = "Solution" if solution else "Assignment"
    out = [f"# {title}: {', '.join(t.qualname for t in targets)}", ""]
    if solution:
        out += ["This is the instructor's copy: every function holds its reference body between `### BEGIN SOLUTION` "
                "and `### END SOLUTION`, and the grader passes. The student's copy is the same folder made without "
                "`--solution`.", ""]
    out += [f"This folder is a small piece of the `{PACKAGE}` course: the package files in `{PACKAGE}/` "
            f"({', '.join(sorted(m + '.py' for m in modules))}) and the tests in `tests/` that grade your work.",
            "", "## What to implement, in this order", ""]
    for i, t in enumerate(targets, 1):
        out += [f"{i}. **`{t.qualname}`** in `{PACKAGE}/{t.module}.py` (chapter {t.chapter}), graded by "
                f"{len(t.tests)} test{'s' if len(t.tests) != 1 else ''}: "
                + ", ".join(f"`{f}::{n}`" for f, n in t.tests), "",
                "   ```python", *[f"   {line}".rstrip() for line in signature_and_docstring(t)], "   ```", ""]
    out += ["Replace each `# YOUR CODE HERE` / `raise NotImplementedError(...)` with your code. Keep the signature; "
            "the docstring and the shape comments above the stub say what the function computes. Do not edit "
            "anything else: the other functions are the course's reference code, and the tests call them too.", "",
            "## Check your work", "", "```bash", f"pip install {' '.join(needs)}", "python -m pytest", "```", "",
            "Every test runs offline in seconds. A failing test prints the value it expected and the one your code "
            "gave; `python -m pytest -x -q` stops at the first. Later functions in the list may call earlier ones, "
            "so make the grader pass in order.", ""]
    return "\n".join(out)


def prepare_out(out: Path, force: bool) -> None:
    """Make `out` an empty folder: refuse a file, a non-empty folder without `force`, and (even with it) a folder
    whose removal would take the repository or the working folder with it."""
    where = out.resolve()
    for keep in (REPO, Path.cwd().resolve()):
        if where == keep or where in keep.parents or (keep == REPO and where in (PKG, TESTS, REPO / "notebooks",
                                                                                 REPO / "chapters", REPO / ".git")):
            raise KitError(f"--out {out}: that is {'the repository' if keep == REPO else 'the current folder'} or a "
                           f"folder it needs; name a new folder for the assignment")
    if out.exists() and not out.is_dir():
        raise KitError(f"--out {out}: exists and is not a folder")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise KitError(f"--out {out}: the folder exists and is not empty (pass --force to replace its contents)")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)


def make_assignment(names: list[str], out: str | Path, solution: bool = False, force: bool = False,
                    tests: Path = TESTS, pkg: Path = PKG) -> list[Target]:
    """Write the assignment for these functions into `out` (see the module docstring). Returns its targets."""
    targets = resolve(names, tests, pkg)
    out = Path(out)
    chosen = {t.name for t in targets}
    graders = {}  # test file name -> its cut-down source
    for t in targets:
        for file, _ in t.tests:
            graders.setdefault(file, grader_source(tests / file, chosen))
    needed_by_tests = set().union(*(imports_in(text) for text in graders.values()))
    modules = closure(*{t.module for t in targets}, *needed_by_tests, pkg=pkg)
    sources = {}  # every file is made before anything is written: a KitError leaves no half-made folder
    for m in sorted(modules):
        source = (pkg / f"{m}.py").read_text()
        here = sorted((t for t in targets if t.module == m),
                      key=lambda t: find_function(ast.parse(source), t.qualname).lineno)
        for t in here:
            source = mark_solution(source, t.qualname)
        if not solution:
            source = clear_solutions(source, [f"{t.qualname}: your code here" for t in here])
        sources[m] = source
    prepare_out(out, force)
    (out / "tests").mkdir()
    for file, text in graders.items():
        (out / "tests" / file).write_text(text)
    (out / PACKAGE).mkdir()
    shutil.copy(pkg / "__init__.py", out / PACKAGE / "__init__.py")
    for m, source in sources.items():
        (out / PACKAGE / f"{m}.py").write_text(source)
    (out / "pytest.ini").write_text(PYTEST_INI)
    files = [out / PACKAGE / f"{m}.py" for m in modules] + [out / "tests" / f for f in graders]
    needs = third_party_imports(files)
    (out / "README.md").write_text(student_readme(targets, modules, needs, solution))
    return targets


# ----------------------------------------------------------------------------- notebooks: nbgrader's cells


# An exercise is two code cells, nbgrader's convention:
#
#   # Solution to exercise 2                        <- a solution cell: nbgrader metadata solution=true,
#   # The tests below read: before, after               grade_id "02-exercise-2"
#   ### BEGIN SOLUTION
#   ...
#   ### END SOLUTION
#
#   # Tests for exercise 2 (2 points)               <- an autograder-tests cell: grade=true, locked, points,
#   assert torch.allclose(before, after)                grade_id "02-exercise-2-tests"; it scores its points when
#   ### BEGIN HIDDEN TESTS                              it runs without an error (and writes nothing to stderr)
#   ...                                               <- removed from the student's copy
#   ### END HIDDEN TESTS
SOLUTION_TITLE, TESTS_TITLE, READS = "# Solution to exercise", "# Tests for exercise", "# The tests below read: "
EXERCISE_TITLE = "# Exercise"  # a course's copy titles its solution cells so (the student writes there)
HIDDEN_BEGIN, HIDDEN_END = "### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS"


def nbgrader_of(cell: dict) -> dict:
    """A cell's nbgrader metadata ({} for a cell nbgrader does not know)."""
    return cell.get("metadata", {}).get("nbgrader", {})


def source_of(cell: dict) -> str:
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


@dataclass
class Exercise:
    """One exercise of a notebook: its solution cell and its autograder-tests cell."""

    number: int
    solution: dict
    tests: dict

    @property
    def grade_id(self) -> str:
        return nbgrader_of(self.tests)["grade_id"]

    @property
    def points(self) -> float:
        return nbgrader_of(self.tests)["points"]


def points_text(points: float) -> str:
    return f"{points:g} point{'s' if points != 1 else ''}"


def exercises(nb: dict, where: str = "notebook") -> list[Exercise]:
    """The notebook's exercises, in order, each checked to be nbgrader's pair of cells (a KitError names the cell
    otherwise): a solution cell `# Solution to exercise K` with its grade_id, then at once a locked tests cell
    `# Tests for exercise K (P points)` worth P > 0 points, whose grade_id is the solution's with `-tests`."""
    found, cells, ids = [], nb["cells"], set()
    for i, cell in enumerate(cells):
        meta, text = nbgrader_of(cell), source_of(cell)
        for grade_id in [meta.get("grade_id")] if meta else []:
            if grade_id in ids:
                raise KitError(f"{where}, cell {i}: grade_id {grade_id!r} is used twice")
            ids.add(grade_id)
        if not meta.get("solution"):
            if meta.get("grade") and not (i and nbgrader_of(cells[i - 1]).get("solution")):
                raise KitError(f"{where}, cell {i}: a tests cell that does not follow a solution cell")
            continue
        m = re.match(rf"(?:{SOLUTION_TITLE}|{EXERCISE_TITLE}) (\d+)\n", text)  # the repository's or a course's
        if cell["cell_type"] != "code" or not m or (BEGIN not in text and STUB not in text):
            raise KitError(f"{where}, cell {i}: a solution cell must be code that starts with "
                           f"'{SOLUTION_TITLE} K' and holds {BEGIN} / {END} (or, in a student's copy, the stub)")
        k = int(m.group(1))
        tests = cells[i + 1] if i + 1 < len(cells) else {"metadata": {}, "source": "", "cell_type": "markdown"}
        t_meta = nbgrader_of(tests)
        head = f"{TESTS_TITLE} {k} ({points_text(t_meta.get('points', 0))})"
        if not (tests["cell_type"] == "code" and t_meta.get("grade") and t_meta.get("locked")
                and not t_meta.get("solution") and t_meta.get("points", 0) > 0):
            raise KitError(f"{where}, cell {i + 1}: exercise {k}'s solution must be followed by its locked "
                           f"autograder-tests cell (nbgrader grade=true, locked=true, points > 0)")
        if t_meta.get("grade_id") != f"{meta['grade_id']}-tests" or not source_of(tests).startswith(head + "\n"):
            raise KitError(f"{where}, cell {i + 1}: exercise {k}'s tests cell must have grade_id "
                           f"{meta['grade_id'] + '-tests'!r} and start with {head!r}")
        found.append(Exercise(k, cell, tests))
    return found


def assigned_names(tree: ast.AST, lines: range | None = None) -> set[str]:
    """The names a piece of code binds (assignments, loop targets, defs, imports), only on `lines` if given."""
    names = set()
    for node in ast.walk(tree):
        if lines is not None and getattr(node, "lineno", None) not in lines:
            continue
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def read_names(text: str) -> set[str]:
    """The names a piece of code reads."""
    return {n.id for n in ast.walk(ast.parse(text)) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def names_the_tests_read(nb: dict) -> dict[int, list[str]]:
    """For each exercise: the names its solution binds that its tests (hidden ones included) read and that no
    earlier cell binds. The student's code must define them, so the solution cell names them on its second line."""
    pairs = {id(e.solution): e for e in exercises(nb)}
    known: set[str] = set()  # the names the cells above bind
    out = {}
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        text = source_of(cell)
        try:
            tree = ast.parse(text)
        except SyntaxError:  # a cell with IPython magics binds nothing we track
            continue
        if id(cell) in pairs:
            e = pairs[id(cell)]
            out[e.number] = sorted((assigned_names(tree) - known) & read_names(source_of(e.tests)))
        known |= assigned_names(tree)
    return out


def reads_line(names: list[str]) -> str:
    """The solution cell's second line: what the tests read ('' when they read nothing the solution defines)."""
    return READS + ", ".join(names) if names else ""


# ----------------------------------------------------------------------------- notebooks: the course and student copies


def course_notebook(nb: dict) -> dict:
    """The notebook as an nbgrader course's source holds it: each solution cell shown (the repository collapses it, so
    that a reader tries first) and titled `# Exercise K`; everything else as it is."""
    nb = json.loads(json.dumps(nb))
    for e in exercises(nb):
        e.solution["metadata"].get("jupyter", {}).pop("source_hidden", None)
        if not e.solution["metadata"].get("jupyter", True):
            del e.solution["metadata"]["jupyter"]
        e.solution["source"] = re.sub(rf"^{SOLUTION_TITLE} (\d+)", rf"{EXERCISE_TITLE} \1", source_of(e.solution))
    return nb


def nbgrader_checksum(cell: dict) -> str:
    """nbgrader's checksum of a cell (nbgrader.utils.compute_checksum): its autograder uses it to see which answer
    cells a student left untouched."""
    meta = nbgrader_of(cell)
    grade, solution = bool(meta.get("grade")), bool(meta.get("solution"))
    locked = False if solution else True if grade else bool(meta.get("locked"))
    parts = [source_of(cell), cell["cell_type"], str(grade), str(solution), str(locked), meta["grade_id"]]
    parts += [str(float(meta["points"]))] if grade else []
    return hashlib.md5("".join(parts).encode()).hexdigest()


def remove_hidden_tests(text: str) -> str:
    """The text without its `### BEGIN HIDDEN TESTS` ... `### END HIDDEN TESTS` regions (marker lines included)."""
    out, inside = [], False
    for i, line in enumerate(text.split("\n"), 1):
        if HIDDEN_BEGIN in line:
            if inside:
                raise KitError(f"line {i}: {HIDDEN_BEGIN} inside another hidden-tests region")
            inside = True
        elif HIDDEN_END in line:
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise KitError(f"{HIDDEN_BEGIN} never closed")
    return "\n".join(out)


def release_notebook(nb: dict) -> dict:
    """What nbgrader's `generate_assignment` writes for this source notebook, cell for cell: solution regions cleared
    to nbgrader's stub, hidden tests removed, every output cleared, solution cells undeletable and tests cells
    read-only (nbgrader's LockCells), each nbgrader cell's checksum and type recorded."""
    nb = json.loads(json.dumps(nb))
    nb["metadata"].pop("celltoolbar", None)
    for cell in nb["cells"]:
        meta = nbgrader_of(cell)
        if cell["cell_type"] == "code":
            cell["outputs"], cell["execution_count"] = [], None
            for key in ("collapsed", "scrolled"):
                cell["metadata"].pop(key, None)
        if not meta:
            continue
        if meta.get("solution"):
            cell["metadata"]["deletable"] = False
            cell["source"] = clear_solutions(source_of(cell))
        elif meta.get("grade") or meta.get("locked"):
            cell["metadata"]["deletable"] = cell["metadata"]["editable"] = False
        if meta.get("grade"):
            cell["source"] = remove_hidden_tests(source_of(cell))
        if meta.get("grade") or meta.get("solution") or meta.get("locked"):
            meta["checksum"], meta["cell_type"] = nbgrader_checksum(cell), cell["cell_type"]
    return nb


def student_notebook(nb: dict) -> dict:
    """The student's copy of a repository notebook: nbgrader's release of its course version."""
    return release_notebook(course_notebook(nb))


def read_notebook(path: Path) -> dict:
    """A course notebook, read and checked (a KitError names the file and what is wrong)."""
    if not path.is_file():
        raise KitError(f"{path}: no such notebook")
    try:
        nb = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise KitError(f"{path}: not a notebook ({e})") from None
    if not isinstance(nb, dict) or not isinstance(nb.get("cells"), list):
        raise KitError(f"{path}: not a notebook (no list of cells)")
    if not exercises(nb, str(path)):
        raise KitError(f"{path}: no exercise is marked as nbgrader's solution and tests cells "
                       f"({BEGIN} / {END}), so there is nothing to hand out")
    return nb


def write_notebook(nb: dict, path: Path) -> None:
    path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")


def course_notebooks() -> list[Path]:
    """The repository's notebooks that hold exercises, chapters first, then appendices."""
    paths = sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb")) + sorted((REPO / "notebooks").glob("[A-Z]_*.ipynb"))
    return [p for p in paths if any(nbgrader_of(c).get("solution") for c in json.loads(p.read_text())["cells"])]


def copy_code(out: Path) -> None:
    """The package (less this kit) and the chapter scripts, which a notebook imports and runs, into `out`."""
    shutil.copytree(PKG, out / PACKAGE, ignore=shutil.ignore_patterns("__pycache__", "classroom.py"))
    if (REPO / "chapters").is_dir():  # a notebook builds the earlier chapters' runs it needs with their scripts
        shutil.copytree(REPO / "chapters", out / "chapters", ignore=shutil.ignore_patterns("__pycache__"))


# ----------------------------------------------------------------------------- notebooks: a folder without nbgrader


NOTEBOOK_GRADER = '''"""Grade the notebook as nbgrader's autograder does: run it top to bottom in quick mode, every
cell even after an error, and give each autograder-tests cell its points when it ran without an error (and wrote
nothing to stderr).

    python -m pytest                                     # grade notebooks/{name}
    LLMFS_SUBMISSION=path/to/theirs.ipynb python -m pytest   # grade another copy (a student's) against this one's tests

The tests cells that run are always this folder's own (nbgrader's locked cells): a submission's edits to them do not
count, and the instructor's copy (`make --solution`) grades with its hidden tests too."""

import json
import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / {name!r}
OURS = nbformat.read(NOTEBOOK, as_version=4)
TESTS = {{c.metadata.nbgrader["grade_id"]: c for c in OURS.cells if c.metadata.get("nbgrader", {{}}).get("grade")}}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """The submission, its tests cells replaced by ours, run in a kernel: grade_id -> (the executed tests cell, the
    answer cell above it)."""
    path = Path(os.environ.get("LLMFS_SUBMISSION", NOTEBOOK)).resolve()
    nb = nbformat.read(path, as_version=4)
    for i, cell in enumerate(nb.cells):
        grade_id = cell.metadata.get("nbgrader", {{}}).get("grade_id")
        if grade_id in TESTS:
            nb.cells[i] = nbformat.from_dict(json.loads(json.dumps(TESTS[grade_id])))
    env = {{"LLMFS_QUICK": os.environ.get("LLMFS_QUICK", "1"), "MPLBACKEND": "Agg"}}  # quick mode unless asked
    saved = {{key: os.environ.get(key) for key in env}}
    os.environ.update(env)  # the kernel inherits this process's environment
    try:
        NotebookClient(nb, timeout=900, kernel_name="python3", allow_errors=True,
                       resources={{"metadata": {{"path": str(NOTEBOOK.parent)}}}}).execute()
    finally:
        for key, value in saved.items():
            os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)
    return {{c.metadata.nbgrader["grade_id"]: (c, nb.cells[i - 1]) for i, c in enumerate(nb.cells)
            if c.metadata.get("nbgrader", {{}}).get("grade")}}


def failures(cell):
    """What nbgrader counts as a failed cell: an error, or anything written to stderr."""
    return [o.ename + (": " + o.evalue if o.evalue else "") if o.output_type == "error" else o.text.strip()
            for o in cell.outputs if o.output_type == "error" or (o.output_type == "stream" and o.name == "stderr")]


@pytest.mark.grades({name!r})
@pytest.mark.parametrize("grade_id", list(TESTS), ids=[f"{{g}} ({{c.metadata.nbgrader['points']:g}} points)"
                                                      for g, c in TESTS.items()])
def test_exercise(graded, grade_id, record_property):
    record_property("points", TESTS[grade_id].metadata.nbgrader["points"])
    assert grade_id in graded, f"the submission has no cell {{grade_id}}: it was deleted"
    tests, answer = graded[grade_id]
    failed = failures(tests)
    why = f" (the answer cell above them raised {{failures(answer)[0]}})" if failed and failures(answer) else ""
    assert not failed, f"the tests failed: {{' | '.join(failed)}}{{why}}"
'''


GRADER_CONFTEST = '''"""Print the score of the graded notebook: the points of the exercises whose tests passed."""


def pytest_terminal_summary(terminalreporter):
    points = {{"passed": 0.0, "failed": 0.0}}
    for outcome in points:
        for report in terminalreporter.stats.get(outcome, []):
            points[outcome] += dict(report.user_properties).get("points", 0)
    total = points["passed"] + points["failed"]
    if total:
        terminalreporter.write_line(f"score: {{points['passed']:g}} of {{total:g}} points")
'''


def make_notebook(path: str | Path, out: str | Path, solution: bool = False, force: bool = False) -> list[Exercise]:
    """Write the student's copy of a course notebook (with `solution`, the course's source copy, answers and hidden
    tests in it) into out/notebooks/, beside the package and chapter scripts it runs on and a grader that scores
    it as nbgrader's autograder does. Returns its exercises."""
    path, out = Path(path), Path(out)
    nb = read_notebook(path)
    written = course_notebook(nb) if solution else student_notebook(nb)  # before anything is written
    prepare_out(out, force)
    (out / "notebooks").mkdir()
    write_notebook(written, out / "notebooks" / path.name)
    copy_code(out)
    (out / "tests").mkdir()
    (out / "tests" / "test_notebook.py").write_text(NOTEBOOK_GRADER.format(name=path.name))
    (out / "tests" / "conftest.py").write_text(GRADER_CONFTEST.format())
    (out / "pytest.ini").write_text(PYTEST_INI)
    found = exercises(nb)
    total = sum(e.points for e in found)
    title = "Solution" if solution else "Assignment"
    where = ("the answers sit between `### BEGIN SOLUTION` and `### END SOLUTION`, and the tests cells hold hidden "
             "tests between `### BEGIN HIDDEN TESTS` and `### END HIDDEN TESTS`" if solution
             else "each is yours to write: replace `# YOUR CODE HERE` / `raise NotImplementedError()`")
    (out / "README.md").write_text("\n".join([
        f"# {title}: notebook {path.stem}", "",
        f"Open `notebooks/{path.name}` and work through it. It has {len(found)} exercises worth {points_text(total)}: "
        f"{where}. The cell after each answer, `# Tests for exercise K (P points)`, checks it; the line "
        f"`# The tests below read: ...` names what your code must define.", "",
        "## Check your work", "", "```bash",
        "pip install torch tiktoken numpy matplotlib tqdm safetensors jupyter pytest nbclient nbformat ipykernel",
        "python -m pytest", "```", "",
        "The grader runs the notebook top to bottom in quick mode (`LLMFS_QUICK=1`; set `LLMFS_QUICK=0` for the real "
        "run), every cell even after an error, as nbgrader's autograder does, and gives each exercise its points when "
        "its tests cell runs without an error: `score: P of "
        f"{total:g} points` ends its report. A notebook that builds on an earlier chapter's run (notebooks 03 to 10 "
        "and the appendices) "
        "makes that run first, in quick mode, the first time the grader runs (a minute or two; later runs reuse it, "
        "in `runs/`).", ""]
        + (["To grade a student's copy with this folder's tests, hidden ones included: "
            "`LLMFS_SUBMISSION=path/to/their.ipynb python -m pytest`.", ""] if solution else [])))
    return found


# ----------------------------------------------------------------------------- notebooks: an nbgrader course folder


NBGRADER_CONFIG = '''"""nbgrader's configuration of this course folder (written by llm_from_scratch.classroom)."""

import os

c = get_config()  # noqa: F821 (nbgrader defines it)
c.CourseDirectory.course_id = {course!r}
c.CourseDirectory.root = os.path.dirname(os.path.abspath(__file__))

# A notebook's cells may train for a while (a quick-mode chapter run builds what it needs once): no 30 s limit.
c.Execute.timeout = 1800

# The autograder's kernels inherit this process's environment: quick mode (smoke runs, every notebook in about a
# minute; LLMFS_QUICK=0 grades on the real runs), and one runs folder for every student and assignment, so the
# earlier chapters' runs a notebook builds on are made once.
os.environ.setdefault("LLMFS_QUICK", "1")
os.environ.setdefault("LLMFS_RUNS_DIR", os.path.join(c.CourseDirectory.root, "runs"))
os.environ.setdefault("MPLBACKEND", "Agg")
'''


def make_course(paths: list[str | Path], out: str | Path, course: str = "llm-from-scratch",
                force: bool = False) -> dict[str, list[Exercise]]:
    """Lay out an nbgrader course folder: source/<name>/ for each notebook (its course copy, beside the package and
    chapter scripts it runs on, so each assignment's release runs by itself) and nbgrader_config.py. Returns each
    assignment's exercises."""
    out = Path(out)
    chosen = {}
    for raw in paths or course_notebooks():
        path = Path(raw)
        nb = read_notebook(path)
        if path.stem in chosen:
            raise KitError(f"{path}: named twice")
        chosen[path.stem] = (path, course_notebook(nb), exercises(nb))
    prepare_out(out, force)
    for name, (path, nb, _) in chosen.items():
        folder = out / "source" / name
        folder.mkdir(parents=True)
        write_notebook(nb, folder / path.name)
        copy_code(folder)
    (out / "nbgrader_config.py").write_text(NBGRADER_CONFIG.format(course=course))
    return {name: found for name, (_, _, found) in chosen.items()}


# ----------------------------------------------------------------------------- the command line


def cmd_list() -> str:
    targets = offered()
    rows, chapter = [], None
    for t in targets:
        if t.chapter != chapter:
            chapter = t.chapter
            rows.append(f"chapter {chapter}" if chapter <= 10 else f"appendix {'ABCD'[chapter - 11]}")
        rows.append(f"  {t.name:<50} {len(t.tests):>2} test{'s' if len(t.tests) != 1 else ''}")
    rows.append(f"{len(targets)} functions (make module.function ... --out DIR)")
    rows.append("notebooks with graded exercises (make notebooks/NAME.ipynb --out DIR; nbgrader --out DIR):")
    for path in course_notebooks():
        found = exercises(json.loads(path.read_text()), str(path))
        rows.append(f"  {path.stem:<50} {len(found)} exercises, {points_text(sum(e.points for e in found))}")
    return "\n".join(rows)


class OneLineErrors(argparse.ArgumentParser):
    """argparse, with a usage mistake reported as the kit reports bad input: one line, exit code 2."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineErrors(
        prog="python -m llm_from_scratch.classroom",
        description="Turn functions of the library (or a course notebook) into an auto-graded assignment, graded by "
                    "the project's own unit tests.",
        epilog="examples:\n  python -m llm_from_scratch.classroom list\n"
               "  python -m llm_from_scratch.classroom make attention.CausalSelfAttention.forward data.sft_collate "
               "--out hw3/\n"
               "  python -m llm_from_scratch.classroom make notebooks/02_attention.ipynb --out hw2/ --solution\n"
               "  python -m llm_from_scratch.classroom nbgrader --out course/\n"
               "  python -m llm_from_scratch.classroom nbgrader notebooks/02_attention.ipynb notebooks/03_gpt.ipynb "
               "--out course/",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="every function that can be handed out, by chapter, with how many tests grade it")
    make = sub.add_parser("make", help="write an assignment folder")
    make.add_argument("what", nargs="+", help="functions as module.function or module.Class.method (see `list`), "
                                              "or one notebook path (notebooks/NN_name.ipynb)")
    make.add_argument("--out", required=True, help="the folder to write (must be empty or new, unless --force)")
    make.add_argument("--solution", action="store_true", help="the instructor's copy: reference bodies between "
                                                              "### BEGIN SOLUTION / ### END SOLUTION")
    make.add_argument("--force", action="store_true", help="replace the contents of a non-empty --out folder")
    course = sub.add_parser("nbgrader", help="lay out an nbgrader course folder: source/<name>/ for each notebook "
                                             "and nbgrader_config.py; then run nbgrader's own commands there")
    course.add_argument("notebooks", nargs="*", help="notebooks to include (default: every notebook with exercises)")
    course.add_argument("--out", required=True, help="the course folder to write (must be empty or new, unless "
                                                     "--force)")
    course.add_argument("--course-id", default="llm-from-scratch", help="nbgrader's course_id (default: %(default)s)")
    course.add_argument("--force", action="store_true", help="replace the contents of a non-empty --out folder")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "list":
            print(cmd_list())
            return 0
        if args.command == "nbgrader":
            made = make_course(args.notebooks, args.out, args.course_id, args.force)
            points = sum(e.points for found in made.values() for e in found)
            first = next(iter(made))
            print(f"wrote {args.out}: {len(made)} assignment{'s' if len(made) != 1 else ''} "
                  f"({sum(len(f) for f in made.values())} exercises, {points_text(points)}) and nbgrader_config.py; "
                  f"next: `cd {args.out} && nbgrader generate_assignment {first}`")
            return 0
        notebooks = [w for w in args.what if w.endswith(".ipynb")]
        if notebooks:
            if len(args.what) != 1:
                raise KitError("make: give one notebook at a time" if len(notebooks) > 1
                               else "make: give one notebook, or functions, not both")
            found = make_notebook(notebooks[0], args.out, args.solution, args.force)
            print(f"wrote {args.out}: {Path(notebooks[0]).name} with {len(found)} exercises "
                  f"({points_text(sum(e.points for e in found))}) {'solved' if args.solution else 'cleared'}; "
                  f"grade it with `cd {args.out} && python -m pytest`")
            return 0
        targets = make_assignment(args.what, args.out, args.solution, args.force)
        n_tests = len({pair for t in targets for pair in t.tests})
        print(f"wrote {args.out}: {len(targets)} function{'s' if len(targets) != 1 else ''} "
              f"{'with their solutions' if args.solution else 'to implement'}, graded by {n_tests} test "
              f"function{'s' if n_tests != 1 else ''}; "
              f"grade it with `cd {args.out} && python -m pytest`")
        return 0
    except KitError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
