"""The committed notebooks' outputs are clean: what a student sees when they open a notebook on GitHub.

Mechanical checks, one per rule of the project's notebook standard (CONTRIBUTING.md):
no path of the machine that ran them, no progress bar frozen mid-way, no figure drawn twice, no raw JSON dump,
and sample tables that show the prompt as well as the answer. The checks read the outputs only; the notebook
test (test_notebooks.py) runs the code."""

import json
import re
import textwrap
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")) + sorted((ROOT / "notebooks").glob("[A-Z]_*.ipynb"))

ABSOLUTE_PATH = re.compile(r"(?<![\w.~])(/(home|Users|tmp|work|root|private|var/folders|mnt|opt)/[\w.\-/]+"
                           r"|[A-Za-z]:\\\\[\w.\-\\]+)")
PROGRESS = re.compile(r"(\d+)%\|")  # tqdm: ' 37%|███▋      | 37/100 [...]'
ANSWER_COLUMN = re.compile(r"\b(response|answer|completion|sample|output)s?\b", re.IGNORECASE)
PROMPT_COLUMN = re.compile(r"\b(prompt|question|instruction|input)s?\b", re.IGNORECASE)


def output_texts(output) -> list[str]:
    """Every piece of text an output shows (streams, plain text, markdown, HTML)."""
    if output.output_type == "stream":
        return [output.text]
    if output.output_type in ("execute_result", "display_data"):
        data = output.get("data", {})
        return [data[k] for k in ("text/plain", "text/markdown", "text/html") if k in data]
    if output.output_type == "error":
        return ["\n".join(output.get("traceback", []))]
    return []


def absolute_paths(text: str) -> list[str]:
    return [m.group(0) for m in ABSOLUTE_PATH.finditer(text)]


def frozen_progress_bars(text: str) -> list[str]:
    """Progress bars whose last state (what the reader sees, after the carriage returns) is not 100%."""
    frozen = []
    for line in text.split("\n"):
        states = [part for part in line.split("\r") if part.strip()]
        m = PROGRESS.search(states[-1]) if states else None
        if m and int(m.group(1)) < 100:
            frozen.append(states[-1].strip())
    return frozen


def duplicate_images(outputs) -> int:
    """How many images in one cell's outputs repeat an earlier one (a figure both displayed and returned)."""
    images = [o.data["image/png"] for o in outputs if o.output_type in ("display_data", "execute_result")
              and "image/png" in o.get("data", {})]
    figure_reprs = [o for o in outputs if o.output_type in ("display_data", "execute_result")  # a figure's bare repr
                    and "image/png" not in o.get("data", {})
                    and re.fullmatch(r"<Figure size [^>]*>", o.get("data", {}).get("text/plain", "").strip())]
    return len(images) - len(set(images)) + len(figure_reprs)


def is_json_dump(text: str) -> bool:
    """A multi-line JSON object or list printed as is (json.dumps(..., indent=...)): present the numbers instead."""
    text = text.strip()
    if text.count("\n") < 4 or text[:1] not in "{[":
        return False
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def tables_without_prompts(text: str) -> list[str]:
    """Header rows of markdown/HTML tables that show answers but not what was asked."""
    headers = [line for line in text.split("\n") if line.lstrip().startswith("|")
               and not set(line.replace("|", "").strip()) <= set("-: ")]
    headers = [h for i, h in enumerate(headers) if i == 0 or not text.split(h)[0].rstrip().endswith("|")]
    headers += re.findall(r"<thead>.*?</thead>", text, flags=re.DOTALL)
    return [h.strip() for h in headers if ANSWER_COLUMN.search(h) and not PROMPT_COLUMN.search(h)]


def problems(nb) -> list[str]:
    found = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        outputs = cell.get("outputs", [])
        streams = {}  # a stream arrives in pieces; the reader sees them joined
        for o in outputs:
            if o.output_type == "stream":
                streams[o.name] = streams.get(o.name, "") + o.text
        texts = list(streams.values()) + [t for o in outputs if o.output_type != "stream" for t in output_texts(o)]
        for text in texts:
            found += [f"cell {i}: absolute path {p!r}" for p in absolute_paths(text)]
            found += [f"cell {i}: progress bar left at {b!r}" for b in frozen_progress_bars(text)]
            if is_json_dump(text):
                found.append(f"cell {i}: a raw JSON dump ({text.strip()[:40]!r}...)")
            found += [f"cell {i}: a table of answers without the prompt: {h[:80]!r}"
                      for h in tables_without_prompts(text)]
        if duplicate_images(outputs):
            found.append(f"cell {i}: a figure drawn twice")
    return found


def test_the_checks_catch_what_they_should():
    assert absolute_paths("saved to /work/main/runs/pretrain and /home/ana/x.png") == ["/work/main/runs/pretrain",
                                                                                      "/home/ana/x.png"]
    assert absolute_paths("saved to runs/pretrain (tokens/s 1,234; 3/4 done)") == []
    assert (frozen_progress_bars("train:  37%|███▋      | 37/100 [00:03<00:06]\r")
            == ["train:  37%|███▋      | 37/100 [00:03<00:06]"])
    assert frozen_progress_bars("train:  37%|███▋ | 37/100\rtrain: 100%|██████████| 100/100\n") == []
    assert is_json_dump('{\n  "accuracy": 0.76,\n  "n": 3,\n  "x": 1,\n  "y": 2\n}')
    assert not is_json_dump("accuracy 0.76\nn 3\n")
    assert (tables_without_prompts("| task | response | gold |\n|---|---|---:|\n| qa | blue | 1.0 |")
            == ["| task | response | gold |"])
    assert tables_without_prompts("| task | prompt | response |\n|---|---|---|\n| qa | What? | blue |") == []
    png = {"output_type": "display_data", "data": {"image/png": "iVBOR..."}, "metadata": {}}
    twice = [nbformat.from_dict(png), nbformat.from_dict(dict(png, output_type="execute_result", execution_count=1))]
    assert duplicate_images(twice) == 1 and duplicate_images(twice[:1]) == 0
    bare = nbformat.from_dict({"output_type": "display_data",
                               "data": {"text/plain": "<Figure size 640x480 with 1 Axes>"}, "metadata": {}})
    assert duplicate_images(twice[:1] + [bare]) == 1


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_committed_outputs_are_clean(path):
    found = problems(nbformat.read(path, as_version=4))
    assert not found, f"{path.name}:\n" + "\n".join(found)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_every_cell_has_an_id(path):
    """nbformat 4.5 cells carry an id (a cell added by hand without one draws a warning, and later an error)."""
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    assert [i for i, c in enumerate(cells) if "id" not in c] == []


def section_numbers(nb) -> list[int]:
    """The numbers of a notebook's numbered sections ('## 3. The loop, live' -> 3), in the order they appear."""
    return [int(m.group(1)) for cell in nb.cells if cell.cell_type == "markdown"
            for m in re.finditer(r"^## (\d+)\. ", cell.source, flags=re.MULTILINE)]


def solution_cells_with_outputs(nb) -> list[int]:
    """The exercise cells (an answer, or the autograder tests that check it) committed with outputs."""
    return [i for i, cell in enumerate(nb.cells) if cell.cell_type == "code"
            and {"solution", "tests"} & set(cell.metadata.get("tags", [])) and cell.get("outputs")]


def test_the_structure_checks_catch_what_they_should():
    md = nbformat.v4.new_markdown_cell
    skipped = nbformat.v4.new_notebook(cells=[md("# Chapter\n\n## 2. Second"), md("## 3. Third\n## Exercises")])
    assert section_numbers(skipped) == [2, 3]
    solved = nbformat.v4.new_code_cell("# Solution to exercise 1", metadata={"tags": ["solution"]},
                                       outputs=[nbformat.v4.new_output("stream", text="42\n")])
    assert solution_cells_with_outputs(nbformat.v4.new_notebook(cells=[solved])) == [0]
    checked = nbformat.v4.new_code_cell("# Tests for exercise 1 (1 point)", metadata={"tags": ["tests"]},
                                        outputs=[nbformat.v4.new_output("stream", text="42\n")])
    assert solution_cells_with_outputs(nbformat.v4.new_notebook(cells=[solved, checked])) == [0, 1]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_sections_are_numbered_from_one(path):
    """'## 1.', '## 2.', ... with none skipped: the sections the introduction lists are the ones that follow."""
    numbers = section_numbers(nbformat.read(path, as_version=4))
    assert numbers == list(range(1, len(numbers) + 1)), f"{path.name}: sections numbered {numbers}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_solution_cells_are_committed_without_outputs(path):
    """A student who opens the notebook sees each exercise's question, not its answer nor what its tests printed
    (CONTRIBUTING.md, rule 6)."""
    assert solution_cells_with_outputs(nbformat.read(path, as_version=4)) == []


def shown_sources(nb) -> list[tuple[int, str]]:
    """The code blocks a notebook displays with show(fn): (cell index, the source it printed)."""
    return [(i, text[len("```python\n"):].rsplit("```", 1)[0]) for i, cell in enumerate(nb.cells)
            for output in cell.get("outputs", []) for text in output_texts(output)
            if text.startswith("```python\n")]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_the_library_source_a_notebook_shows_is_the_current_source(path):
    """show(fn) prints the library's own source: the committed output must still be that source, not an older one."""
    files = [p.read_text() for folder in ("llm_from_scratch", "chapters") for p in sorted((ROOT / folder).glob("*.py"))]
    stale = [(i, code.split("\n")[0][:80]) for i, code in shown_sources(nbformat.read(path, as_version=4))
             if not any(code in text or textwrap.indent(code, "    ") in text for text in files)]
    assert not stale, f"{path.name}: cells whose shown source is no longer the library's (re-run them): {stale}"


# chapters 5-10, and appendix A (its LoRA runs start from the same SFT model)
CHAIN_NOTEBOOKS = [p for p in NOTEBOOKS if p.name[:2] in ("05", "06", "07", "08", "09", "10", "A_")]
DIGEST = re.compile(r"sha256 of its weights: ([0-9a-f]{12})\b")


def first_output_text(nb) -> str:
    """The text of the first code cell that has outputs: where notebooks 05-10 say which SFT model they read."""
    for cell in nb.cells:
        if cell.cell_type == "code" and cell.get("outputs"):
            return "".join(t for o in cell.outputs for t in output_texts(o))
    return ""


def sft_digests(notebooks) -> dict[str, str | None]:
    found = {}
    for path, nb in notebooks:
        m = DIGEST.search(first_output_text(nb))
        found[path] = m.group(1) if m else None
    return found


def test_the_digest_check_reads_the_first_output():
    cell = nbformat.v4.new_code_cell("print(...)")
    cell.outputs = [nbformat.v4.new_output("stream", text="quick mode: False\nthe SFT model every number below comes "
                                           "from: runs/sft | sha256 of its weights: 0123456789ab\n")]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# x"), cell])
    assert sft_digests([("a", nb)]) == {"a": "0123456789ab"}
    cell.outputs[0].text = "the SFT model every number below comes from: runs/sft | sha256 of its weights: none yet"
    assert sft_digests([("a", nb)]) == {"a": None}


def test_notebooks_05_to_10_read_one_sft_model():
    """Issue 26's one chain: every committed notebook of chapters 5-10 and appendix A printed, in its first output,
    the digest of the SFT weights it read, and it is the same digest in all of them (one course run, not two stitched
    together)."""
    assert len(CHAIN_NOTEBOOKS) == 7, [p.name for p in CHAIN_NOTEBOOKS]
    digests = sft_digests([(p.name, nbformat.read(p, as_version=4)) for p in CHAIN_NOTEBOOKS])
    missing = [name for name, d in digests.items() if d is None]
    assert not missing, f"no SFT digest in the first output of {missing}: execute them on the course's chain"
    assert len(set(digests.values())) == 1, f"the notebooks read different SFT models: {digests}"
