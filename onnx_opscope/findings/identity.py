"""What a table, a findings file and a cost table came from, and the check that they belong together.

A sketch table names its runs in its `run_id` column and its model in the `.run.json` sidecar
(`model_sha256`, the sha256 of the model file `record` read). `opscope mine -o` writes the
same identity into the findings' `source` block (and every finding keeps its `run_id`);
`opscope analyze` writes the analyzed model's `model_sha256` (a top-level key in JSON, a
column in CSV and Parquet). `opscope report T --findings F --costs C` and `opscope mine T
--costs C` compare them and stop with one line naming both identities when they differ: a
report of one model's sketches with another's findings or FLOPs is wrong everywhere and
looks right. A file written before these identities existed gives a `SourceWarning` and is
used as it is.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import OpscopeError
from ..run.table import sidecar_paths
from .finding import Finding
from .plan import Costs


class SourceWarning(UserWarning):
    """A findings or cost file (or a table) that carries no identity, so it cannot be checked."""


def table_model(table_path: str | os.PathLike | None) -> dict[str, Any]:
    """{"model", "model_sha256", "run_id"} from the table's `.run.json` ({} when there is none)."""
    return {} if table_path is None else _read_run(sidecar_paths(table_path)[1])


def _read_run(path: Path) -> dict[str, Any]:
    try:
        run = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(run, dict):
        return {}
    return {k: run[k] for k in ("model", "model_sha256", "run_id") if run.get(k)}


def findings_source(table_path: str | os.PathLike | None, findings: Sequence[Finding] = ()) -> dict[str, Any]:
    """The `source` block `opscope mine -o` writes: the table's name, run ids and model."""
    model = table_model(table_path)
    return {
        "table": Path(table_path).name if table_path is not None else None,
        "run_ids": sorted({f.run_id for f in findings}),
        "model": model.get("model"),
        "model_sha256": model.get("model_sha256"),
    }


def _short(sha: str | None) -> str:
    return f"sha256 {sha[:12]}" if sha else "sha256 unknown"


def _named(model: str | None, sha: str | None) -> str:
    return f"{model} ({_short(sha)})" if model else _short(sha)


def _runs(run_ids: Iterable[str]) -> str:
    ids = sorted(set(run_ids))
    shown = ", ".join(map(repr, ids[:4])) + (f" and {len(ids) - 4} more" if len(ids) > 4 else "")
    return f"run{'s' if len(ids) > 1 else ''} {shown}" if ids else "no runs"


def check_findings(
    findings: Sequence[Finding],
    source: Mapping[str, Any] | None,
    table_runs: Iterable[str],
    table_path: str | os.PathLike | None,
    origin: str | os.PathLike | None = None,
) -> None:
    """Raise OpscopeError when `findings` were mined from another table than the one they are used with.

    Their run ids (each finding's, and the `source` block's) must all be runs of the table, and the
    model sha256 of the source block must be the table's. `origin`: the findings file; one without a
    `source` block (an older opscope wrote it) is checked by run id only, with a SourceWarning.
    """
    table_runs = set(table_runs)
    runs = {f.run_id for f in findings} | set((source or {}).get("run_ids") or [])
    theirs = (source or {}).get("model_sha256")
    ours = table_model(table_path).get("model_sha256")
    table = Path(table_path).name if table_path is not None else "the table"
    what = f"--findings {origin}" if origin is not None else "the findings"
    if (runs and not runs <= table_runs) or (theirs and ours and theirs != ours):
        raise OpscopeError(
            f"{what} were mined from another table: {_runs(runs)} ({_short(theirs)}), "
            f"{table} holds {_runs(table_runs)} ({_short(ours)})",
            hint=f"leave out --findings to mine {table} now, or pass what `opscope mine {table} -o FILE` wrote",
        )
    if source is None and origin is not None:
        warnings.warn(
            f"{what}: the file names no source table or model (an older `opscope mine` wrote it); "
            "checked by run id only",
            SourceWarning,
            stacklevel=3,
        )


def check_costs(costs: Costs, table_path: str | os.PathLike | None) -> None:
    """Raise OpscopeError when `costs` were analyzed from another model than the table was recorded from.

    The costs' model is the analyzer's `model_sha256`, or, for another table's `.sites.csv`, that
    table's `.run.json`. Costs given in memory without an identity (a dict, a list of records) are
    not checked; a cost file without one, or a table without a `.run.json`, gives a SourceWarning.
    """
    model, sha = costs.model, costs.model_sha256
    if costs.origin is None and not sha:
        return
    origin = costs.origin or ""
    what = f"--costs {origin}" if origin else "the analysis"
    if not sha and origin.endswith(".sites.csv"):  # a table's sidecar: that table's run.json names the model
        run = _read_run(Path(origin[: -len(".sites.csv")] + ".run.json"))
        model, sha = run.get("model", model), run.get("model_sha256")
    if not sha:
        warnings.warn(
            f"{what}: the file names no model sha256 (older opscope versions wrote none); "
            "not checked against the table's model",
            SourceWarning,
            stacklevel=3,
        )
        return
    if table_path is None:
        return  # an in-memory table: nothing to compare with
    recorded = table_model(table_path)
    ours, table = recorded.get("model_sha256"), Path(table_path).name
    if not ours:
        warnings.warn(
            f"{table} has no .run.json naming the model it was recorded from: {what} cannot be checked",
            SourceWarning,
            stacklevel=3,
        )
    elif sha != ours:
        raise OpscopeError(
            f"{what} prices another model: {_named(model, sha)}, "
            f"{table} was recorded from {_named(recorded.get('model'), ours)}",
            hint=f"analyze the recorded model: opscope analyze {recorded.get('model') or 'MODEL'} "
            "--format json -o COSTS.json",
        )
