"""Calibration and evaluation data: named hub specs (calibration/*.yaml), local files, saved datasets and
text sampled from the model itself, all reduced to reproducible token tensors."""
from .calibration import CalibrationSet, load_calibration
from .evaluation import EvalWindows, load_eval_windows
from .resolve import SELF
from .specs import DatasetSpec, known_specs
from .tasks import Task, load_tasks

__all__ = ["CalibrationSet", "load_calibration", "EvalWindows", "load_eval_windows", "Task", "load_tasks",
           "DatasetSpec", "known_specs", "SELF"]
