"""The course's check questions: package data, asked by id, shuffled the same
way every time, never answered in the notebook's source."""

import collections
import json
import re

import pytest

from dpnb import quiz
from helpers.nbutil import REPO

NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))


def _all():
    return [q for ch in quiz.chapters() for q in quiz.load(ch)]


def _sources() -> dict[str, str]:
    return {p.name: "\n".join("".join(c["source"]) for c in json.loads(p.read_text())["cells"])
            for p in NOTEBOOKS}


def test_every_question_has_one_answer_and_an_explanation_per_option():
    qs = _all()
    assert len(qs) >= 29
    assert len({q.qid for q in qs}) == len(qs)
    for q in qs:
        assert re.fullmatch(r"\d\d\.\d+", q.qid), q.qid
        assert len(q.options) >= 3 and len(set(q.options)) == len(q.options), q.qid
        assert all(len(e) > 20 for e in q.explanations), q.qid
        assert q.feedback(q.answer)[0] and not q.feedback((q.answer + 1) % len(q.options))[0]


def test_the_notebooks_ask_by_id_and_never_hold_an_answer():
    srcs = _sources()
    asked = collections.Counter()
    for name, src in srcs.items():
        assert "answer=" not in src and "explanations=" not in src, name
        calls = re.findall(r"\bask\((.*?)\)", src)
        for arg in calls:
            m = re.fullmatch(r'"(\d\d\.\d+)"', arg)
            assert m, f"{name}: ask({arg}) -- ask a course question by its id"
            assert m.group(1).startswith(name[:2]), f"{name} asks {m.group(1)}"
            asked[m.group(1)] += 1
    every = "\n".join(srcs.values())
    for q in _all():
        assert asked[q.qid] == 1, f"{q.qid} asked {asked[q.qid]} times"
        for e in q.explanations:
            assert e[:60] not in every, f"{q.qid}: an explanation is in a notebook"


def test_options_are_shuffled_the_same_way_every_time_and_answers_spread():
    import os
    import subprocess
    import sys

    qs = [quiz.get(q.qid) for q in _all()]
    # the same order in every process (a salted hash or a time seed would differ)
    code = ("from dpnb import quiz\nprint([quiz.get(q).options for q in "
            f"{[q.qid for q in qs]!r}])")
    runs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, env=dict(os.environ, PYTHONHASHSEED=seed)).stdout
            for seed in ("1", "2")}
    assert runs == {f"{[q.options for q in qs]!r}\n"}
    pos = collections.Counter(q.answer for q in qs)
    assert max(pos.values()) <= 0.4 * len(qs), pos
    assert sum(q.answer != a.answer for q, a in zip(qs, _all())) >= len(qs) // 2
    # the right option does not give itself away by being much the longest
    long = [q.qid for q in qs if len(q.options[q.answer]) > 1.15 * max(
        len(o) for i, o in enumerate(q.options) if i != q.answer)]
    assert len(long) <= 3, long


def test_text_mode_shows_the_options_and_explain_checks_a_pick():
    q = quiz.get("04.1")
    text = q.text()
    assert text.startswith("[04.1]") and "a) " in text and "Correct" not in text
    right = chr(97 + q.answer)
    assert quiz.explain("04.1", right).startswith("Correct.")
    wrong = chr(97 + (q.answer + 1) % len(q.options))
    assert quiz.explain("04.1", wrong).startswith("Not quite")
    with pytest.raises(ValueError, match="pick one of a, b, c, d"):
        quiz.explain("04.1", "z")
    with pytest.raises(KeyError, match="no question '04.9'"):
        quiz.get("04.9")
    with pytest.raises(KeyError, match="no questions for chapter '42'"):
        quiz.get("42.1")


def test_ask_prints_a_course_question_without_its_answer(capsys):
    quiz.ask("02.2")
    out = capsys.readouterr().out
    q = quiz.get("02.2")
    assert q.prompt in out and all(o in out for o in q.options)
    assert not any(e in out for e in q.explanations)
    quiz.ask("own?", ["x", "y"], 1, ["x is not it.", "y it is."])
    assert "own?" in capsys.readouterr().out


def test_every_chapter_opens_on_the_default_kernel_and_loads_dpnb_first():
    """Right after the README's install a notebook must run: the default
    "python3" kernel exists wherever Jupyter does (the dpnb kernelspec needs
    `dpnb kernel install`), and the first code cell loads the extension."""
    for p in NOTEBOOKS:
        nb = json.loads(p.read_text())
        assert nb["metadata"]["kernelspec"]["name"] == "python3", p.name
        first = next(c for c in nb["cells"] if c["cell_type"] == "code")
        assert "%load_ext dpnb" in "".join(first["source"]), p.name
