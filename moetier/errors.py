"""User-facing errors: each names the problem and the fix; the CLI prints them without a traceback."""


class MoetierError(Exception):
    """An error caused by input (a config, a checkpoint, a flag), not by a bug in moetier."""


class ConfigError(MoetierError):
    pass


class CheckpointError(MoetierError):
    pass


def problem_list(title: str, problems: list[str], fix: str, count: int | None = None,
                 causes: list[str] = ()) -> str:
    """One message listing every problem, so a user fixes them all in one pass. count: the problems
    in all, where the list shows only some; causes: what explains many of them, said first."""
    n = len(problems) if count is None else count
    lines = [f"{title} ({n} problem{'s' if n != 1 else ''}):"]
    lines += [f"  likely cause: {c}" for c in causes]
    lines += [f"  - {p}" for p in problems]
    lines.append(fix)
    return "\n".join(lines)
