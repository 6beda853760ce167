"""--layouts parsing refuses what int() or a repeated key would misread; the last line names the
first failure's step."""

from __future__ import annotations

import pytest

from moetrain.verify.checks import EXACT, Comparison
from moetrain.verify.layouts import parse_layouts
from moetrain.verify.report import last_line


@pytest.mark.parametrize("text", ["ep=\u00b2", "ep=\u0662", "dp=2,ep=\u00b9"])  # superscripts, Arabic-Indic digit
def test_a_degree_must_be_ascii_digits(text):
    with pytest.raises(ValueError, match="must be KEY=N"):
        parse_layouts(text)


def test_a_degree_named_twice_is_refused():
    with pytest.raises(ValueError, match="ep is named twice"):
        parse_layouts("ep=2,ep=4")


def test_the_last_line_names_the_failing_step():
    out = Comparison()
    out.values("counts", [3, 5], [3, 5], EXACT, step=1)
    out.values("counts", [4, 4], [3, 5], EXACT, step=2)
    assert last_line(out).startswith("verify: FAIL: counts at step 2 (")
