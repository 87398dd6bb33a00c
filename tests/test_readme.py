"""The README's first two commands are the ones a newcomer runs; CI must run exactly the second one."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    return re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text(), flags=re.S)[:2]


def test_readme_opens_with_the_two_commands():
    course, tests = readme_commands()
    assert "chapters/run_all.py" in course and "pytest" in tests and "ruff check" in tests  # the lint runs with them
    head = (ROOT / "README.md").read_text()[:600]
    assert course in head and tests in head


def test_ci_runs_the_readme_test_command():
    _, tests = readme_commands()
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert tests in ci_lines


def test_requirements_admit_the_pinned_torch():
    # CI installs torch==2.13.0 first; the requirements' range must accept it or pip pulls another build
    req = (ROOT / "requirements.txt").read_text()
    spec = re.search(r"^torch(.*)$", req, flags=re.M).group(1).strip()
    assert spec.startswith(">=") and tuple(int(x) for x in spec[2:].split(".")) <= (2, 13)


def test_readme_has_no_unfilled_placeholders():
    text = (ROOT / "README.md").read_text()
    assert not re.search(r"\b[A-Z]+_[A-Z_]+RESULTS\b|TODO|TBD", text)
