#!/usr/bin/env python3
"""Doxygen input filter: the public headers' ordinary comments read as documentation.

torpor's headers document their API in plain comments (`// ...`, and `/* ... */` in the C
headers), as the project's style asks; Doxygen reads only `///`, `//!`, `/** */` and `/*! */`.
Doxygen runs this filter on each header (docs/api/Doxyfile, FILTER_PATTERNS) and reads its
output instead of the file, in which:

  - the comment block that opens the file (its note: what the header is for) documents the file;
  - a comment block on lines of its own, at namespace, class or enum level, documents the
    declaration that follows it;
  - a comment after a declaration on the same line documents that declaration (`///<`, `/**<`);
  - comments inside function bodies, after preprocessor lines other than #define, after a
    closing brace, and lint or format directives (NOLINT, clang-format) stay plain.

The headers themselves are never changed, and the filtered text has the same lines, so Doxygen's
warnings name the header's own lines. Usage: doc_comments.py FILE (the filtered text on stdout).
"""

from __future__ import annotations

import re
import sys

_TRAILING = re.compile(r"^(?P<code>.*?\S)(?P<space>\s+)//(?P<text>.*)$")
_C_TRAILING = re.compile(r"^(?P<code>.*?\S)(?P<space>\s+)/\*(?P<text>.*)\*/\s*$")
_DECLARING = re.compile(r"\b(namespace|class|struct|union|enum|extern)\b")


def _escaped(text: str) -> str:
    """Comment text as plain text: outside `code spans`, characters that Doxygen would read as
    markup of its own (an HTML tag such as <span>, a command such as \\file or @param) are
    escaped. Markdown (code spans, lists, emphasis) still applies."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):  # the even parts are outside code spans
        parts[i] = re.sub(r"([\\@<>])", r"\\\1", parts[i])
    return "`".join(parts)


def _without_literals(code: str) -> str:
    code = re.sub(r'"(\\.|[^"\\])*"', '""', code)
    return re.sub(r"'(\\.|[^'\\])*'", "''", code)


def _plain(text: str) -> bool:
    """A comment that stays plain: a directive, or one already in Doxygen's syntax."""
    s = text.strip()
    return s.startswith(("/", "!", "*", "<", "clang-format")) or "NOLINT" in s


def _trailing_documents(code: str) -> bool:
    """Whether a comment after `code` on the same line documents it."""
    c = code.strip()
    if c.startswith("#"):
        return c.startswith("#define")
    return not re.fullmatch(r"[{}]+;?", c)


def _converted(line: str, marker: str, doc_marker: str) -> str:
    """The comment on `line` (starting at `marker`) as documentation, its text escaped."""
    before, text = line.split(marker, 1)
    return before + doc_marker + _escaped(text)


class _Filter:
    def __init__(self) -> None:
        self.out: list[str] = []
        self.scopes: list[bool] = []  # per open brace: True where comments document declarations
        self.in_block = False  # inside a /* ... */ that started on a line of its own
        self.block_documents = False  # that block was turned into documentation
        self.note_last = None  # the file note's last line, once it has ended
        self.note_open = True  # no code seen yet: a comment here belongs to the file note
        self.pending = False  # a class, struct, enum or namespace head whose brace is still to come

    def documenting(self) -> bool:
        return all(self.scopes)

    def line(self, line: str) -> None:
        stripped = line.strip()
        if self.in_block:
            self.out.append(_escaped(line) if self.block_documents else line)
            if "*/" in line:
                self.in_block = False
                if self.note_open:
                    self.note_last = len(self.out) - 1
                    self.note_open = False
            return
        if stripped.startswith("//"):
            if self.note_open and not _plain(stripped[2:]):
                self.out.append(_converted(line, "//", "///"))
                self.note_last = len(self.out) - 1
                return
            self.note_open = False
            document = self.documenting() and not _plain(stripped[2:])
            self.out.append(_converted(line, "//", "///") if document else line)
            return
        if stripped.startswith("/*"):
            document = (self.note_open or self.documenting()) and not _plain(stripped[2:])
            self.out.append(_converted(line, "/*", "/**") if document else line)
            self.in_block = "*/" not in stripped[2:]
            self.block_documents = document
            if self.note_open and document and not self.in_block:
                self.note_last = len(self.out) - 1
            if not self.in_block:
                self.note_open = False
            return
        if stripped:
            self.note_open = False
        self.out.append(self._trailing(line))

    def _trailing(self, line: str) -> str:
        code = line
        for pattern, doc in ((_TRAILING, "///<{text}"), (_C_TRAILING, "/**<{text}*/")):
            m = pattern.match(line)
            if not m or '"' in _without_literals(m["code"]).replace('""', "") or "/*" in m["code"]:
                continue
            code = m["code"]
            if self.documenting() and _trailing_documents(code) and not _plain(m["text"]):
                line = m["code"] + m["space"] + doc.format(text=_escaped(m["text"]))
            break
        self._track_scopes(code)
        return line

    def _track_scopes(self, code: str) -> None:
        """A brace opened on a line that names a namespace, class, struct, union, enum or
        extern "C" block documents its members; any other (a function body, an initializer
        list spanning lines) does not."""
        if code.lstrip().startswith("#"):
            return
        text = _without_literals(code)
        head = text.split("{", 1)[0]
        declaring = self.pending or (bool(_DECLARING.search(head)) and "(" not in head)
        if "{" not in text:
            self.pending = declaring and ";" not in text
            return
        self.pending = False
        for ch in text:
            if ch == "{":
                self.scopes.append(declaring)
            elif ch == "}" and self.scopes:
                self.scopes.pop()

    def result(self) -> list[str]:
        """The text, the file note ending with \\file so that it documents the file."""
        out = list(self.out)
        if self.note_last is not None:
            last = out[self.note_last].rstrip()
            if last.endswith("*/"):
                out[self.note_last] = last[:-2].rstrip() + " \\file */"
            else:
                out[self.note_last] = last + " \\file"
        return out


def filter_text(text: str) -> str:
    f = _Filter()
    for line in text.split("\n"):
        f.line(line)
    return "\n".join(f.result())


def main() -> int:
    with open(sys.argv[1], encoding="utf-8") as f:
        sys.stdout.write(filter_text(f.read()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
