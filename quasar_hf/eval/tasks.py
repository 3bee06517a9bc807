"""Which lm-eval tasks to run: shipped offline tasks, task YAML files, or standard task names.

lm-eval's standard tasks download their data from the Hugging Face Hub. Offline, a task is a YAML
file over local data files; lm-eval resolves `dataset_kwargs.data_files` against the current
directory, so `task_specs` loads each YAML here and makes relative data paths relative to the
YAML's own folder. quasar_hf ships two tiny offline tasks (`LOCAL_TASKS`) for checking the
integration end to end. Anything else is passed to lm-eval as a standard task name.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

from quasar_hf.commands.loading import UsageError

LOCAL_TASK_DIR = Path(__file__).resolve().parents[1] / "data" / "eval_tasks"
LOCAL_TASKS = ("quasar_tiny_mc", "quasar_tiny_gen")


def local_task_path(name: str) -> Path | None:
    """The shipped YAML of a local task name, or None."""
    path = LOCAL_TASK_DIR / f"{name}.yaml"
    return path if name in LOCAL_TASKS and path.is_file() else None


def load_task_yaml(path: str | Path) -> dict[str, Any]:
    """A task YAML as an lm-eval task config dict, with relative data_files made absolute."""
    from lm_eval.tasks._yaml_loader import load_yaml

    path = Path(path).expanduser().resolve()
    if not path.is_file():
        raise UsageError(f"task file {path} does not exist; pass a task YAML file or a task name")
    try:
        config = load_yaml(path)
    except Exception as error:  # noqa: BLE001 - any YAML or include problem is the file's
        raise UsageError(f"cannot read task file {path}: {str(error).splitlines()[0]}; fix the YAML") from None
    if not isinstance(config, dict) or "task" not in config:
        raise UsageError(f"{path} has no `task:` name; lm-eval task YAMLs name their task (task: my_task)")
    kwargs = config.get("dataset_kwargs") or {}
    if "data_files" in kwargs:
        kwargs["data_files"] = _absolute(kwargs["data_files"], path.parent)
        config["dataset_kwargs"] = kwargs
    return config


def _absolute(data_files: Any, folder: Path) -> Any:
    """Relative local paths in `data_files` (str, list or split -> paths dict) resolved against `folder`."""
    if isinstance(data_files, dict):
        return {split: _absolute(files, folder) for split, files in data_files.items()}
    if isinstance(data_files, (list, tuple)):
        return [_absolute(files, folder) for files in data_files]
    candidate = folder / str(data_files)
    if "://" not in str(data_files) and not Path(str(data_files)).is_absolute() and candidate.exists():
        return str(candidate)
    return data_files


def task_specs(names: list[str]) -> list[str | dict[str, Any]]:
    """Each name as lm-eval takes it: a config dict for YAML files and shipped tasks, else the name."""
    if not names:
        raise UsageError(f"no tasks given; pass task names (e.g. {', '.join(LOCAL_TASKS)}) or task YAML files")
    specs: list[str | dict[str, Any]] = []
    for name in names:
        local = local_task_path(name)
        if local is not None:
            specs.append(load_task_yaml(local))
        elif name.endswith((".yaml", ".yml")):
            specs.append(load_task_yaml(name))
        else:
            specs.append(name)
    return specs


def task_manager_for(specs: list[str | dict[str, Any]]):
    """An lm-eval TaskManager; lm-eval's own task index is built only when a standard name needs it (slow)."""
    from lm_eval.tasks import TaskManager

    needs_defaults = any(isinstance(spec, str) for spec in specs)
    return TaskManager(include_defaults=needs_defaults)


def check_task_names(specs: list[str | dict[str, Any]]) -> None:
    """Raise UsageError naming each standard task name lm-eval does not know (and the closest ones it does)."""
    names = [spec for spec in specs if isinstance(spec, str)]
    if not names:
        return
    known = set(task_manager_for(specs).all_tasks)
    unknown = [name for name in names if name not in known]
    if unknown:
        close = sorted({match for name in unknown for match in difflib.get_close_matches(name, known, n=3)})
        hint = f" (close: {', '.join(close)})" if close else ""
        raise UsageError(
            f"unknown lm-eval task {', '.join(unknown)}{hint}; pass a task lm-eval lists (`lm-eval ls tasks`), "
            f"a task YAML file, or a shipped offline task ({', '.join(LOCAL_TASKS)})"
        )
