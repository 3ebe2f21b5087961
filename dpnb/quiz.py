"""Check questions for the course notebooks.

A question is a multiple choice with one right answer and an explanation for
*every* option, so a wrong pick teaches why it is wrong.

The course's questions live in package data, one file per chapter
(``dpnb/questions/04.json``), and a notebook cell holds only
``ask("04.2")``: the answer and the explanations are not in the notebook, so
a learner cannot read them off the cell above the question.  The options are
shown in an order shuffled per question -- the same order on every run and
for every learner, so a teacher can say "option c" -- and the explanation
appears only after Check.  In a terminal (or a notebook run headless) the
question and its options print; ``explain("04.2", "c")`` then says whether
c is right, and why.
"""

from __future__ import annotations

import hashlib
import html
import json
import random
from dataclasses import dataclass
from importlib import resources

from .display import show_widget
from .env import in_kernel

#: where the course's questions are: ``dpnb/questions/NN.json``
PACKAGE = "dpnb"
FOLDER = "questions"


@dataclass(frozen=True)
class Question:
    prompt: str
    options: tuple[str, ...]
    answer: int  # index into options
    explanations: tuple[str, ...]  # one per option: why it is right or wrong
    qid: str = ""

    def __post_init__(self) -> None:
        if not self.options:
            raise ValueError("a question needs options")
        if len(self.explanations) != len(self.options):
            raise ValueError(f"{len(self.options)} options but {len(self.explanations)} "
                             "explanations: give one explanation per option")
        if not 0 <= self.answer < len(self.options):
            raise ValueError(f"answer {self.answer} is not an option index "
                             f"(0-{len(self.options) - 1})")

    def feedback(self, choice: int) -> tuple[bool, str]:
        """(correct?, text) for picking option ``choice``."""
        ok = choice == self.answer
        head = "Correct." if ok else f"Not quite: the answer is \"{self.options[self.answer]}\"."
        return ok, f"{head} {self.explanations[choice]}"

    def shuffled(self) -> Question:
        """The same question with its options in this question's fixed order."""
        order = option_order(self.qid or self.prompt, len(self.options))
        return Question(self.prompt, tuple(self.options[i] for i in order), order.index(self.answer),
                        tuple(self.explanations[i] for i in order), self.qid)

    def text(self) -> str:
        """The question and its options (no answer: see :func:`explain`)."""
        head = f"[{self.qid}] {self.prompt}" if self.qid else self.prompt
        lines = [head] + [f"  {chr(97 + i)}) {o}" for i, o in enumerate(self.options)]
        if self.qid:
            lines.append(f"(check your pick: dpnb.quiz.explain({self.qid!r}, 'a'))")
        return "\n".join(lines)

    def widget(self):
        # lazy: `import dpnb` stays free of torch, IPython, ipyparallel and widgets
        import ipywidgets as w

        radio = w.RadioButtons(options=list(self.options), value=None,
                               layout=w.Layout(width="auto"))
        button = w.Button(description="Check", button_style="primary")
        out = w.HTML()

        def on_click(_):
            if radio.index is None:
                out.value = "<i>Pick an option first.</i>"
                return
            ok, text = self.feedback(radio.index)
            color = "#2e7d32" if ok else "#c62828"
            out.value = f"<span style='color:{color}'>{html.escape(text)}</span>"

        button.on_click(on_click)
        box = w.VBox([w.HTML(f"<b>{html.escape(self.prompt)}</b>"), radio, button, out])
        box.add_class("dpnb-quiz")
        return box


def option_order(key: str, n: int) -> list[int]:
    """A permutation of ``range(n)`` fixed by ``key`` (a question id)."""
    seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")
    order = list(range(n))
    random.Random(seed).shuffle(order)
    return order


def chapters() -> list[str]:
    """The chapters with questions, e.g. ``["00", "01", ...]``."""
    folder = resources.files(PACKAGE) / FOLDER
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".json"))


def load(chapter: str) -> list[Question]:
    """Every question of one chapter, in its authored order (not shuffled).

    Authored form: ``{"id", "prompt", "options": [{"text", "why", "correct"?}]}``
    with exactly one option marked ``"correct": true``."""
    path = resources.files(PACKAGE) / FOLDER / f"{chapter}.json"
    if not path.is_file():
        raise KeyError(f"no questions for chapter {chapter!r} (chapters: {', '.join(chapters())})")
    out = []
    for q in json.loads(path.read_text(encoding="utf-8"))["questions"]:
        right = [i for i, o in enumerate(q["options"]) if o.get("correct")]
        if len(right) != 1:
            raise ValueError(f"question {q['id']}: {len(right)} options marked correct; mark one")
        out.append(Question(q["prompt"], tuple(o["text"] for o in q["options"]), right[0],
                            tuple(o["why"] for o in q["options"]), q["id"]))
    return out


def get(qid: str) -> Question:
    """Question ``qid`` (``"04.2"``: chapter 04, second question), options shuffled."""
    chapter = qid.split(".", 1)[0]
    for q in load(chapter):
        if q.qid == qid:
            return q.shuffled()
    raise KeyError(f"no question {qid!r} in chapter {chapter} "
                   f"({', '.join(q.qid for q in load(chapter))})")


def explain(qid: str, pick: str) -> str:
    """Whether option ``pick`` (a letter as printed) of question ``qid`` is
    right, and why: the text-mode Check."""
    q = get(qid)
    i = ord(pick.strip().lower()[:1] or "?") - 97
    if not 0 <= i < len(q.options):
        raise ValueError(f"pick one of {', '.join(chr(97 + k) for k in range(len(q.options)))}")
    return q.feedback(i)[1]


def ask(qid_or_prompt: str, options: list[str] | None = None, answer: int | None = None,
        explanations: list[str] | None = None) -> None:
    """Show a check question: a widget in Jupyter, text elsewhere.

    ``ask("04.2")`` shows a course question from package data.  A question of
    your own: ``ask(prompt, options, answer, explanations)`` (shown as
    written).  Returns nothing so that a notebook cell ending in ``ask(...)``
    shows only the question, not a repr.
    """
    if options is None:
        q = get(qid_or_prompt)
    else:
        if answer is None or explanations is None:
            raise TypeError("a question of your own needs options, answer and explanations")
        q = Question(qid_or_prompt, tuple(options), answer, tuple(explanations))
    if in_kernel():
        show_widget(q.widget(), q.text())
    else:
        print(q.text())
