"""An RL verifier of your own (rl.reward.verifier: custom; docs/own-data.md): a template to copy.

chatpipe calls ``score(reply, problem)`` for every sampled reply: ``reply`` is the model's text,
``problem`` the row of your problems file as written (here ``{"prompt": ..., "answer": ...}``).
Return a number in [0, 1]; a pass in pass@k is 1. Anything else (an exception, a non-number, NaN,
a value outside [0, 1], a call slower than rl.reward.verifier_timeout_s) is reported with the problem's
index and never counted as a score. With rl.reward.verifier_sandbox the file runs under bubblewrap with the
standard library only, so import nothing else here.

This one gives 1 when the reply's answer after ``####`` is the problem's answer, else 0.
"""

import re


def score(reply, problem):
    found = re.findall(r"####\s*(\S+)", reply)
    return float(bool(found) and found[-1].strip().rstrip(".") == str(problem["answer"]).strip())
