"""Memory planning: the plan (memory.py, residents.py), automatic sizing (sizing.py), the machine's
budgets (machine.py), preflight (preflight.py), the audit (audit.py), the table and JSON (render.py),
`moetier plan` (cli.py), sizes with units (units.py). See docs/plan.md."""
