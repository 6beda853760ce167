"""``moetrain verify``: proof, on the user's own job shrunk to CPU size, that each parallel layout
trains the same model as one process (docs/verify.md).

    layouts.py   parse --layouts, choose them (auto), each layout's micro-batch
    shrink.py    the job made CPU-sized, the math kept; per-rank random settings named and zeroed
    runs.py      the real training runs (moetrain train in its own processes) and reading them back
    checks.py    the tolerances per quantity and dtype, and the accumulated results
    driver.py    the order of the runs and of the comparisons
    report.py    the table, the JSON and the last line
"""
