"""The course notebooks as nbgrader assignments, checked by nbgrader's own tools.

Every exercise is nbgrader's pair of cells: the answer between `### BEGIN SOLUTION` / `### END SOLUTION`, then a
locked autograder-tests cell worth points (CONTRIBUTING.md, rule 5). Here: the pairs are well formed and their tests
read only what their own answer defines; `nbgrader generate_assignment` accepts every notebook and writes exactly
what `classroom make` writes; and `nbgrader autograde` (tests/classroom/roundtrip.py) gives the course's answers every
point, the blank release none, and costs each catalogued wrong answer (wrong_answers.py) its own exercise's points.
The round trip of two quick notebooks runs in CI; that of every other notebook is marked `long` (run it with
`python -m pytest -m long tests/classroom/test_nbgrader.py`).
"""

import ast
import json
import re
from pathlib import Path

import pytest
import roundtrip
from wrong_answers import WRONG

from llm_from_scratch import classroom as kit

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = kit.course_notebooks()
IN_CI = ["02_attention", "03_gpt"]  # the quickest notebooks (seconds each in quick mode)


def read(path: Path) -> dict:
    return json.loads(path.read_text())


def hidden_regions(text: str) -> str:
    """The lines of a tests cell's hidden tests."""
    return "\n".join(re.findall(rf"{kit.HIDDEN_BEGIN}\n(.*?){kit.HIDDEN_END}", text, re.S))


# ----------------------------------------------------------------------------- the cells


def test_every_notebook_with_exercises_is_a_course_notebook():
    names = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert [p.name for p in NOTEBOOKS] == sorted(names, key=lambda n: (not n[0].isdigit(), n))
    assert sorted(WRONG) == sorted(p.stem for p in NOTEBOOKS)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_every_exercise_is_a_solution_cell_then_a_locked_tests_cell(path):
    nb = read(path)
    found = kit.exercises(nb, path.name)  # a KitError names a broken pair
    prefix = path.stem.split("_")[0]
    assert [e.number for e in found] == list(range(1, len(found) + 1)) and 3 <= len(found) <= 5
    titled = [c for c in nb["cells"] if kit.source_of(c).startswith((kit.SOLUTION_TITLE, kit.TESTS_TITLE))]
    assert len(titled) == 2 * len(found), "a cell titled as an exercise's answer or tests that nbgrader does not know"
    reads = kit.names_the_tests_read(nb)
    for e in found:
        lines = kit.source_of(e.solution).split("\n")
        assert kit.nbgrader_of(e.solution)["grade_id"] == e.solution["id"] == f"{prefix}-exercise-{e.number}"
        assert e.tests["id"] == e.grade_id and "tests" in e.tests["metadata"]["tags"]
        assert e.solution["metadata"]["jupyter"]["source_hidden"] and "solution" in e.solution["metadata"]["tags"]
        assert lines[0] == f"{kit.SOLUTION_TITLE} {e.number}" and lines[-1] == kit.END, "nothing after the answer"
        want = kit.reads_line(reads[e.number])
        assert (lines[1] if lines[1].startswith(kit.READS) else "") == want, \
            f"exercise {e.number}: line 2 must say `{want}` (the names its tests read that the answer defines)"
        assert isinstance(e.points, int) and 1 <= e.points <= 3
        tests = kit.source_of(e.tests)
        assert kit.BEGIN not in tests and tests.count(kit.HIDDEN_BEGIN) == tests.count(kit.HIDDEN_END) <= 1
        last = ast.parse(tests).body[-1]
        assert not isinstance(last, ast.Expr) or getattr(getattr(last.value, "func", None), "id", "") == "print", \
            f"exercise {e.number}: nbgrader would read the value of the tests cell's last expression as partial credit"
        assert any(isinstance(node, ast.Assert) for node in ast.walk(ast.parse(tests)))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_a_tests_cell_reads_only_its_own_answer_and_hides_nothing_later_cells_need(path):
    """A wrong answer costs only its own exercise's points; the student's copy, without hidden tests, still runs."""
    nb = read(path)
    found = kit.exercises(nb, path.name)
    answers = {e.number: kit.assigned_names(ast.parse(kit.source_of(e.solution))) for e in found}
    exercise_cells = {id(c) for e in found for c in (e.solution, e.tests)}
    elsewhere = set()  # the names the notebook's other cells bind
    for cell in nb["cells"]:
        if cell["cell_type"] == "code" and id(cell) not in exercise_cells:
            try:
                elsewhere |= kit.assigned_names(ast.parse(kit.source_of(cell)))
            except SyntaxError:
                pass
    for i, e in enumerate(found):
        tests = kit.source_of(e.tests)
        others = set().union(*(names for k, names in answers.items() if k != e.number))
        borrowed = kit.read_names(tests) & others - answers[e.number] - elsewhere - kit.assigned_names(ast.parse(tests))
        assert not borrowed, f"exercise {e.number}'s tests read {sorted(borrowed)}, which another exercise defines"
        hidden = hidden_regions(tests)
        if hidden:
            later = set().union(*(names_read(c) for c in nb["cells"][nb["cells"].index(e.tests) + 1:]))
            leaked = kit.assigned_names(ast.parse(hidden)) & later
            assert not leaked, f"exercise {e.number}'s hidden tests bind {sorted(leaked)}, which a later cell reads"


def names_read(cell: dict) -> set[str]:
    """The names a cell reads and does not bind itself: what it takes from the cells above."""
    try:
        text = kit.source_of(cell)
        return kit.read_names(text) - kit.assigned_names(ast.parse(text)) if cell["cell_type"] == "code" else set()
    except SyntaxError:  # IPython magics
        return set()


def broken(cells: list[dict]) -> str:
    with pytest.raises(kit.KitError) as e:
        kit.exercises({"cells": cells}, "nb.ipynb")
    return str(e.value)


def cell(source: str, **nbgrader) -> dict:
    return {"cell_type": "code", "metadata": {"nbgrader": nbgrader} if nbgrader else {}, "outputs": [],
            "execution_count": None, "source": source}


def test_a_broken_pair_is_refused_with_the_cell_it_is():
    answer = cell(f"# Solution to exercise 1\n{kit.BEGIN}\nx = 1\n{kit.END}", solution=True, grade_id="01-exercise-1")
    tests = dict(grade=True, locked=True, points=2, solution=False, grade_id="01-exercise-1-tests")
    good = cell("# Tests for exercise 1 (2 points)\nassert x == 1", **tests)
    assert [e.points for e in kit.exercises({"cells": [answer, good]})] == [2]
    assert "cell 1: exercise 1's solution must be followed" in broken([answer, cell("assert x == 1")])
    assert "must have grade_id '01-exercise-1-tests'" in broken([answer, dict(good, source="# Tests for exercise 1 "
                                                                                       "(3 points)\nassert x")])
    assert "must be followed" in broken([answer, cell(good["source"], **dict(tests, locked=False))])
    assert "does not follow a solution cell" in broken([good])
    assert "used twice" in broken([answer, good, answer, good])
    assert "must be code that starts with" in broken([cell(f"x = 1\n{kit.BEGIN}\n{kit.END}", solution=True,
                                                           grade_id="a")])


def test_the_student_copy_clears_answers_hidden_tests_and_outputs_and_keeps_the_rest():
    nb = {"metadata": {}, "nbformat": 4, "nbformat_minor": 5, "cells": [
        cell("y = 0"),
        cell(f"# Solution to exercise 1\n# The tests below read: x\n{kit.BEGIN}\nx = 1\n{kit.END}", solution=True,
             grade=False, locked=False, grade_id="01-exercise-1"),
        cell(f"# Tests for exercise 1 (2 points)\nassert x > 0\n{kit.HIDDEN_BEGIN}\nassert x == 1\n{kit.HIDDEN_END}",
             grade=True, locked=True, points=2, solution=False, grade_id="01-exercise-1-tests")]}
    nb["cells"][0]["outputs"] = [{"output_type": "stream", "name": "stdout", "text": "0\n"}]
    nb["cells"][1]["metadata"]["jupyter"] = {"source_hidden": True}
    student = kit.student_notebook(nb)
    assert [kit.source_of(c) for c in student["cells"]] == [
        "y = 0", "# Exercise 1\n# The tests below read: x\n# YOUR CODE HERE\nraise NotImplementedError()",
        "# Tests for exercise 1 (2 points)\nassert x > 0"]
    assert all(c["outputs"] == [] for c in student["cells"]) and "jupyter" not in student["cells"][1]["metadata"]
    assert student["cells"][2]["metadata"]["editable"] is False
    assert student["cells"][1]["metadata"]["deletable"] is False
    assert kit.names_the_tests_read(nb) == {1: ["x"]}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_every_exercise_has_one_catalogued_wrong_answer_that_edits_its_solution(path):
    """The catalogue is planted in CI only in two notebooks: here, for all, that each entry still applies."""
    found = kit.exercises(read(path), path.name)
    assert sorted(WRONG[path.stem]) == [e.number for e in found]
    for e in found:
        what, old, new = WRONG[path.stem][e.number]
        text = kit.source_of(e.solution)
        region = text[text.index(kit.BEGIN):text.index(kit.END)]
        assert region.count(old) == 1 and old != new and what, f"exercise {e.number}: {what}"


# ----------------------------------------------------------------------------- nbgrader itself


def test_generate_assignment_takes_every_notebook_and_writes_what_make_writes(tmp_path, quick_env):
    made = kit.make_course(NOTEBOOKS, tmp_path)
    roundtrip.nbgrader(tmp_path, "generate_assignment", "*", env=quick_env)
    from nbgrader.api import Gradebook
    with Gradebook(f"sqlite:///{tmp_path / 'gradebook.db'}") as gb:
        for path in NOTEBOOKS:
            released = read(tmp_path / "release" / path.stem / path.name)
            ours = kit.student_notebook(read(path))
            assert [dict(c, source=kit.source_of(c)) for c in released["cells"]] == \
                   [dict(c, source=kit.source_of(c)) for c in ours["cells"]], f"{path.name}: make differs from nbgrader"
            text = json.dumps(released)
            assert kit.BEGIN not in text and kit.HIDDEN_BEGIN not in text and '"outputs": []' in text
            assert text.count("raise NotImplementedError()") == len(made[path.stem])
            assignment = gb.find_assignment(path.stem)
            assert assignment.max_score == sum(e.points for e in made[path.stem]) > 0
            assert (tmp_path / "release" / path.stem / "llm_from_scratch" / "model.py").is_file()


def round_trip_failures(names: list[str], tmp_path: Path, env: dict) -> list[str]:
    """nbgrader's round trip of these notebooks (roundtrip.py): what it got wrong, one line each."""
    env = {key: value for key, value in env.items() if key != "PYTHONPATH"}  # each assignment runs on its own copy
    # a runs folder of its own: the session's (quick_env) is the course run_all builds, stage by stage, in
    # test_chapters.py; a notebook that built a stage there first would leave run_all a stage it did not time
    env["LLMFS_RUNS_DIR"] = str(tmp_path / "runs")
    results = roundtrip.round_trip(names, tmp_path, env=env)
    bad = [f"{name}: {line}" for name, result in results.items() for line in roundtrip.failures(result)]
    for name, result in results.items():  # the planted answers were the catalogue's, one per exercise
        if sorted(WRONG[name]) != [e.number for e in result["exercises"]]:
            bad.append(f"{name}: the catalogue's wrong answers are not one per exercise")
    return bad


@pytest.mark.slow
def test_autograde_gives_the_answers_every_point_the_blank_none_and_each_wrong_answer_loses_its_own(tmp_path,
                                                                                                 quick_env):
    bad = round_trip_failures(IN_CI, tmp_path, quick_env)
    assert not bad, "\n".join(bad)


@pytest.mark.slow
@pytest.mark.long
def test_autograde_round_trip_of_every_other_notebook(tmp_path, quick_env):
    bad = round_trip_failures([p.stem for p in NOTEBOOKS if p.stem not in IN_CI], tmp_path, quick_env)
    assert not bad, "\n".join(bad)


def test_the_readme_states_each_notebooks_exercises_and_points():
    readme = (ROOT / "README.md").read_text()
    total = []
    for path in NOTEBOOKS:
        points = [e.points for e in kit.exercises(read(path), path.name)]
        total += points
        row = f"| `{path.stem}` | {len(points)} | {' + '.join(map(str, points))} = {sum(points)} |"
        assert row in readme, f"README: the row of {path.stem} should read {row}"
    assert f"| all {len(NOTEBOOKS)} | {len(total)} | {sum(total)} |" in readme
    assert f"{len(total)} exercises worth {sum(total)} points" in readme
