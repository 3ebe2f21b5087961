"""Check questions for the course notebooks.

A question is a multiple choice with one right answer and an explanation for
*every* option, so a wrong pick teaches why it is wrong.  In Jupyter it is a
small ipywidgets form; in a terminal (or a notebook run headless) it prints
the question, the options and the answer with its explanation.
"""

from __future__ import annotations

import html
from dataclasses import dataclass

from .env import in_kernel


@dataclass(frozen=True)
class Question:
    prompt: str
    options: tuple[str, ...]
    answer: int  # index into options
    explanations: tuple[str, ...]  # one per option: why it is right or wrong

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

    def text(self) -> str:
        lines = [self.prompt]
        lines += [f"  {chr(97 + i)}) {o}" for i, o in enumerate(self.options)]
        lines.append(f"Answer: {chr(97 + self.answer)}) {self.explanations[self.answer]}")
        return "\n".join(lines)

    def widget(self):
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


def ask(prompt: str, options: list[str], answer: int, explanations: list[str]) -> None:
    """Show a check question (a widget in Jupyter, text elsewhere).

    Returns nothing so that a notebook cell ending in ``ask(...)`` shows only
    the question, not a repr.
    """
    q = Question(prompt, tuple(options), answer, tuple(explanations))
    if in_kernel():
        from IPython.display import display

        display(q.widget())
    else:
        print(q.text())
