"""A notebook through nbgrader's own tools, as an instructor's course would take it, and the points it gets.

    python tests/classroom/roundtrip.py 02_attention [03_gpt ...]     # prints each submission's points per exercise

For each notebook: `classroom nbgrader` lays out a course folder, `nbgrader generate_assignment` writes the release,
and `nbgrader autograde` grades four submissions of it, each the released folder with one notebook in it:

- solved: the course's source notebook, every answer written;
- blank: the release as it is, every answer a stub;
- wrong-odd and wrong-even: the solved notebook with the catalogued wrong answer (wrong_answers.py) planted in the odd
  exercises, or in the even ones, the others left right: a wrong answer must cost its own exercise's points, and only
  those.

Every notebook runs in quick mode (the course's nbgrader_config.py sets it), on the runs folder LLMFS_RUNS_DIR names.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from wrong_answers import WRONG  # noqa: E402

from llm_from_scratch import classroom as kit  # noqa: E402

SUBMISSIONS = ("solved", "blank", "wrong-odd", "wrong-even")


def nbgrader(course: Path, *args: str, env: dict | None = None) -> str:
    """Run nbgrader's command line in the course folder; its output, or an AssertionError that shows it."""
    env = dict(os.environ if env is None else env)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])  # nbgrader runs alembic
    run = subprocess.run([sys.executable, "-m", "nbgrader", *args], cwd=course, env=env, capture_output=True,
                         text=True)
    assert run.returncode == 0, f"nbgrader {' '.join(args)} failed:\n{run.stdout[-3000:]}\n{run.stderr[-6000:]}"
    return run.stdout + run.stderr


def plant(nb: dict, name: str, numbers: list[int]) -> dict:
    """The notebook with the catalogued wrong answer of each exercise in `numbers` planted in its solution region."""
    nb = json.loads(json.dumps(nb))
    by_number = {e.number: e for e in kit.exercises(nb)}
    for k in numbers:
        what, old, new = WRONG[name][k]
        cell = by_number[k].solution
        text = kit.source_of(cell)
        region = text[text.index(kit.BEGIN):text.index(kit.END)]
        assert region.count(old) == 1, f"{name} exercise {k} ({what}): the text to replace occurs " \
                                       f"{region.count(old)} times in the solution region:\n{old}"
        cell["source"] = text.replace(region, region.replace(old, new))
    return nb


def scores(course: Path) -> dict[str, dict[str, float]]:
    """The gradebook's autograded points: student -> {grade_id: score}."""
    from nbgrader.api import Gradebook
    out: dict[str, dict[str, float]] = {}
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        for assignment in gb.assignments:
            for submission in assignment.submissions:
                for notebook in submission.notebooks:
                    for grade in notebook.grades:
                        out.setdefault(submission.student_id, {})[grade.name] = grade.score
    return out


def round_trip(names: list[str], folder: Path, env: dict | None = None,
               students: tuple[str, ...] = SUBMISSIONS) -> dict[str, dict]:
    """Take the notebooks through nbgrader (module docstring). Returns, per notebook: its exercises, each
    student's {grade_id: points} and each autograded notebook."""
    course = folder / "course"
    paths = [ROOT / "notebooks" / f"{name}.ipynb" for name in names]
    made = kit.make_course(paths, course)
    nbgrader(course, "generate_assignment", "*", "--force", env=env)
    for name, found in made.items():
        release = course / "release" / name
        source = json.loads((course / "source" / name / f"{name}.ipynb").read_text())
        odd = [e.number for e in found if e.number % 2]
        notebooks = {"solved": lambda: source, "blank": lambda: json.loads((release / f"{name}.ipynb").read_text()),
                     "wrong-odd": lambda: plant(source, name, odd),
                     "wrong-even": lambda: plant(source, name, [e.number for e in found if e.number not in odd])}
        for student in students:
            target = course / "submitted" / student / name
            shutil.copytree(release, target)
            kit.write_notebook(notebooks[student](), target / f"{name}.ipynb")
    nbgrader(course, "autograde", "*", "--create", env=env)
    points = scores(course)
    return {name: {"exercises": found,
                   "points": {s: points.get(s, {}) for s in students},
                   "autograded": {s: json.loads((course / "autograded" / s / name / f"{name}.ipynb").read_text())
                                  for s in students}}
            for name, found in made.items()}


def expected(found: list, student: str) -> dict[str, float]:
    """The points each tests cell should get: all for solved, none for blank, all but the wrong ones otherwise."""
    def right(k):
        return student == "solved" or (student == "wrong-odd" and k % 2 == 0) or (student == "wrong-even" and k % 2)
    return {e.grade_id: (e.points if right(e.number) else 0.0) for e in found}


def errors_outside_tests(nb: dict) -> list[str]:
    """The first line of each error a cell other than a tests cell raised (in a solved notebook: none)."""
    return [f"cell {i}: {o['ename']}: {o['evalue']}"[:300] for i, c in enumerate(nb["cells"])
            if c["cell_type"] == "code" and not kit.nbgrader_of(c).get("grade")
            for o in c.get("outputs", []) if o["output_type"] == "error"]


def failures(result: dict) -> list[str]:
    """What a notebook's round trip got wrong, in words (empty: nbgrader grades it as it should)."""
    bad = []
    for student, got in result["points"].items():
        for grade_id, want in expected(result["exercises"], student).items():
            if got.get(grade_id) != want:
                cell = next(c for c in result["autograded"][student]["cells"]
                            if kit.nbgrader_of(c).get("grade_id") == grade_id)
                why = [f"{o['ename']}: {o['evalue']}"[:400] if o["output_type"] == "error" else o["text"][-400:]
                       for o in cell["outputs"] if o["output_type"] == "error" or o.get("name") == "stderr"]
                bad.append(f"{student}: {grade_id} got {got.get(grade_id)} points, expected {want:g} "
                           f"({' | '.join(why) or 'no error'})")
    if "solved" in result["autograded"]:
        bad += [f"solved: {e}" for e in errors_outside_tests(result["autograded"]["solved"])]
    return bad


if __name__ == "__main__":
    import tempfile
    os.environ.setdefault("LLMFS_RUNS_DIR", str(Path(tempfile.gettempdir()) / "roundtrip-runs"))
    with tempfile.TemporaryDirectory() as tmp:
        results = round_trip(sys.argv[1:], Path(tmp))
        for name, result in results.items():
            print(f"{name}:")
            for student, got in result["points"].items():
                print(f"  {student:<11}" + " ".join(f"{g.split('-exercise-')[1].removesuffix('-tests')}:{p:g}"
                                                    for g, p in got.items()))
            for line in failures(result):
                print("  WRONG", line)
            print("  ok" if not failures(result) else "  FAILED")
