"""Every module can be copied out, with only the package files it imports, and works there.

Also enforces the course's ordering rule (README, "Copying one module into an assignment"): a module
imports only modules of its own or an earlier chapter, so the book's order is visible in the code and an instructor
can hand out one chapter's module together with its few predecessors.
"""

import shutil
from pathlib import Path

import pytest
from isolated import run_isolated

from llm_from_scratch.classroom import CHAPTER, closure, package_imports

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "llm_from_scratch"

MODULES = sorted(p.stem for p in PKG.glob("*.py") if p.stem != "__init__")
# the machinery lives in the classroom kit, which builds assignments with it: package_imports(path) names the
# package modules a file imports; closure(m) is m and everything it imports, directly or not


def test_every_module_has_a_chapter():
    assert set(MODULES) <= set(CHAPTER), f"add new modules to CHAPTER: {set(MODULES) - set(CHAPTER)}"


@pytest.mark.parametrize("module", MODULES)
def test_imports_only_earlier_chapters(module):
    for dep in package_imports(PKG / f"{module}.py"):
        assert CHAPTER[dep] <= CHAPTER[module], f"{module} (ch{CHAPTER[module]}) imports {dep} (ch{CHAPTER[dep]})"


def test_import_parser_sees_all_forms(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("from llm_from_scratch.a import x\nfrom llm_from_scratch import b\nfrom .c import y\nfrom . import d\n"
                 "import llm_from_scratch.e\nimport os\n")
    assert package_imports(f) == {"a", "b", "c", "d", "e"}


@pytest.mark.parametrize("module", MODULES)
def test_module_works_copied_alone(module, tmp_path):
    deps = closure(module)
    pkg = tmp_path / "llm_from_scratch"
    pkg.mkdir()
    shutil.copy(PKG / "__init__.py", pkg)
    for m in deps:
        shutil.copy(PKG / f"{m}.py", pkg)
    # import it, and run its own unit tests against the copy as in an assignment built from this one file, in a fresh
    # process with the copy first on the path and the repository nowhere on it
    test_file = ROOT / "tests" / f"test_{module}.py"
    runs_tests = test_file.exists() and package_imports(test_file) <= deps
    if runs_tests:
        (tmp_path / "tests").mkdir()
        shutil.copy(test_file, tmp_path / "tests")
    args = (("-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path), f"tests/{test_file.name}") if runs_tests
            else None)
    [run] = run_isolated([tmp_path], ROOT, imports=(f"llm_from_scratch.{module}",), pytest_args=args, workers=1)
    assert run.files[f"llm_from_scratch.{module}"].startswith(str(tmp_path))
    assert run.code == 0, run.output[-5000:]


def test_reward_model_copies_out_with_at_most_eight_files():
    """An assignment built on the reward model should not drag SFT and the whole tiny world along (distributed.py
    comes with it: its trainer runs under torchrun too)."""
    assert len(closure("reward_model")) <= 8, sorted(closure("reward_model"))


def test_model_file_holds_the_network_only():
    """Like nanoGPT's model.py: torch and its own chapter's attention, nothing of files or run folders."""
    assert package_imports(PKG / "model.py") == {"attention"}
