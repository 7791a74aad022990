"""A clock the test moves by hand, for the policies that take one."""


class FakeClock:
    """Returns `now` when called; `advance(seconds)` moves it."""

    def __init__(self, now=1000.0):
        self.now = now

    def __call__(self):
        return self.now

    def advance(self, seconds):
        self.now += seconds
