"""User-facing errors: each names the problem and the fix; the CLI prints them without a traceback."""


class MoetierError(Exception):
    """An error caused by input (a config, a checkpoint, a flag), not by a bug in moetier."""


class ConfigError(MoetierError):
    pass


class CheckpointError(MoetierError):
    pass


def problem_list(title: str, problems: list[str], fix: str) -> str:
    """One message listing every problem, so a user fixes them all in one pass."""
    lines = [f"{title} ({len(problems)} problem{'s' if len(problems) != 1 else ''}):"]
    lines += [f"  - {p}" for p in problems]
    lines.append(fix)
    return "\n".join(lines)
