"""Which tasks a run evaluates: the shipped offline task sets (moetier/eval/tasks/<set>/, lm-eval
YAMLs over local JSON-lines files) and the user's own (lm-eval YAMLs in --include-path folders).

A shipped YAML names its data files relative to its folder; lm-eval would read them relative to the
working directory, so the shipped configs go to lm-eval as dicts with absolute paths. A user's YAMLs
go to lm-eval's TaskManager as they are (their data_files absolute, or relative to where `moetier
eval` runs, lm-eval's own rule)."""

from __future__ import annotations

from pathlib import Path

import yaml

from moetier.errors import MoetierError

TASKS_DIR = Path(__file__).parent / "tasks"
DEFAULT_SET = "tiny_stdlib"  # the embedded model's held-out standard-library code
LM_EVAL_MAX_LENGTH = 2048  # lm-eval's default max_length, for tasks that do not name theirs


def shipped() -> dict[str, dict]:
    """Every shipped task: name -> its lm-eval config, data files made absolute; a set's name -> its
    tasks' names (a `group` lm-eval would read from a YAML, flattened here)."""
    tasks = {}
    for path in sorted(TASKS_DIR.glob("*/*.yaml")):
        cfg = yaml.safe_load(path.read_text())
        files = cfg.get("dataset_kwargs", {}).get("data_files", {})
        cfg.setdefault("dataset_kwargs", {})["data_files"] = {k: str(path.parent / v) for k, v in files.items()}
        cfg["metadata"] = {**cfg.get("metadata", {}), "task_set": path.parent.name}
        tasks[cfg["task"]] = cfg
    return tasks


def task_sets() -> dict[str, list[str]]:
    sets: dict[str, list[str]] = {}
    for name, cfg in shipped().items():
        sets.setdefault(cfg["metadata"]["task_set"], []).append(name)
    return sets


def resolve(names: list[str]) -> list[str | dict]:
    """Task names (a shipped set's name stands for its tasks) -> what lm-eval's simple_evaluate takes:
    a shipped task's config dict, any other name as it is (lm-eval finds it in --include-path)."""
    configs, sets = shipped(), task_sets()
    out: list[str | dict] = []
    for name in names:
        if not name:
            raise MoetierError("--tasks has an empty name; give comma-separated task names, like stdlib_next_line")
        for one in sets.get(name, [name]):
            out.append(configs.get(one, one))
    return out


def max_length_of(tasks: list[str | dict]) -> int:
    """The context the tasks were cut for: the least metadata.max_length of the shipped ones (the
    embedded model's 256-token training windows), else lm-eval's default."""
    named = [t["metadata"]["max_length"] for t in tasks if isinstance(t, dict) and "max_length" in t.get("metadata", {})]
    return min(named) if named else LM_EVAL_MAX_LENGTH


def output_type(task: str | dict) -> str | None:
    return task.get("output_type") if isinstance(task, dict) else None


def name_of(task: str | dict) -> str:
    return task["task"] if isinstance(task, dict) else task
