"""ctest ctest.regexes: no test's PASS_REGULAR_EXPRESSION or FAIL_REGULAR_EXPRESSION nests an
unbounded repetition inside another one.

CTest matches those expressions with a backtracking matcher in its own event loop. A pattern such
as `a\\n(.*\\n)*b` (a repeated group whose body itself repeats without bound) can take exponential
time on a few dozen lines of output that do not match at the first try: one such pattern on the 34
lines of `torpor probe --config` stalled ctest for about ten minutes in CI, and the test running
beside it was judged a timeout. `(.*\\n)?` says the same there (CTest's `.` matches a newline) and
backtracks a bounded amount. This reads ctest's own list (ctest --show-only=json-v1) and fails
naming each test and pattern with such a nesting.

usage: check_test_regexes.py CTEST BUILD_DIR
"""

import json
import subprocess
import sys

PROPERTIES = ("PASS_REGULAR_EXPRESSION", "FAIL_REGULAR_EXPRESSION")
UNBOUNDED = "*+"


def nested_repetition(pattern):
    """The offset of the first group that repeats without bound while its body does too, or None.
    Escapes and bracket expressions are skipped; `{m,n}` is not CTest syntax."""
    stack = []  # per open group: whether its body holds an unbounded repetition
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if c == "[":
            j = i + 1
            if j < n and pattern[j] == "^":
                j += 1
            if j < n and pattern[j] == "]":
                j += 1
            while j < n and pattern[j] != "]":
                j += 1
            i = j + 1
            continue
        if c == "(":
            stack.append(False)
        elif c == ")" and stack:
            inner = stack.pop()
            repeated = i + 1 < n and pattern[i + 1] in UNBOUNDED
            if inner and repeated:
                return i
            if stack and (inner or repeated):
                stack[-1] = True
        elif c in UNBOUNDED and stack:
            stack[-1] = True
        i += 1
    return None


def main(ctest, build):
    out = subprocess.run([ctest, "--show-only=json-v1"], cwd=build, capture_output=True, text=True, check=True)
    tests = json.loads(out.stdout)["tests"]
    found, checked = [], 0
    for t in tests:
        for p in t.get("properties", []):
            if p["name"] not in PROPERTIES:
                continue
            values = p["value"] if isinstance(p["value"], list) else [p["value"]]
            for pattern in values:
                checked += 1
                at = nested_repetition(pattern)
                if at is not None:
                    found.append((t["name"], p["name"], pattern, at))
    for name, prop, pattern, at in found:
        print(f"{name}: {prop} repeats a group that repeats inside (at offset {at}): {pattern!r}")
    if found:
        print(
            f"FAIL: {len(found)} pattern(s) with a nested unbounded repetition (of {checked}); ctest can "
            f"backtrack on them for minutes: write (.*\\n)? for (.*\\n)*, [^\\n]* for (.*)*"
        )
        return 1
    print(f"PASS: {checked} expressions of {len(tests)} tests, none with a nested unbounded repetition")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1] == "--self-test":
        bad = ["a\n(.*\n)*b", "(x+)*", "((ab)*c)+", "(a(b*))*"]
        good = ["a\n(.*\n)?b", "(x)*", "[(.*)]*", "\\(.*\\)*", "([^\n]*)", "a.*b"]
        wrong = [p for p in bad if nested_repetition(p) is None] + [p for p in good if nested_repetition(p) is not None]
        print("FAIL: misjudged " + repr(wrong) if wrong else "PASS: self-test")
        sys.exit(1 if wrong else 0)
    sys.exit(main(*sys.argv[1:]))
