"""A stand-in for the transport a cell's wait (:mod:`dpnb.cluster.waiting`) talks to."""


class FakeTransport:
    """Just what ``Waiting`` uses: answers to ``where``, and a record of
    interrupts and releases."""

    def __init__(self, answers: dict, timeout_s: float = 6.0, frozen: dict | None = None):
        self.ranks = list(answers)
        self.answers = answers
        self.stopped = dict(frozen or {})  # rank -> how its process is frozen
        self.asked_where: list[list] = []
        self.timeout_s = timeout_s
        self.interrupted: list[set] = []
        self.released: list[list] = []

    def where(self, ranks):
        self.asked_where.append(list(ranks))
        return {r: self.answers[r] for r in ranks}

    def frozen(self, ranks):
        return {r: self.stopped[r] for r in ranks if r in self.stopped}

    def interrupt(self, ranks):
        self.interrupted.append(set(ranks))

    def release(self, ranks):
        self.released.append(list(ranks))
        return True
