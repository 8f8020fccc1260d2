"""YAML for files a user (or an attacker) hands us: bounded before and while parsing.

PyYAML's safe loader is safe from code execution but not from cost or carelessness: a few
hundred bytes of nested aliases expand to billions of nodes once anything walks the result,
deep nesting exhausts Python's recursion, bytes that are not UTF-8 escape as a
UnicodeDecodeError, and a repeated mapping key silently replaces the first. This loader bounds
the input size, the nesting depth and the *expanded* node count (an alias counts as the whole
node it names), refuses alias cycles, and reports duplicate keys with both lines.
"""

from __future__ import annotations

import re
from typing import Any

import yaml
from yaml.constructor import ConstructorError, SafeConstructor
from yaml.nodes import MappingNode, ScalarNode, SequenceNode
from yaml.resolver import Resolver

# A 50-host inventory is ~4 KiB and ~400 nodes, a 1,000-host one ~55 KiB and ~7,000. The node
# bound (~2,800 hosts) is what keeps the worst accepted document near a second to validate:
# validation costs about 40 us per node, most of it in ipaddress.
MAX_BYTES = 1024 * 1024
MAX_NODES = 20_000           # expanded: every alias counts as a full copy of what it names
MAX_DEPTH = 32               # the inventory itself nests 6 deep
QUOTE_CHARS = 60

# YAML 1.1 forbids C0 controls other than tab/LF/CR, DEL, C1 controls and U+FFFE/FFFF;
# refusing them up front gives one clear line instead of a parser message per backend.
_NOT_PRINTABLE = re.compile("[^\x09\x0a\x0d\x20-\x7e\x85\xa0-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")

try:
    # libyaml scans, parses and composes in C (aliases stay shared nodes, so composing is
    # linear in the file); it also stops nesting at 1000 levels, below Python's recursion limit
    from yaml.cyaml import CParser as _Parser
except ImportError:     # PyYAML built without libyaml
    from yaml.composer import Composer
    from yaml.parser import Parser
    from yaml.reader import Reader
    from yaml.scanner import Scanner

    class _Parser(Reader, Scanner, Parser, Composer):   # type: ignore[no-redef]
        """Pure Python: the same, with the depth bound applied while composing (its composer
        recurses once per level and would exhaust the stack first)."""

        def __init__(self, stream):
            Reader.__init__(self, stream)
            Scanner.__init__(self)
            Parser.__init__(self)
            Composer.__init__(self)
            self._depth = 0

        def compose_node(self, parent, index):
            self._depth += 1
            try:
                if self._depth > MAX_DEPTH + 1:
                    mark = self.peek_event().start_mark
                    raise InputError([f"line {mark.line + 1}: nested deeper than {MAX_DEPTH} levels; refusing it"])
                return Composer.compose_node(self, parent, index)
            finally:
                self._depth -= 1


class InputError(Exception):
    """The file cannot be read as a document at all; ``problems`` holds one line each."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("; ".join(problems))


def short(value: Any, limit: int = QUOTE_CHARS) -> str:
    """``value`` as text, cut to ``limit`` characters: a message quotes a prefix, never a 5 MB line."""
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


def path_text(parts: list | tuple) -> str:
    """spec.hosts[2].name; a key that is not a plain word is quoted (so a newline in it, or
    5 MB of it, cannot break the line)."""
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
            continue
        p = str(p)
        if not (p == "(key)" or re.fullmatch(r"[A-Za-z0-9_-]{1,60}", p)):
            p = repr(p[:QUOTE_CHARS]) + ("…" if len(p) > QUOTE_CHARS else "")
        out += ("." if out else "") + p
    return out or "(document)"


def _line_col(data: bytes | str, offset: int) -> str:
    nl = b"\n" if isinstance(data, bytes) else "\n"
    line = data.count(nl, 0, offset) + 1
    return f"line {line}, column {offset - (data.rfind(nl, 0, offset) + 1) + 1}"


class _Walk:
    """One pass over the composed node graph (an alias is the same node object as its anchor):
    expanded size with every alias counted as a copy, depth, cycles and duplicate keys. Each
    distinct node is visited once, so the pass is linear in the file, not in the expansion."""

    def __init__(self):
        self.weight: dict[int, int] = {}      # id(node) -> expanded size, once known
        self.open: set[int] = set()           # nodes on the current path: seeing one again is a cycle
        self.duplicates: list[str] = []

    def node(self, node, path: list) -> int:
        key = id(node)
        if key in self.weight:
            return self.weight[key]
        line = node.start_mark.line + 1
        if key in self.open:
            raise InputError([f"{path_text(path)} (line {line}): an alias is used inside the node it names "
                              "(a cycle)"])
        if len(path) > MAX_DEPTH:
            raise InputError([f"{path_text(path)} (line {line}): nested deeper than {MAX_DEPTH} levels; "
                              "refusing it"])
        self.open.add(key)
        total = 1
        if isinstance(node, SequenceNode):
            for i, child in enumerate(node.value):
                total += self.node(child, path + [i])
        elif isinstance(node, MappingNode):
            first: dict[tuple[str, str], int] = {}
            for k, v in node.value:
                total += self.node(k, path + ["(key)"])
                name = k.value if isinstance(k, ScalarNode) else "(key)"
                if isinstance(k, ScalarNode):
                    self._duplicate(first, k, path)
                total += self.node(v, path + [name])
        if total > MAX_NODES:
            raise InputError([f"{path_text(path)} (line {line}): expands to more than {MAX_NODES} nodes "
                              "(aliases count as copies of what they name); refusing the document"])
        self.open.discard(key)
        self.weight[key] = total
        return total

    def _duplicate(self, first: dict, k: ScalarNode, path: list) -> None:
        line, name = k.start_mark.line + 1, (k.tag, k.value)
        if name not in first:
            first[name] = line
            return
        lines = f"twice on line {line}" if first[name] == line else f"lines {first[name]} and {line}"
        self.duplicates.append(f"{path_text(path + [k.value])}: duplicate key ({lines}); "
                               "YAML would silently keep only the last one")


class _Loader(_Parser, SafeConstructor, Resolver):
    def __init__(self, text: str):
        _Parser.__init__(self, text)
        SafeConstructor.__init__(self)
        Resolver.__init__(self)

    def construct_object(self, node, deep=False):
        # a scalar that matches a YAML type but not its range (2001-02-30, a 5000-digit int)
        # raises ValueError from deep inside the constructor, and an explicitly tagged one that
        # does not match its tag at all (!!bool x, !!int '', !!timestamp x) KeyError, IndexError
        # or AttributeError: make each a marked YAML error
        try:
            return super().construct_object(node, deep)
        except (ValueError, OverflowError) as e:
            raise ConstructorError(None, None, f"cannot read this value: {short(str(e))}",
                                   node.start_mark) from None
        except (KeyError, IndexError, AttributeError, TypeError):
            raise ConstructorError(None, None, f"cannot read this value as its tag says: {short(node.tag)}",
                                   node.start_mark) from None


def load(data: bytes) -> tuple[Any, list[str]]:
    """Parse one YAML document from ``data``: (the document, duplicate-key problems).

    Raise InputError when the bytes cannot be a document (too large, not UTF-8, not YAML,
    too deep, too many nodes)."""
    if len(data) > MAX_BYTES:
        raise InputError([f"(file): larger than {MAX_BYTES // 1024} KiB; an inventory is a few KiB, refusing it"])
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError([f"{_line_col(data, e.start)}: not UTF-8 text (byte 0x{data[e.start]:02x}); "
                          "save the inventory as UTF-8"]) from None
    text = text.removeprefix("\ufeff")
    bad = _NOT_PRINTABLE.search(text)
    if bad:
        raise InputError([f"{_line_col(text, bad.start())}: control character "
                          f"U+{ord(bad.group()):04X} is not allowed in YAML"])
    loader = _Loader(text)
    try:
        root = loader.get_single_node()
        if root is None:
            return None, []
        walk = _Walk()
        walk.node(root, [])
        return loader.construct_document(root), walk.duplicates
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "(file)"
        # the context says what the parser was doing ("expected a single document"), the
        # problem what it met ("but found another document"): either alone can mislead
        why = ", ".join(x for x in (e.context, e.problem) if x) or str(e)
        raise InputError([f"{where}: not valid YAML: {short(why, 200)}"]) from None
    except yaml.YAMLError as e:
        raise InputError([f"(file): not valid YAML: {short(str(e), 200)}"]) from None
    finally:
        loader.dispose()


def read(path, limit: int = MAX_BYTES) -> bytes:
    """At most ``limit`` + 1 bytes of ``path``: enough to tell a too-large file without
    reading it all (a FIFO or /dev/zero included)."""
    with open(path, "rb") as f:
        return f.read(limit + 1)


__all__ = ["InputError", "MAX_BYTES", "MAX_DEPTH", "MAX_NODES", "QUOTE_CHARS", "load", "path_text", "read",
           "short"]
