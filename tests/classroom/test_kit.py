"""The classroom kit (llm_from_scratch/classroom.py), and proof that its graders catch wrong answers.

For every function the kit offers, an assignment is built and its grader (the project's own tests for that function)
is run from a temporary folder with the repository off sys.path: it passes on the reference, fails on the blank
(every grading test fails), and fails on every typical wrong implementation in bugs.py.
"""

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from bugs import BUGS
from isolated import run_isolated

from llm_from_scratch import classroom as kit

ROOT = Path(__file__).resolve().parents[2]
OFFERED = kit.offered()
# the headline functions of each chapter: the kit must offer at least these
HEADLINE = {
    "tokenizer.learn_merges_naive", "tokenizer.merge_pair",  # the BPE training step
    # KV-cache decoding
    "attention.CausalSelfAttention.forward", "attention.explicit_attention", "attention.KVCache.update",
    "model.Block.forward", "generation.filter_logits",  # nucleus sampling
    "generation.sequence_logprobs", "train.accumulate_gradients", "data.sft_collate", "train.lm_loss",
    "reward_model.bradley_terry_loss", "reward_model.RewardModel.forward",
    "policy_gradient.rloo_advantages", "policy_gradient.grpo_advantages", "ppo.compute_gae",
    "policy_gradient.clipped_policy_loss", "dpo.dpo_loss",
}


def run_kit(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "llm_from_scratch.classroom", *args], cwd=cwd, capture_output=True,
                          text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))


def grade(*folders: Path) -> list[tuple[int, dict[str, list[str]], str]]:
    """Run assignments' graders as a student would, each from its own folder with nothing of the repository on the
    path, two at a time (tests/isolated.py). For each: the exit code, {test function: outcomes of its instances},
    and the end of the output."""
    results = []
    for run in run_isolated(list(folders), ROOT):
        outcomes: dict[str, list[str]] = {}
        for status, node in re.findall(r"^(PASSED|FAILED|ERROR) (\S+)", run.output, re.M):
            outcomes.setdefault(node.split("[")[0], []).append(status)
        results.append((run.code, outcomes, run.output[-6000:]))
    return results


def plant(folder: Path, target: str, old: str, new: str) -> None:
    """Edit `old` -> `new` inside the function `target` of an assignment (old must occur there exactly once)."""
    module, _, qualname = target.partition(".")
    path = folder / "llm_from_scratch" / f"{module}.py"
    source = path.read_text()
    node = kit.find_function(ast.parse(source), qualname)
    lines = source.split("\n")
    before, body, after = (lines[:node.lineno - 1], "\n".join(lines[node.lineno - 1:node.end_lineno]),
                           lines[node.end_lineno:])
    assert body.count(old) == 1, f"{target}: the bug's text occurs {body.count(old)} times in the reference:\n{old}"
    path.write_text("\n".join(before + [body.replace(old, new)] + after))


# ----------------------------------------------------------------------------- what is offered


def test_the_kit_offers_every_headline_function():
    assert HEADLINE <= {t.name for t in OFFERED}, HEADLINE - {t.name for t in OFFERED}


def test_every_offered_function_has_its_math_and_at_least_three_catalogued_bugs():
    for t in OFFERED:
        source = (ROOT / "llm_from_scratch" / f"{t.module}.py").read_text()
        assert ast.get_docstring(kit.find_function(ast.parse(source), t.qualname)), f"{t.name} has no docstring"
        assert len(BUGS.get(t.name, [])) >= 3, f"{t.name}: catalogue at least 3 typical wrong implementations"
    assert set(BUGS) <= {t.name for t in OFFERED}, set(BUGS) - {t.name for t in OFFERED}


def test_list_groups_by_chapter_and_counts_tests():
    run = run_kit("list")
    assert run.returncode == 0, run.stderr
    assert "chapter 2" in run.stdout and re.search(r"attention\.CausalSelfAttention\.forward\s+\d+ tests", run.stdout)
    assert f"{len(OFFERED)} functions" in run.stdout
    assert re.search(r"02_attention\s+4 exercises, 8 points", run.stdout)


# ----------------------------------------------------------------------------- marking and clearing


def test_clear_solutions_uses_nbgraders_stub_at_the_markers_indentation():
    text = "def f(x):\n    '''doc'''\n    ### BEGIN SOLUTION\n    y = x + 1\n    return y\n    ### END SOLUTION\nz = 1"
    assert kit.clear_solutions(text) == ("def f(x):\n    '''doc'''\n    # YOUR CODE HERE\n"
                                         "    raise NotImplementedError()\nz = 1")
    assert kit.strip_markers(text) == "def f(x):\n    '''doc'''\n    y = x + 1\n    return y\nz = 1"
    with pytest.raises(kit.KitError, match="never closed"):
        kit.clear_solutions("### BEGIN SOLUTION\nx = 1")


def test_a_student_module_keeps_signature_docstring_and_shapes_and_nothing_of_the_body(tmp_path):
    kit.make_assignment(["attention.CausalSelfAttention.forward"], tmp_path / "hw")
    source = (tmp_path / "hw" / "llm_from_scratch" / "attention.py").read_text()
    node = kit.find_function(ast.parse(source), "CausalSelfAttention.forward")
    body = "\n".join(source.split("\n")[node.lineno - 1:node.end_lineno])
    assert "def forward(self, x: torch.Tensor, mask" in body and "softmax(q_h k_h^T / sqrt(D)" in body
    assert "# YOUR CODE HERE" in body and "raise NotImplementedError(" in body
    assert "#   q: (B, H, T, D)" in body  # the shapes the reference passes through
    assert "c_attn(x)" not in body and "transpose" not in body
    # the rest of the module is the reference, unchanged
    reference = (ROOT / "llm_from_scratch" / "attention.py").read_text()
    assert source.split("    def forward")[0] == reference.split("    def forward")[0]
    readme = (tmp_path / "hw" / "README.md").read_text()
    assert "CausalSelfAttention.forward" in readme and "python -m pytest" in readme


def test_the_grader_holds_only_the_tests_of_the_chosen_functions(tmp_path):
    kit.make_assignment(["policy_gradient.grpo_advantages"], tmp_path / "hw")
    tests = sorted((tmp_path / "hw" / "tests").glob("test_*.py"))
    assert [p.name for p in tests] == ["test_policy_gradient.py"]
    names = {n.name for n in ast.parse(tests[0].read_text()).body
             if isinstance(n, ast.FunctionDef) and n.name.startswith("test")}
    assert names == {"test_grpo_advantages_by_hand"}
    assert (tmp_path / "hw" / "llm_from_scratch" / "ppo.py").exists() is False  # only what it imports


# ----------------------------------------------------------------------------- bad input: one line, exit code 2


@pytest.mark.parametrize("args,message", [
    (["make", "nosuchmodule.f"], "no module 'nosuchmodule'"),
    (["make", "attention.no_such_function"], "has no function 'no_such_function'"),
    (["make", "model.CausalSelfAttention.forward"], "did you mean attention.CausalSelfAttention.forward?"),
    (["make", "attention.KVCache.advance"], "no test grades this function"),
    (["make", "notebooks/../README.md.ipynb"], "no such notebook"),
    (["nbgrader", "notebooks/no_such.ipynb"], "no such notebook"),
    (["nbgrader", "notebooks/02_attention.ipynb", "notebooks/02_attention.ipynb"], "named twice"),
])
def test_bad_input_is_one_error_line_and_exit_code_2(args, message, tmp_path):
    run = run_kit(*args, "--out", str(tmp_path / "hw"))
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and run.stderr.startswith("error: "), run.stderr
    assert message in run.stderr
    assert not (tmp_path / "hw").exists()  # nothing written


def test_usage_mistakes_are_one_line_too():
    run = run_kit("make", "dpo.dpo_loss")  # no --out
    assert (run.returncode == 2 and run.stderr.count("\n") == 1 and run.stderr.startswith("error: ")
            and "--out" in run.stderr)
    run = run_kit("make", "notebooks/02_attention.ipynb", "notebooks/03_gpt.ipynb", "--out", "/nowhere")
    assert run.returncode == 2 and "one notebook at a time" in run.stderr


def test_force_never_removes_the_repository_or_the_working_folder(tmp_path):
    (tmp_path / "precious.txt").write_text("keep me")
    for out, cwd in ((".", tmp_path), (str(tmp_path.parent), tmp_path), (str(ROOT), tmp_path),
                     (str(ROOT / "tests"), tmp_path)):
        run = run_kit("make", "dpo.dpo_loss", "--out", out, "--force", cwd=cwd)
        assert (run.returncode == 2 and run.stderr.startswith("error: ")
                and "name a new folder" in run.stderr), (out, run.stderr)
    assert (tmp_path / "precious.txt").read_text() == "keep me" and (ROOT / "tests" / "classroom" / "bugs.py").exists()


def test_the_order_to_implement_puts_what_a_function_calls_first():
    names = [t.name for t in kit.resolve(["generation.sequence_logprobs", "model.Block.forward", "tokenizer.merge_pair",
                                          "data.TokenWindowDataset.__getitem__"])]
    assert names == ["tokenizer.merge_pair", "data.TokenWindowDataset.__getitem__", "model.Block.forward",
                     "generation.sequence_logprobs"]


def test_a_non_empty_out_folder_is_refused_unless_forced(tmp_path):
    out = tmp_path / "hw"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    run = run_kit("make", "dpo.dpo_loss", "--out", str(out))
    assert run.returncode == 2 and run.stderr.startswith("error: ") and "--force" in run.stderr
    assert (out / "mine.txt").read_text() == "keep me"
    run = run_kit("make", "dpo.dpo_loss", "--out", str(out), "--force")
    assert run.returncode == 0, run.stderr
    assert not (out / "mine.txt").exists() and (out / "llm_from_scratch" / "dpo.py").exists()


@pytest.mark.parametrize("text", ["{}", "[1, 2]", "not json"])
def test_a_file_that_is_no_notebook_is_refused(tmp_path, text):
    nb = tmp_path / "odd.ipynb"
    nb.write_text(text)
    run = run_kit("make", str(nb), "--out", str(tmp_path / "hw"))
    assert run.returncode == 2 and run.stderr.startswith("error: ") and "not a notebook" in run.stderr, run.stderr
    assert run.stderr.count("\n") == 1 and not (tmp_path / "hw").exists()


def test_a_notebook_without_marked_cells_is_refused(tmp_path):
    nb = tmp_path / "plain.ipynb"
    nb.write_text(json.dumps({"cells": [{"cell_type": "code", "source": ["x = 1\n"], "metadata": {}, "outputs": [],
                                         "execution_count": None}],
                              "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    for command in ("make", "nbgrader"):
        run = run_kit(command, str(nb), "--out", str(tmp_path / "hw"))
        assert run.returncode == 2 and run.stderr.startswith("error: ") and "### BEGIN SOLUTION" in run.stderr
        assert run.stderr.count("\n") == 1 and not (tmp_path / "hw").exists()


def test_nbgrader_lays_out_a_course_folder(tmp_path):
    run = run_kit("nbgrader", "notebooks/02_attention.ipynb", "notebooks/03_gpt.ipynb", "--out", str(tmp_path / "c"))
    assert run.returncode == 0 and "2 assignments" in run.stdout and "nbgrader generate_assignment 02_attention" \
        in run.stdout, run.stderr
    for name in ("02_attention", "03_gpt"):
        folder = tmp_path / "c" / "source" / name
        nb = json.loads((folder / f"{name}.ipynb").read_text())
        assert kit.exercises(nb) and "### BEGIN HIDDEN TESTS" in json.dumps(nb)  # the instructor's source
        assert (folder / "llm_from_scratch" / "attention.py").is_file() and (folder / "chapters").is_dir()
        assert not (folder / "llm_from_scratch" / "classroom.py").exists()
    config = (tmp_path / "c" / "nbgrader_config.py").read_text()
    assert "c.CourseDirectory.course_id = 'llm-from-scratch'" in config and "c.Execute.timeout = 1800" in config
    compile(config, "nbgrader_config.py", "exec")


# ----------------------------------------------------------------------------- the grader catches wrong answers


@pytest.mark.slow
@pytest.mark.parametrize("target", [t.name for t in OFFERED])
def test_the_grader_passes_the_reference_and_fails_the_blank_and_every_catalogued_bug(target, tmp_path):
    graded_by = {f"tests/{f}::{n}" for f, n in next(t for t in OFFERED if t.name == target).tests}
    kit.make_assignment([target], tmp_path / "blank")
    folders = {"blank": tmp_path / "blank"}
    for i, (what, old, new) in enumerate([("reference", "", "")] + BUGS[target]):
        folder = tmp_path / f"v{i}"
        kit.make_assignment([target], folder, solution=True)
        if old:
            plant(folder, target, old, new)
        folders[what] = folder
    results = dict(zip(folders, grade(*folders.values())))

    code, outcomes, out = results.pop("reference")
    assert code == 0 and set(outcomes) == graded_by, f"the grader fails the reference:\n{out}"
    code, outcomes, out = results.pop("blank")
    assert code != 0, f"the grader passes the blank:\n{out}"
    passing = [t for t in graded_by if "FAILED" not in outcomes.get(t, []) and "ERROR" not in outcomes.get(t, [])]
    assert not passing, f"these tests pass with the blank, so they do not grade {target}: {passing}"
    missed = [what for what, (code, _, _) in results.items() if code == 0]
    assert not missed, f"the grader of {target} passes these wrong implementations: {missed}"


# ----------------------------------------------------------------------------- notebooks (nbgrader's convention)


NOTEBOOKS = kit.course_notebooks()


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_a_student_notebook_is_valid_python_with_every_answer_a_stub(path):
    nb = json.loads(path.read_text())
    student = kit.student_notebook(nb)
    answers = {e.number: kit.source_of(e.solution) for e in kit.exercises(student)}
    assert len(answers) == len(kit.exercises(nb)) >= 3
    for k, text in answers.items():
        compile(text, path.name, "exec")  # the student's cell is valid Python
        assert text.startswith(f"# Exercise {k}\n") and text.endswith("# YOUR CODE HERE\nraise NotImplementedError()")
    for before, after in zip(nb["cells"], student["cells"]):
        if not kit.nbgrader_of(before):  # every other cell as it was, less its outputs
            assert kit.source_of(after) == kit.source_of(before) and after.get("outputs", []) == []


def grade_notebook(folder: Path, submission: Path | None = None) -> tuple[int, str]:
    """Start the notebook grader `make` wrote in `folder` (on its own notebook, or on `submission`)."""
    env = dict(os.environ, PYTHONPATH="", LLMFS_RUNS_DIR=str(folder / "runs"))
    env.pop("LLMFS_SUBMISSION", None)
    if submission:
        env["LLMFS_SUBMISSION"] = str(submission)
    return subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider"], cwd=folder,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
def test_a_notebook_assignment_scores_the_answers_the_blank_and_a_wrong_answer_as_nbgrader_would(tmp_path):
    from wrong_answers import WRONG
    path = ROOT / "notebooks" / "02_attention.ipynb"
    for args in (["--out", str(tmp_path / "student")], ["--out", str(tmp_path / "solution"), "--solution"]):
        run = run_kit("make", str(path), *args)
        assert run.returncode == 0 and "4 exercises (8 points)" in run.stdout, run.stderr
    blank = tmp_path / "student" / "notebooks" / path.name
    assert "### BEGIN SOLUTION" not in blank.read_text() and "# YOUR CODE HERE" in blank.read_text()
    assert "BEGIN HIDDEN TESTS" in (tmp_path / "solution" / "notebooks" / path.name).read_text()
    # a student's copy: exercises 1 and 2 answered, 3 answered wrongly, 4 left blank
    student, solved = json.loads(blank.read_text()), kit.course_notebook(json.loads(path.read_text()))
    what, old, new = WRONG["02_attention"][3]
    for mine, right in zip(kit.exercises(student)[:3], kit.exercises(solved)):
        text = kit.source_of(right.solution).replace(old, new) if right.number == 3 else kit.source_of(right.solution)
        mine.solution["source"] = text.replace(kit.BEGIN + "\n", "").replace(kit.END, "")
    kit.write_notebook(student, tmp_path / "alice.ipynb")
    runs = [grade_notebook(tmp_path / "solution"), grade_notebook(tmp_path / "solution", tmp_path / "alice.ipynb")]
    (code_r, log_r), (code_a, log_a) = [(r.wait(600), r.stdout.read()) for r in runs]
    assert code_r == 0 and "4 passed" in log_r and "score: 8 of 8 points" in log_r, log_r[-3000:]
    assert code_a != 0 and "2 failed, 2 passed" in log_a and "score: 4 of 8 points" in log_a, log_a[-3000:]
    assert re.search(r"FAILED tests/test_notebook.py::test_exercise\[02-exercise-3-tests", log_a), log_a[-3000:]
    assert "must not see the padding" in log_a  # exercise 3: the visible test that the wrong mask fails
    assert "the answer cell above them raised NotImplementedError" in log_a  # exercise 4, blank


def test_the_readme_states_the_catalogue_as_it_is():
    readme = (ROOT / "README.md").read_text()
    n_bugs = sum(len(v) for v in BUGS.values())
    assert f"catalogues {n_bugs} typical wrong" in readme and f"all {n_bugs} are caught" in readme
    assert f"handed out ({len(OFFERED)} today" in readme and f"each of the {len(OFFERED)} functions" in readme
