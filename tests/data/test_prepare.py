"""`python -m drgrpo_jax.data prepare`: fixtures in each public dataset's own schema, written at test time, become
problem/answer JSONL whose answers the real math_verify reward (rewards/functions.py) scores as the configs do.

Where each schema comes from (field names as the datasets publish them):
- math12k, `hiyouga/math12k`: `problem`, `answer` (its dataset card; EasyR1's examples/config.yaml reads it with
  prompt_key=problem, answer_key=answer; splits train 12000, test 500).
- math500, `HuggingFaceH4/MATH-500`: `problem`, `solution`, `answer`, `subject`, `level`, `unique_id` (the card's
  dataset_info features; split test). The first row below is its first row.
- MATH as Hendrycks et al. published it (`EleutherAI/hendrycks_math`, `lighteval/MATH`, the old `competition_math`
  card in the TFDS community catalog): `problem`, `level`, `type`, `solution`, the answer in the solution's last
  `\\boxed{}` (a --source of math12k or math500 in that schema).
- gsm8k, `openai/gsm8k` subset `main`: `question`, `answer`, the answer's last line `#### 72` (the dataset card;
  `load_dataset("openai/gsm8k", "main", split="test")` in lm-eval and many trainers). The first row is its first
  train row.
- aime24, `HuggingFaceH4/aime_2024`: `id`, `problem`, `solution`, `answer` (a string), `url`, `year` (its card; split
  train, 30 rows); the mirror `Maxwell-Jia/AIME_2024` writes `ID`, `Problem`, `Solution`, `Answer` (an int).
"""

import json
import os
import pathlib
import stat

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from drgrpo_jax.data.cli import main
from drgrpo_jax.data.examples import Example
from drgrpo_jax.data.prepare import RECIPES, prepare_rows
from drgrpo_jax.errors import ConfigError
from drgrpo_jax.rewards.functions import math_verify_reward

from support.hf_cache import commit, read_only_offline, write_parquet_dataset

MATH500 = [
    {"problem": "Convert the point $(0,3)$ in rectangular coordinates to polar coordinates.  Enter your answer in "
                "the form $(r,\\theta),$ where $r > 0$ and $0 \\le \\theta < 2 \\pi.$",
     "solution": "We have that $r = \\sqrt{0^2 + 3^2} = 3.$  Also, if we draw the line connecting the origin and "
                 "$(0,3),$ this line makes an angle of $\\frac{\\pi}{2}$ with the positive $x$-axis.\n\nTherefore, "
                 "the polar coordinates are $\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}.$",
     "answer": "\\left( 3, \\frac{\\pi}{2} \\right)", "subject": "Precalculus", "level": 2,
     "unique_id": "test/precalculus/807.json"},
    {"problem": "What is $\\frac{1}{2} + \\frac{1}{3}$?", "solution": "$\\frac{3}{6} + \\frac{2}{6} = "
     "\\boxed{\\frac{5}{6}}$.", "answer": "\\frac{5}{6}", "subject": "Prealgebra", "level": 1,
     "unique_id": "test/prealgebra/1.json"},
]
MATH12K = [{"problem": "Compute $\\dbinom{8}{4}$.", "answer": "70"},
           {"problem": "Simplify $\\sqrt{50}$.", "answer": "5\\sqrt{2}"}]
HENDRYCKS = [
    {"problem": "How many vertical asymptotes does the graph of $y=\\frac{2}{x^2+x-6}$ have?", "level": "Level 3",
     "type": "Algebra", "solution": "The denominator factors as $(x+3)(x-2)$, so there are $\\boxed{2}$ vertical "
                                    "asymptotes."},
    {"problem": "Find $x$ if $2x = 1$.", "level": "Level 1", "type": "Algebra",
     "solution": "Dividing, $x = \\boxed{\\frac{1}{2}}$."},
    {"problem": "A proof without a boxed answer.", "level": "Level 5", "type": "Geometry", "solution": "Done."},
]
GSM8K = [
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How "
                 "many clips did Natalia sell altogether in April and May?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
               "altogether in April and May.\n#### 72"},
    {"question": "A farm sells 1,000 eggs a day for 5 days. How many eggs?",
     "answer": "1,000 * 5 = <<1000*5=5000>>5000\n#### 5,000"},
]
AIME_H4 = [{"id": 60, "problem": "Every morning Aya goes for a $9$-kilometer-long walk ...",
            "solution": "... so the walk takes $\\boxed{204}$ minutes.", "answer": "204",
            "url": "https://artofproblemsolving.com/wiki/index.php/2024_AIME_I_Problems/Problem_1", "year": "2024"},
           {"id": 61, "problem": "Find the remainder ...", "solution": "...", "answer": "033", "url": "",
            "year": "2024"}]
AIME_MIRROR = [{"ID": "2024-I-1", "Problem": "Every morning Aya goes for a $9$-kilometer-long walk ...",
                "Solution": "...", "Answer": 204}]


def _parquet(path, rows) -> str:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def _jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def _prepare(name: str, source: str, output, *flags: str) -> list[dict]:
    assert main(["prepare", name, str(output), "--source", source, *flags]) == 0
    return [json.loads(line) for line in output.read_text().splitlines()]


def _scores(row: dict, completion: str, answer_format: str = "boxed") -> float:
    return math_verify_reward(completion, Example("prepared/0", row["problem"], row["answer"]),
                              answer_format=answer_format)


def test_math500_and_math12k(tmp_path):
    rows = _prepare("math500", _parquet(tmp_path / "test-00000-of-00001.parquet", MATH500), tmp_path / "m500.jsonl")
    assert [set(row) for row in rows] == [{"problem", "answer"}] * 2
    assert rows[0]["problem"] == MATH500[0]["problem"]
    assert rows[0]["answer"] == "\\left( 3, \\frac{\\pi}{2} \\right)"
    assert _scores(rows[0], "The point is $\\boxed{\\left(3, \\frac{\\pi}{2}\\right)}$.") == 1.0
    assert _scores(rows[1], "The sum is \\boxed{\\frac{10}{12}}") == 1.0  # equal values, other form
    assert _scores(rows[1], "The sum is \\boxed{\\frac{2}{5}}") == 0.0
    rows = _prepare("math12k", _jsonl(tmp_path / "math12k.jsonl", MATH12K), tmp_path / "m12k.jsonl")
    assert [row["answer"] for row in rows] == ["70", "5\\sqrt{2}"]
    # The Qwen recipes ask for <answer> tags (reward.answer_format: answer_tags).
    assert _scores(rows[0], "<think>8 choose 4</think> <answer>70</answer>", "answer_tags") == 1.0
    assert _scores(rows[1], "<answer>\\sqrt{50}</answer>", "answer_tags") == 1.0
    assert _scores(rows[1], "<answer>7</answer>", "answer_tags") == 0.0


def test_math_solutions_give_the_last_boxed_answer(tmp_path, capsys):
    rows = _prepare("math12k", _parquet(tmp_path / "hendrycks.parquet", HENDRYCKS), tmp_path / "out.jsonl")
    assert [row["answer"] for row in rows] == ["2", "\\frac{1}{2}"]  # the proof without \boxed is left out
    assert "left out 1 (1 without an answer" in capsys.readouterr().err
    assert _scores(rows[0], "There are \\boxed{2}.") == 1.0
    assert _scores(rows[1], "x = \\boxed{0.5}") == 1.0


def test_gsm8k(tmp_path):
    rows = _prepare("gsm8k", _jsonl(tmp_path / "gsm8k.jsonl", GSM8K), tmp_path / "gsm8k_test.jsonl")
    assert [row["answer"] for row in rows] == ["72", "5000"]  # after ####, thousands separators dropped
    assert rows[0]["problem"] == GSM8K[0]["question"]
    assert _scores(rows[0], "24 in May, so \\boxed{72}") == 1.0
    assert _scores(rows[1], "\\boxed{5000} eggs") == 1.0
    assert _scores(rows[1], "\\boxed{1000} eggs") == 0.0


def test_aime24_and_its_mirror(tmp_path):
    rows = _prepare("aime24", _parquet(tmp_path / "aime.parquet", AIME_H4), tmp_path / "aime24.jsonl")
    assert [row["answer"] for row in rows] == ["204", "33"]
    assert _scores(rows[0], "\\boxed{204}") == 1.0 and _scores(rows[1], "\\boxed{33}") == 1.0
    assert _scores(rows[0], "\\boxed{240}") == 0.0
    mirror = _prepare("aime24", _jsonl(tmp_path / "mirror.jsonl", AIME_MIRROR), tmp_path / "mirror_out.jsonl")
    assert mirror == [{"problem": AIME_MIRROR[0]["Problem"], "answer": "204"}]


def test_the_default_source_is_the_hub_id_read_from_the_cache(tmp_path, monkeypatch):
    """gsm8k with no --source reads openai/gsm8k's subset main, split test, from the HF cache (offline)."""
    home = tmp_path / "hf"
    commit(home / "hub", "dataset", "openai/gsm8k", "4" * 40, ("main",), lambda folder: write_parquet_dataset(
        folder, {"main": {"train": GSM8K[:1], "test": GSM8K[1:]}, "socratic": {"test": GSM8K[:1]}}))
    read_only_offline(monkeypatch, str(home))
    assert main(["prepare", "gsm8k", str(tmp_path / "test.jsonl")]) == 0
    assert [json.loads(line)["answer"] for line in (tmp_path / "test.jsonl").read_text().splitlines()] == ["5000"]
    assert main(["prepare", "gsm8k", str(tmp_path / "train.jsonl"), "--split", "train"]) == 0
    assert json.loads((tmp_path / "train.jsonl").read_text())["answer"] == "72"


def test_errors_are_one_line_with_exit_status_2(tmp_path, monkeypatch, capsys):
    read_only_offline(monkeypatch, str(tmp_path / "empty_hf"))
    assert main(["prepare", "math500", str(tmp_path / "out.jsonl")]) == 2
    error = capsys.readouterr().err.strip()
    assert error.splitlines() == [error] and error.endswith("hf download HuggingFaceH4/MATH-500 --repo-type dataset")
    assert main(["prepare", "gsm8k", str(tmp_path / "out.jsonl"), "--source",
                 _jsonl(tmp_path / "math.jsonl", MATH12K)]) == 2
    assert "--source: row 0 has no 'question' field" in capsys.readouterr().err
    assert main(["prepare", "aime24", str(tmp_path / "o.jsonl"), "--source", str(tmp_path / "a.csv")]) == 2
    assert "--source: no such file" in capsys.readouterr().err
    (tmp_path / "broken.parquet").write_text("not parquet")
    assert main(["prepare", "aime24", str(tmp_path / "o.jsonl"), "--source", str(tmp_path / "broken.parquet")]) == 2
    assert "--source: cannot read" in capsys.readouterr().err
    assert not (tmp_path / "out.jsonl").exists()
    with pytest.raises(SystemExit):
        main(["prepare", "math13k", str(tmp_path / "out.jsonl")])  # argparse names the choices


def test_the_help_says_what_the_command_does(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse's line wrapping undone
    assert "`prepare` writes a public math set as the problem/answer JSONL the configs read" in text


def test_every_recipe_has_its_hub_id_and_split():
    assert set(RECIPES) == {"math12k", "math500", "gsm8k", "aime24"}
    with pytest.raises(ConfigError, match="has no 'problem' field"):
        prepare_rows(RECIPES["math500"], [{"question": "q", "answer": "1"}])


def _one_line_error(capsys) -> str:
    error = capsys.readouterr().err.strip()
    assert error.splitlines() == [error], error
    return error


@pytest.mark.parametrize("content, words", [
    (b"42\n", "line 1 is not a JSON object"),
    (b'"a string"\n', "line 1 is not a JSON object"),
    (b"[" * 100_000 + b"]" * 100_000 + b"\n", "line 1 is nested too deep"),
    (b'{"problem": "\xff", "answer": "1"}\n', "line 1 is not UTF-8"),
    (b'{"problem": "p", "answer": ' + b"9" * 5000 + b"}\n", "line 1 is not JSON"),
])
def test_hostile_sources_exit_2_in_one_line_naming_file_and_line(tmp_path, capsys, content, words):
    source = tmp_path / "source.jsonl"
    source.write_bytes(content)
    assert main(["prepare", "math12k", str(tmp_path / "out.jsonl"), "--source", str(source)]) == 2
    assert f"--source: {source} {words}" in _one_line_error(capsys)
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize("answer", ["(" * 20_000 + ")" * 20_000, "9" * 5000])
def test_a_reference_math_verify_could_take_minutes_over_is_refused_naming_its_row(tmp_path, capsys, answer):
    """40 KB of nested parentheses took 274 s and 1.7 GB in math_verify; a 5000-digit integer passes Python's
    int-str limit. Either is refused before math_verify sees it."""
    source = _jsonl(tmp_path / "aime.jsonl", [AIME_MIRROR[0], {"Problem": "p", "Answer": answer}])
    assert main(["prepare", "aime24", str(tmp_path / "out.jsonl"), "--source", source]) == 2
    assert f"--source: row 1's answer has {len(answer)} characters, more than the 1000" in _one_line_error(capsys)


@pytest.mark.parametrize("kind", ["symlink", "fifo", "device"])
def test_an_output_that_is_not_a_regular_file_is_refused_and_left_alone(tmp_path, capsys, kind):
    """prepare used to write OUT.partial and rename it over OUT: a device node, a FIFO or a symlink was replaced."""
    target = tmp_path / "target.txt"
    target.write_text("keep")
    output = tmp_path / "out.jsonl"
    if kind == "symlink":
        output.symlink_to(target)
    elif kind == "fifo":
        os.mkfifo(output)
    else:
        output = pathlib.Path("/dev/full")
    source = _jsonl(tmp_path / "m.jsonl", MATH12K)
    assert main(["prepare", "math12k", str(output), "--source", source]) == 2
    assert f"OUT.jsonl: {output} exists and is" in _one_line_error(capsys)
    assert target.read_text() == "keep" and output.is_symlink() == (kind == "symlink")
    assert (kind != "fifo" or stat.S_ISFIFO(output.lstat().st_mode)) and (kind != "device" or output.is_char_device())
    assert not [name for name in os.listdir(tmp_path) if "partial" in name]
