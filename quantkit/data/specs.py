"""Named dataset specs: the YAML files in the shipped calibration/ folder, one dataset per file."""
from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

import yaml

from ..errors import UserError
from ..shipped import shipped_dir


@dataclass(frozen=True, kw_only=True)  # built from YAML keys only, never by position
class DatasetSpec:
    name: str
    hub: str
    split: str
    config: str | None = None
    data_files: str | None = None
    eval_split: str | None = None
    eval_data_files: str | None = None
    text_field: str | None = None
    messages_field: str | None = None
    text_template: str | None = None  # str.format over the row, for sets whose text spans several columns
    continuous: bool = False  # rows are consecutive pieces of running text (join in order), not documents
    separator: str = "\n\n"  # joins rows of a continuous set
    description: str = ""
    license: str = ""

    def hub_args(self, for_eval: bool) -> dict:
        """Keyword arguments for datasets.load_dataset (plus the resolved split)."""
        split = (self.eval_split or self.split) if for_eval else self.split
        files = (self.eval_data_files or self.data_files) if for_eval else self.data_files
        args = {"path": self.hub, "name": self.config, "split": split}
        if files:
            args["data_files"] = {split: files}
        return args


def _read(path: Path) -> DatasetSpec:
    raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    known = {f.name for f in fields(DatasetSpec)}
    unknown = set(raw) - known
    if unknown:
        raise UserError(f"{path}: unknown keys {sorted(unknown)}; allowed: {sorted(known)}")
    raw.setdefault("name", path.stem)
    if not raw.get("hub") or not raw.get("split"):
        raise UserError(f"{path}: a dataset spec needs 'hub' and 'split'")
    if not (raw.get("text_field") or raw.get("messages_field") or raw.get("text_template")):
        raise UserError(f"{path}: a dataset spec needs one of text_field, messages_field, text_template")
    return DatasetSpec(**raw)


def known_specs(spec_dir: Path | None = None) -> dict[str, DatasetSpec]:
    specs = {}
    for path in sorted((spec_dir or shipped_dir("calibration")).glob("*.yaml")):
        spec = _read(path)
        specs[spec.name] = spec
    return specs


def get_spec(name: str, spec_dir: Path | None = None) -> DatasetSpec | None:
    return known_specs(spec_dir).get(name)
