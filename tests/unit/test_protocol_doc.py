"""docs/architecture.md's message tables ("## Messages") list every message and record
of protocol/, each with its kind and exactly its fields: a table that misses a new
field, or still names a removed one, misleads whoever writes the other end.

A row is `| \`Name\` (\`kind\`) | sender -> receiver | fields |` (a record's first cell
has no kind). In the fields cell, the field names are the backticked words outside
parentheses; what is inside parentheses explains them.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import msgspec

import protocol
from protocol import Message
from protocol.stats import Record

DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"
ROW = re.compile(r"^\| `(\w+)`(?: \(`(\w+)`\))? \|")


def _subclasses(base: type) -> set[type]:
    found = set()
    for cls in base.__subclasses__():
        found |= {cls} | _subclasses(cls)
    return found


def protocol_types() -> dict[str, type[msgspec.Struct]]:
    """Every message and record class defined in protocol/, by name."""
    for module in pkgutil.iter_modules(protocol.__path__):
        importlib.import_module(f"protocol.{module.name}")
    return {cls.__name__: cls for cls in _subclasses(Message) | _subclasses(Record)
            if cls.__module__.startswith("protocol.")}


def top_level_names(cell: str) -> set[str]:
    """The backticked names of a fields cell outside parentheses."""
    names, depth, i = set(), 0, 0
    while i < len(cell):
        if cell[i] == "`":
            end = cell.index("`", i + 1)
            if depth == 0:
                names.add(cell[i + 1:end])
            i = end + 1
            continue
        depth += {"(": 1, ")": -1}.get(cell[i], 0)
        i += 1
    return names


def doc_rows() -> dict[str, tuple[str | None, str]]:
    """Name -> (kind or None, fields cell) of every row of the Messages section's tables."""
    text = DOC.read_text()
    section = text[text.index("## Messages (`protocol/`)"):]
    section = section[:section.index("\n## ", 1)]
    rows = {}
    for line in section.splitlines():
        match = ROW.match(line)
        if match:
            assert match.group(1) not in rows, f"{match.group(1)} is listed twice"
            rows[match.group(1)] = (match.group(2), line.rstrip().rstrip("|").split("|")[-1])
    return rows


def test_every_message_and_record_is_listed_and_nothing_else() -> None:
    types, rows = protocol_types(), doc_rows()
    assert types, "found no message classes"
    assert sorted(set(types) - set(rows)) == [], "add a row for each"
    assert sorted(set(rows) - set(types)) == [], "no such message or record any more: remove the row"


def test_each_row_gives_the_kind_and_exactly_the_fields() -> None:
    types, rows = protocol_types(), doc_rows()
    wrong = []
    for name, (kind, cell) in sorted(rows.items()):
        cls = types.get(name)
        if cls is None:
            continue  # the test above names it
        if issubclass(cls, Message) and kind != cls.__struct_config__.tag:
            wrong.append(f"{name}: kind `{kind}` listed, `{cls.__struct_config__.tag}` in protocol/")
        fields = {f.name for f in msgspec.structs.fields(cls)} - {"v"}  # every message has v
        listed = top_level_names(cell)
        if fields - listed:
            wrong.append(f"{name}: fields not listed: {sorted(fields - listed)}")
        if listed - fields:
            wrong.append(f"{name}: listed but not fields: {sorted(listed - fields)}")
    assert wrong == []


def test_fields_inside_parentheses_are_explanations_not_fields() -> None:
    assert top_level_names("`a` (with `b.c` > 1: `f(x, y)`), `d` (`e`; (`g`)), `h`") == {"a", "d", "h"}
