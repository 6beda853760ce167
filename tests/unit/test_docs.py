"""Docs that stay true: every message ``docs/troubleshooting.md`` quotes still exists in the code.

The page puts what moetrain prints in fenced blocks tagged ``message``, one message per line,
verbatim from a run (with the prefix it was printed with: ``moetrain: error: ``, a log line's
``HH:MM:SS WARNING ``, an exception's or warning's class, ``[rank0]: `` before a rank's traceback),
``…`` where the page leaves text out. The check reads every module
under ``moetrain/`` with ``ast`` (nothing is imported) and turns each string literal into a
template: f-string placeholders, ``%s``-style and ``{name}``-style fields match any text, and
``"a" + f"b{x}" + "c"`` is one template. A quoted line passes when, after its prefix, it is

* one template, with at least MIN_LITERAL characters of fixed text (so that a placeholder-only
  template like ``f"{field} ({value!r}) {rule}"`` proves nothing on its own), or
* a short template whose placeholder holds such a template (``require``'s
  ``"<field> (<value>) <rule>"`` around the rule ``f"must divide moe.num_experts ({n})"``), or
* such pieces joined by ``"; "`` (``ParallelDims`` reports every broken rule at once).

Messages that are not moetrain's (torch's, the OS's) sit in ``text`` blocks and are not checked.
"""

from __future__ import annotations

import ast
import dataclasses
import itertools
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

from moetrain.config import JobConfig

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "troubleshooting.md"
PACKAGE = ROOT / "moetrain"

MIN_LITERAL = 12
"""Fixed characters a template needs to verify a quote by itself."""

PREFIX_RE = re.compile(r"(?:\[rank\d+\]: )?"  # torchrun's prefix of a rank's traceback
                       r"(?:moetrain: error: |\d\d:\d\d:\d\d [A-Z]+ |(?:[A-Za-z_][\w.]*)?(?:Error|Warning): )")
SEPARATOR = "; "
_PERCENT_FIELD = re.compile(r"%(?:\([^)]*\))?[-#0 +]*\d*(?:\.\d+)?[diouxXeEfFgGcrsa]")
_BRACE_FIELD = re.compile(r"\{[^{}]*\}")
_WILDCARD = object()


@dataclass(frozen=True)
class Template:
    pattern: re.Pattern
    literal_chars: int
    where: str
    segments: tuple[str, ...] = ()
    """The fixed text between placeholders, in order."""
    starts_fixed: bool = True
    ends_fixed: bool = True

    def could_match(self, text: str) -> bool:
        """A cheap necessary condition for ``pattern.fullmatch(text)``: the fixed pieces occur in
        order (and at the ends when the template starts or ends with fixed text)."""
        if not self.segments:
            return True
        if self.starts_fixed and not text.startswith(self.segments[0]):
            return False
        if self.ends_fixed and not text.endswith(self.segments[-1]):
            return False
        pos = 0
        for seg in self.segments:
            pos = text.find(seg, pos)
            if pos < 0:
                return False
            pos += len(seg)
        return True


def _parts(node: ast.AST) -> list | None:
    """The pieces of a string expression: str for fixed text, _WILDCARD for a runtime value.
    None when ``node`` is not a string expression."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        # A plain string may be a %- or .format() template: its fields are runtime values.
        pieces: list = []
        pos = 0
        text = node.value
        for m in sorted([*_PERCENT_FIELD.finditer(text), *_BRACE_FIELD.finditer(text)], key=lambda m: m.start()):
            if m.start() < pos:
                continue
            pieces += [text[pos:m.start()].replace("%%", "%"), _WILDCARD]
            pos = m.end()
        return [*pieces, text[pos:].replace("%%", "%")]
    if isinstance(node, ast.JoinedStr):
        return [v.value if isinstance(v, ast.Constant) else _WILDCARD for v in node.values]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _parts(node.left), _parts(node.right)
        if left is None and right is None:
            return None
        return [*(left if left is not None else [_WILDCARD]), *(right if right is not None else [_WILDCARD])]
    return None


def _template(parts: list, where: str) -> Template:
    regex, literal, segments = [], 0, []
    for p in parts:
        if p is _WILDCARD:
            if not regex or regex[-1] != "(.*?)":
                regex.append("(.*?)")
        elif p:
            if regex and regex[-1] != "(.*?)":
                segments[-1] += p
            else:
                segments.append(p)
            regex.append(re.escape(p))
            literal += len(p.strip())
    return Template(re.compile("".join(regex), re.DOTALL), literal, where, tuple(segments),
                    starts_fixed=bool(regex) and regex[0] != "(.*?)", ends_fixed=bool(regex) and regex[-1] != "(.*?)")


def code_templates(sources: Iterable[tuple[str, str]]) -> list[Template]:
    """Templates of every string expression in ``sources`` ((name, Python source) pairs)."""
    out = []
    for name, source in sources:
        for node in ast.walk(ast.parse(source)):
            parts = _parts(node)
            if parts is not None and any(p is not _WILDCARD and p.strip() for p in parts):
                out.append(_template(parts, f"{name}:{node.lineno}"))
    return out


def package_templates() -> list[Template]:
    files = sorted(PACKAGE.rglob("*.py"))
    return code_templates((str(p.relative_to(ROOT)), p.read_text()) for p in files)


def quoted_messages(markdown: str) -> list[str]:
    """Lines of the page's ```message blocks."""
    out, inside = [], False
    for line in markdown.splitlines():
        fence = line.strip()
        if not inside and fence == "```message":
            inside = True
        elif inside and fence == "```":
            inside = False
        elif inside and line.strip():
            out.append(line.strip())
    assert not inside, "a ```message block is not closed"
    return out


_PROSE = re.compile(r"[A-Za-z]{2,}[,:]? [A-Za-z]{2,}[,:]? [A-Za-z]{2,}")
_ELLIPSIS = "…"
_memo: dict[tuple[str, int], int | None] = {}


def _is_value(text: str) -> bool:
    """A placeholder's text that needs no proof: a number, name, path or repr, or the page's
    elision mark. Three words of prose in a row are a message, which must be proved."""
    return _PROSE.search(text.replace(_ELLIPSIS, "")) is None


def _proved(text: str, templates: list[Template], depth: int = 0) -> int | None:
    """Fixed characters of the code that ``text`` is built from, or None when some prose in it
    comes from no template: ``text`` is one template or several joined by "; ", and every
    placeholder's text is a value or is itself proved the same way."""
    if depth > 3:
        return None
    pieces = text.split(SEPARATOR)
    best = None
    # Every way to regroup the "; "-separated pieces (a template may hold "; " itself).
    for cuts in itertools.product((False, True), repeat=len(pieces) - 1):
        groups, current = [], pieces[0]
        for cut, piece in zip(cuts, pieces[1:], strict=True):
            if cut:
                groups.append(current)
                current = piece
            else:
                current += SEPARATOR + piece
        groups.append(current)
        proofs = [_proved_one(g, templates, depth) for g in groups]
        if all(p is not None for p in proofs):
            best = max(best or 0, sum(proofs))
    return best


def _proved_one(text: str, templates: list[Template], depth: int) -> int | None:
    key = (text, depth)
    if key in _memo:
        return _memo[key]
    _memo[key] = None  # a template may hold its own text in a placeholder: no proof by itself
    best = None
    for t in templates:
        if not t.could_match(text):
            continue
        m = t.pattern.fullmatch(text)
        if m is None:
            continue
        total = t.literal_chars
        for group in m.groups():
            if _is_value(group):
                continue
            inner = _proved(group, templates, depth + 1)
            if inner is None:
                break
            total += inner
        else:
            best = max(best or 0, total)
    _memo[key] = best
    return best


def message_in_code(quote: str, templates: list[Template]) -> bool:
    """Whether ``quote`` (one printed line) is text the code can print, see the module docstring."""
    prefix = PREFIX_RE.match(quote)
    text = quote[prefix.end():] if prefix else quote
    _memo.clear()  # proofs hold for one list of templates
    proof = _proved(text, [t for t in templates if t.literal_chars > 0])
    return proof is not None and proof >= MIN_LITERAL


def _overrides(markdown: str) -> list[str]:
    """``--section.field`` names in the page's bash blocks."""
    out, inside = [], False
    for line in markdown.splitlines():
        if line.strip().startswith("```"):
            inside = line.strip() == "```bash"
            continue
        if inside:
            out += re.findall(r"--([a-z_]+\.[a-z_]+)=", line)
    return out


# ----- the page -------------------------------------------------------------------------------------


def test_every_quoted_message_exists_in_the_code():
    quotes = quoted_messages(PAGE.read_text())
    assert len(quotes) >= 10, f"expected the page's quoted messages, found {len(quotes)}"
    templates = package_templates()
    missing = [q for q in quotes if not message_in_code(q, templates)]
    assert not missing, (
        "docs/troubleshooting.md quotes messages that no string in moetrain/ can produce any more; update "
        "the page (re-run the command next to each to get the text):\n  " + "\n  ".join(missing))


def test_every_override_on_the_page_is_a_config_field():
    cfg = JobConfig()
    fields = {f"{section.name}.{f.name}" for section in dataclasses.fields(cfg)
              for f in dataclasses.fields(getattr(cfg, section.name))}
    names = _overrides(PAGE.read_text())
    assert names, "expected --section.field=value overrides in the page's commands"
    assert sorted(set(names) - fields) == []


# ----- the checker can fail -------------------------------------------------------------------------

SOURCE = '''
def check(ep, world, n):
    errors = []
    if world % ep:
        errors.append(f"parallel.ep ({ep}) must divide the world size ({world})")
    if n % ep:
        errors.append(f"parallel.ep ({ep}) must divide moe.num_experts ({n})")
    raise ValueError("; ".join(errors))

def require(ok, field, value, rule):
    raise ValueError(f"{field} ({value!r}) {rule}")

require(False, "train.steps", 0, f"must be an int >= {1}")
log.warning("step %d skipped: non-finite loss or gradient (%d in a row, %d in all)", 3, 1, 1)
log.warning("expert %d was chosen by %.1f%% of the tokens (alarm above %.0f%%; balanced would be %.1f%%)%s", 1, 2)
problems.append(f"{what}: {shown}")
listed(missing, "missing entries")
listed(mismatched, "entries of another shape")
mismatched.append(f"{k} (saved {saved}, this model {shape})")
raise CheckpointError(f"checkpoint {path!r} does not match this model and optimizer: "
                      + "; ".join(problems) + ". Was it saved with another model config?")
'''


def _fake(source: str = SOURCE) -> list[Template]:
    return code_templates([("fake.py", source)])


@pytest.mark.parametrize("quote", [
    "moetrain: error: parallel.ep (3) must divide the world size (2)",
    "moetrain: error: parallel.ep (3) must divide the world size (2); parallel.ep (3) must divide moe.num_experts (8)",
    "moetrain: error: train.steps (0) must be an int >= 1",
    "13:47:27 WARNING step 3 skipped: non-finite loss or gradient (1 in a row, 1 in all)",
    "13:54:00 WARNING expert 1 was chosen by 71.6% of the tokens (alarm above 50%; balanced would be 25.0%)",
    "[rank0]: moetrain.train.faults.CollectiveError: parallel.ep (3) must divide the world size (2)",
    "moetrain: error: parallel.ep (…) must divide the world size (…)",
    ("CheckpointError: checkpoint '/r/step_2' does not match this model and optimizer: missing entries: a; "
    "entries of another shape: b (saved (8,), this model (6,)). Was it saved with another model config?"),
])
def test_checker_finds_messages_the_code_prints(quote):
    assert message_in_code(quote, _fake())


@pytest.mark.parametrize("quote", [
    "moetrain: error: parallel.ep (3) must evenly divide the world size (2)",  # reworded
    "moetrain: error: parallel.ep (3) must divide the world size (2); expert count is wrong",  # half invented
    "moetrain: error: train.steps (0) is too small",  # only require()'s placeholder frame matches
    "step 3 was skipped",
    "moetrain: error: parallel.ep (3) must … the world size (2)",  # an elision stands for values only
    ("CheckpointError: checkpoint '/r/step_2' does not match this model and optimizer: the experts moved. "
    "Was it saved with another model config?"),  # the joined problems are prose the code cannot print
])
def test_checker_rejects_messages_the_code_does_not_print(quote):
    assert not message_in_code(quote, _fake())


def test_checker_fails_once_the_code_edits_the_message_away():
    quote = "moetrain: error: parallel.ep (3) must divide moe.num_experts (8)"
    assert message_in_code(quote, _fake())
    edited = SOURCE.replace("must divide moe.num_experts", "has to divide moe.num_experts")
    assert not message_in_code(quote, _fake(edited))


def test_quoted_messages_reads_only_message_blocks():
    page = ("```bash\nmoetrain train --config tiny\n```\n```text\nCUDA out of memory.\n```\n"
            "```message\nmoetrain: error: x\n\nmoetrain: error: y\n```\n")
    assert quoted_messages(page) == ["moetrain: error: x", "moetrain: error: y"]
