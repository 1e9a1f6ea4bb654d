"""Verdicts computed from paired seeds against a margin declared before the runs.

An experiment preset declares (config.experiment, kept in every run's record) the metric, the margin
and the comparisons it will make. For each comparison, each cell matching its `cell` settings is
compared with the cell that its `against` settings make of it, everything else equal: the runs are
paired by seed, and the paired differences (cell minus baseline) give a mean and a 95% interval,
Student's t over the pairs. The verdict:

- worse, first, where a seed of the cell diverged and its pair finished: the paper's own
  "diverges", whatever the finished pairs say;
- equivalent: the whole interval lies within +-margin (this comes before the next: a difference the
  experiment declared negligible is not called better or worse, however sure its sign);
- worse or better: the whole interval lies beyond zero, on that side (by the metric's direction);
- inconclusive: anything else, and fewer than two finished pairs.

Where the experiment declares the seeds it plans (`seeds`), only those pairs count, and until each
has finished on both sides (ok or diverged) the comparison draws no finding: `incomplete`, so that a
grid read halfway is never taken for its result; a comparison whose cell has no run yet is listed
as `incomplete` too, so that such a grid shows every claim it declared.

The finding words the README uses: on a converged experiment, `reproduced` where the verdict is what
the paper claims, `contradicted` where it is another decided verdict, `inconclusive` where none was
decided; on a run far from its plateau, `consistent at toy scale` or `not shown at toy scale`;
`incomplete` while a planned pair has not finished.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable

import pandas as pd
from omegaconf import OmegaConf
from scipy import stats

from ..config import GROUPS, Verdict
from ..runner import identity
from .tables import PERCENT_METRICS, _md, results, skipped_every_step

CONFIDENCE = 0.95
IN_RECORDS = "in the runs' records"


class DeclarationError(ValueError):
    """Records of one experiment that declare it differently, or a declaration file that is not one."""


@dataclass(frozen=True)
class Declared:
    """An experiment's declaration, as its records (or a file, for runs older than the field) hold it."""

    name: str
    metric: str
    margin: float
    relative: bool
    converged: bool
    higher_is_better: bool | None
    comparisons: tuple[dict, ...]
    source: str = IN_RECORDS
    caveat: str = ""  # what the runs' measurement is known to lack (ExperimentConfig.caveat)
    seeds: tuple[int, ...] | None = None  # the planned pairs (ExperimentConfig.seeds); None: those that finished
    runs: tuple[str, ...] = field(default=(), compare=False)  # run_dir of the runs it covers

    @classmethod
    def from_dict(cls, node: dict, source: str = IN_RECORDS) -> Declared:
        missing = [k for k in ("name", "metric", "margin") if node.get(k) in (None, "???")]
        if missing:
            raise DeclarationError(f"experiment declared {source} has no {', '.join(missing)}")
        comparisons = tuple(
            {**c, "cell": dict(c.get("cell") or {}), "against": dict(c.get("against") or {})}
            for c in node.get("comparisons") or []
        )
        for c in comparisons:
            if not c["against"]:
                raise DeclarationError(
                    f"experiment {node['name']}: a comparison of {c['cell']} names nothing in `against`"
                )
            if c.get("expect") not in (None, *(v.value for v in Verdict)):
                raise DeclarationError(
                    f"experiment {node['name']}: expect={c.get('expect')}: must be one of "
                    f"{', '.join(v.value for v in Verdict)}"
                )
        return cls(
            str(node["name"]),
            str(node["metric"]),
            float(node["margin"]),
            bool(node.get("relative", False)),
            bool(node.get("converged", False)),
            None if _missing(node.get("higher_is_better")) else bool(node["higher_is_better"]),
            comparisons,
            source,
            "" if _missing(node.get("caveat")) else str(node["caveat"]),
            _seeds(node.get("seeds")),
        )


def _seeds(value: Any) -> tuple[int, ...] | None:
    """Planned seeds as a preset (a list) or a record's flattened config (its JSON) holds them."""
    if isinstance(value, str):
        value = json.loads(value)
    return None if _missing(value) else tuple(sorted(int(s) for s in value))


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def direction(declared: Declared, run: pd.Series) -> bool:
    """Whether a larger value of the declared metric is better: as declared; else the task's own
    direction for its metric and the test split's; else lower for a loss or a perplexity."""
    if declared.higher_is_better is not None:
        return declared.higher_is_better
    if declared.metric in (run["primary_metric"], f"test_{run['primary_metric']}"):
        return bool(run["higher_is_better"])
    if declared.metric.endswith(("loss", "ppl")):
        return False
    raise DeclarationError(
        f"experiment {declared.name}: metric={declared.metric} is not the task's own ({run['primary_metric']}); "
        "declare experiment.higher_is_better for it"
    )


def load_declaration(path: Path) -> Declared:
    """An experiment declaration from a preset (its `experiment:` node) or a file holding only one."""
    if not path.is_file():
        raise DeclarationError(f"--comparisons {path}: no such file")
    try:
        node = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except Exception as e:  # noqa: BLE001  # yaml's and OmegaConf's errors have no common base
        raise DeclarationError(f"--comparisons {path}: not a YAML file: {e}") from None
    if isinstance(node, dict) and isinstance(node.get("experiment"), dict):
        node = node["experiment"]
    if not isinstance(node, dict):
        raise DeclarationError(
            f"--comparisons {path}: holds no experiment declaration (name, metric, margin, comparisons)"
        )
    return Declared.from_dict(node, source=f"after the runs, in {path.name}")


def declarations(runs: pd.DataFrame, extra: Iterable[Declared] = ()) -> list[Declared]:
    """The experiments the records declare, each with its runs, and each of `extra` over the runs
    that declare none. Records of one experiment must declare it alike: a margin changed between
    launches is not a margin fixed before the runs."""
    found: list[Declared] = []
    column = "config.experiment.name"
    named = runs[column].notna() if column in runs else pd.Series(False, index=runs.index)
    for name, group in runs[named].groupby(column, sort=True) if named.any() else []:
        seen: dict[str, tuple[Declared, str]] = {}
        planned: dict[tuple[int, ...], str] = {}
        for _, run in group.iterrows():
            node = {
                k.removeprefix("config.experiment."): run[k] for k in run.index if k.startswith("config.experiment.")
            }
            node["comparisons"] = json.loads(node.get("comparisons") or "[]")
            declared = Declared.from_dict(node)
            if declared.seeds is not None:
                planned.setdefault(declared.seeds, run["run_dir"])
            # A record made before `seeds` existed declares none: it ran one of the seeds its preset swept.
            seen.setdefault(
                json.dumps({**declared.__dict__, "seeds": None}, sort_keys=True, default=str),
                (declared, run["run_dir"]),
            )
        if len(seen) > 1:
            (a, a_dir), (b, b_dir) = list(seen.values())[:2]
            raise DeclarationError(
                f"experiment {name} is declared differently by {a_dir} and {b_dir} (margin {a.margin} and {b.margin}, "
                f"{len(a.comparisons)} and {len(b.comparisons)} comparisons): its verdicts need one declaration made "
                "before its runs"
            )
        if len(planned) > 1:
            (a_seeds, a_dir), (b_seeds, b_dir) = list(planned.items())[:2]
            raise DeclarationError(
                f"experiment {name} plans seeds {list(a_seeds)} in {a_dir} and {list(b_seeds)} in {b_dir}: its pairs "
                "are planned once, before its runs"
            )
        ((declared, _),) = seen.values()
        found.append(_covering(replace(declared, seeds=next(iter(planned), None)), group))
    for late in extra if (~named).any() else []:
        found.append(_covering(late, runs[~named]))
    return found


def _covering(declared: Declared, runs: pd.DataFrame) -> Declared:
    return replace(declared, runs=tuple(runs["run_dir"]))


def _value(run: pd.Series, key: str) -> Any:
    return run.get(key) if key in GROUPS else run.get(f"config.{key}")


def _same(a: Any, b: Any) -> bool:
    if a is None or (isinstance(a, float) and math.isnan(a)):
        return b is None or (isinstance(b, float) and math.isnan(b))
    if isinstance(a, bool) or isinstance(b, bool):
        return str(a).lower() == str(b).lower()
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b)
    return str(a) == str(b)


def _matches(run: pd.Series, settings: dict) -> bool:
    return all(_same(_value(run, k), v) for k, v in settings.items())


def _matching(runs: pd.DataFrame, settings: dict) -> pd.DataFrame:
    return runs.loc[pd.Series([_matches(run, settings) for _, run in runs.iterrows()], index=runs.index, dtype=bool)]


def _rest(run: pd.Series, against: dict) -> tuple:
    """What must be equal between a cell and its baseline: everything `against` does not set. A
    group `against` sets takes its own overrides with it (precision.norm_fp32 goes with precision)."""
    dropped = set(against)
    parts = [
        p
        for p in identity.variant_parts(run["variant"] or "")
        if not any(p.partition("=")[0] == k or p.startswith(k + ".") for k in dropped)
    ]
    # A CPU run is never paired with a GPU run: the device is part of what must be equal.
    keys = ["device_type", *(g for g in ("model", "data", "schedule", "precision", "scale") if g not in dropped)]
    scale_value = None if "scale" in dropped else run.get("scale_value")
    return (*(run[g] for g in keys), None if pd.isna(scale_value) else scale_value, tuple(sorted(parts)))


CELL = ["device_type", "model", "data", "schedule", "mode", "variant"]


def paired_interval(diffs: list[float], confidence: float = CONFIDENCE) -> tuple[float, float, float]:
    """Mean of the paired differences and its two-sided Student-t interval (NaN with fewer than two)."""
    n = len(diffs)
    mean = sum(diffs) / n if n else math.nan
    if n < 2:
        return mean, math.nan, math.nan
    if not math.isfinite(mean):  # a difference too large for a float's sum: no interval
        return mean, math.nan, math.nan
    # Scaled by the largest deviation, so that differences near a float's range (a run that ended
    # at a perplexity of 1e150, say) do not overflow when squared
    largest = max(abs(d - mean) for d in diffs)
    sd = largest * math.sqrt(sum(((d - mean) / largest) ** 2 for d in diffs) / (n - 1)) if largest > 0 else 0.0
    half = float(stats.t.ppf((1 + confidence) / 2, n - 1)) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def verdict(low: float, high: float, margin: float, higher_is_better: bool, diverged: int = 0) -> Verdict:
    if diverged:
        return Verdict.worse
    if math.isnan(low) or math.isnan(high):
        return Verdict.inconclusive
    if -margin <= low and high <= margin:
        return Verdict.equivalent
    if high < 0 or low > 0:
        return Verdict.better if (low > 0) == higher_is_better else Verdict.worse
    return Verdict.inconclusive


def finding(found: Verdict, expect: str | None, converged: bool) -> str:
    if not expect:
        return found.value
    if not converged:
        return "consistent at toy scale" if found == expect else "not shown at toy scale"
    if found == Verdict.inconclusive:
        return "inconclusive"
    return "reproduced" if found == expect else "contradicted"


COLUMNS = [
    "experiment", "device_type", "model", "data", "schedule", "variant", "cell", "against", "against_variant", "metric",
    "n", "diverged", "cell_mean", "against_mean", "delta", "ci_low", "ci_high", "margin", "verdict", "expect",
    "finding",
    "converged", "declared", "claim", "note", "caveat",
]  # fmt: skip


def comparisons(runs: pd.DataFrame, extra: Iterable[Declared] = ()) -> pd.DataFrame:
    """One row per (declared comparison, matching cell): the paired difference, its interval and verdict."""
    rows = []
    for declared in declarations(runs, extra):
        own = runs[runs["run_dir"].isin(declared.runs)]
        metric = f"metric.{declared.metric}"
        for spec in declared.comparisons:
            cells = _matching(own, spec["cell"])
            bases = _matching(own, spec["against"])
            if cells.empty and declared.seeds is not None and not own.empty:  # a planned grid, this cell not begun
                rows.append(_not_begun(declared, spec, own.iloc[0]))
            for _, cell in cells.groupby(CELL, dropna=False, sort=False):
                row = _row(declared, spec, metric, cell, bases)
                if row is not None:
                    rows.append(row)
    return pd.DataFrame(rows, columns=COLUMNS)


def _settings(settings: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in settings.items())


def _not_begun(declared: Declared, spec: dict, example: pd.Series) -> dict:
    """A comparison of a planned grid whose cell has no run yet: listed, so that a grid read halfway
    shows every claim it declared, not only those it has begun."""
    return {
        **_heading(declared, spec, example, _settings(spec["cell"])),
        "against": _settings(spec["against"]),
        "n": 0,
        "diverged": 0,
        "verdict": Verdict.inconclusive.value,
        "finding": "incomplete",
        "note": "no run of the cell yet",
    }


def _heading(declared: Declared, spec: dict, example: pd.Series, cell: str) -> dict[str, Any]:
    """What every row of a comparison says before its numbers: the experiment, the setup, the claim."""
    return {
        "experiment": declared.name,
        **{k: example[k] for k in ("device_type", "model", "data", "schedule", "variant")},
        "cell": cell,
        "metric": declared.metric,
        "expect": spec.get("expect"),
        "converged": declared.converged,
        "declared": declared.source,
        "claim": spec.get("claim", ""),
        "note": "",
        "caveat": declared.caveat,
    }


def _row(declared: Declared, spec: dict, metric: str, cell: pd.DataFrame, bases: pd.DataFrame) -> dict | None:
    """The comparison of one cell with its baseline; None where the cell is its own baseline (a
    comparison that could not fail)."""
    first = cell.iloc[0]
    rest = _rest(first, spec["against"])
    base = bases.loc[
        pd.Series([_rest(r, spec["against"]) == rest for _, r in bases.iterrows()], index=bases.index, dtype=bool)
    ]
    base_cells = base.groupby(CELL, dropna=False, sort=False)
    if set(base["run_dir"]) == set(cell["run_dir"]):
        return None
    row = _heading(declared, spec, first, first["mode"])
    if base_cells.ngroups != 1:
        planned = declared.seeds is not None and base_cells.ngroups == 0  # its baseline is still to run
        row.update(
            n=0,
            diverged=0,
            against=None,
            verdict=Verdict.inconclusive.value,
            finding="incomplete" if planned else "not tested",
        )
        row["note"] = (
            "no baseline runs"
            if base_cells.ngroups == 0
            else f"{base_cells.ngroups} cells match `against`: name more settings"
        )
        return row
    other = base["variant"].iloc[0]  # the baseline's own variant, by tag, where it is not the cell's
    row["against_variant"] = other
    row["against"] = base["mode"].iloc[0] + (
        f" (variant {identity.tag(other)})" if other not in ("", first["variant"]) else ""
    )
    higher = direction(declared, first)
    notes = []
    if declared.seeds is not None:  # only the planned pairs count
        unplanned = sorted({int(s) for s in pd.concat([cell["seed"], base["seed"]]) if s not in declared.seeds})
        notes += (
            [f"seed{'s' * (len(unplanned) > 1)} {', '.join(map(str, unplanned))} not planned, left out"]
            if unplanned
            else []
        )
        cell, base = cell[cell["seed"].isin(declared.seeds)], base[base["seed"].isin(declared.seeds)]
    cell, base = _final_first(cell), _final_first(base)
    for side in (cell, base):
        twice = side[side.duplicated("seed", keep=False)]
        if len(twice):
            a, b = twice["run_dir"].iloc[:2]
            raise DeclarationError(
                f"experiment {declared.name}: {a} and {b} are one cell's seed {twice['seed'].iloc[0]} twice; "
                "report one of them"
            )
    finished_base = results(base).set_index("seed")
    diffs, cell_values, base_values, diverged = [], [], [], 0
    skipped_all = skipped_every_step(cell)
    for index, run in cell.iterrows():
        if run["seed"] not in finished_base.index:
            continue
        paired = finished_base.loc[run["seed"]]
        if run["status"] == "diverged" or skipped_all[index]:
            diverged += 1
        elif run["status"] == "ok" and pd.notna(run.get(metric)) and pd.notna(paired.get(metric)):
            diffs.append(float(run[metric]) - float(paired[metric]))
            cell_values.append(float(run[metric]))
            base_values.append(float(paired[metric]))
    mean, low, high = paired_interval(diffs)
    base_mean = sum(base_values) / len(base_values) if base_values else math.nan
    margin = declared.margin * abs(base_mean) if declared.relative else declared.margin
    found = verdict(low, high, margin, higher, diverged)
    unfinished = _unfinished(declared.seeds, cell, base)
    row.update(
        n=len(diffs),
        diverged=diverged,
        cell_mean=sum(cell_values) / len(cell_values) if cell_values else math.nan,
        against_mean=base_mean,
        delta=mean,
        ci_low=low,
        ci_high=high,
        margin=margin,
        verdict=found.value,
        # a caveat says the metric itself is in doubt: the verdict is shown, no finding drawn from it
        finding="not tested"
        if declared.caveat
        else "incomplete"
        if unfinished
        else finding(found, spec.get("expect"), declared.converged),
    )
    notes[:0] = [f"diverged in {diverged} of {diverged + len(diffs)} paired seeds"] if diverged else []
    if unfinished:
        assert declared.seeds is not None  # nothing is unfinished without a plan
        ended = (
            pd.concat([cell, base]).groupby("seed")["status"].agg(lambda st: ", ".join(sorted(set(st) - set(FINAL))))
        )
        says = ", ".join(f"{s} ({ended[s]})" if s in ended.index and ended[s] else str(s) for s in unfinished)
        finished = len(declared.seeds) - len(unfinished)
        notes.append(
            f"{finished} of {len(declared.seeds)} planned pairs finished; "
            f"seed{'s' * (len(unfinished) > 1)} {says} not yet"
        )
    notes += latched(pd.concat([cell, base]), declared.metric)
    row["note"] = "; ".join(notes)
    return row


FINAL = ("ok", "diverged")  # a run's result; any other status (preempted, error, ...) is one still to come


def _final_first(runs: pd.DataFrame) -> pd.DataFrame:
    """One cell's runs: a seed's finished record without its unfinished ones (a run cut off in one
    call and finished in the next, in another folder), and one record of a seed still unfinished."""
    final = runs["status"].isin(FINAL)
    still = runs[~final & ~runs["seed"].isin(runs.loc[final, "seed"])].drop_duplicates("seed")  # one says it
    return pd.concat([runs[final], still])


def _unfinished(planned: tuple[int, ...] | None, cell: pd.DataFrame, base: pd.DataFrame) -> list[int]:
    """The planned seeds without a final record (ok or diverged) on both sides of the pair."""
    if planned is None:
        return []
    done = set(cell.loc[cell["status"].isin(FINAL), "seed"]) & set(base.loc[base["status"].isin(FINAL), "seed"])
    return [s for s in planned if s not in done]


# A language model's carried evaluation whose largest |cell state| passed this has a latched stream
# (docs/tasks-and-data.md, "Language-model evaluation"): healthy streams measured 5 to 33, latched
# ones in the thousands.
LATCHED_CELL = 100.0


def latched(runs: pd.DataFrame, metric: str) -> list[str]:
    """The runs whose evaluation of the compared split latched, by seed and cell."""
    column = f"metric.{'test_' if metric.startswith('test_') else 'val_'}cell_max"
    if column not in runs:
        return []
    hit = runs[pd.to_numeric(runs[column], errors="coerce") > LATCHED_CELL]
    return [
        f"{mode} seed {seed}'s evaluation latched (cell state {value:.0f})"
        for mode, seed, value in zip(hit["mode"], hit["seed"], hit[column])
    ]


def _number(metric: str, value: float, signed: bool = False) -> str:
    if pd.isna(value):
        return "-"
    scale, unit = (100, " pt") if metric in PERCENT_METRICS else (1, "")
    style = ".2f" if abs(value * scale) < 1e6 else ".3g"  # a perplexity of 1e188 in four figures, not 190
    return f"{value * scale:{'+' if signed else ''}{style}}{unit}"


def render(table: pd.DataFrame) -> str:
    """The comparisons as Markdown: Δ is the cell minus its baseline, paired by seed; percentages in points."""
    if table.empty:
        return "(no experiment declares comparisons for these runs)"
    unpaired = table[table.against.isna()]
    table = table[table.against.notna()]
    shown = pd.DataFrame(
        {
            "experiment": table.experiment,
            # A variant runs to hundreds of characters: named by its tag, spelled out below the table.
            "setup": [
                f"{d} {m} {data} {s}" + (f" (variant {identity.tag(v)})" if v else "")
                for d, m, data, s, v in zip(
                    table.device_type.fillna(""), table.model, table.data, table.schedule, table.variant
                )
            ],
            "cell": table.cell,
            "against": table.against,  # the rows without one are listed below the table
            "metric": table.metric,
            "n": table.n.astype(int).astype(str) + table.diverged.map(lambda d: f" (+{int(d)} diverged)" if d else ""),
            "Δ": [_number(m, v, signed=True) for m, v in zip(table.metric, table.delta)],
            "95% interval": [
                f"[{_number(m, lo, True)}, {_number(m, hi, True)}]" if pd.notna(lo) else "-"
                for m, lo, hi in zip(table.metric, table.ci_low, table.ci_high)
            ],
            "margin": ["-" if pd.isna(v) else f"±{_number(m, v)}" for m, v in zip(table.metric, table.margin)],
            "verdict": table.verdict,
            "paper": table.expect.fillna("-"),
            "finding": table.finding,
            "declared": table.declared,
        }
    )
    if table.note.fillna("").astype(bool).any():  # a diverged or latched seed, said beside its row
        shown["note"] = table.note.fillna("").values
    variants = sorted(v for v in pd.concat([table.variant, unpaired.variant]).dropna().unique() if v)
    variants += (
        sorted({v for v in table.against_variant.dropna() if v and v not in variants})
        if "against_variant" in table
        else []
    )
    missing = [
        f"{r.cell} ({r.model}{f', variant {identity.tag(r.variant)}' if r.variant else ''}; {r.experiment}): "
        f"{r.note}, {r.finding}"
        for r in unpaired.itertuples()
    ]
    text = _md(shown) if len(table) else "(no compared cell has its baseline among these runs)"
    text += "\n\nCells a comparison matches without a baseline: " + "; ".join(missing) if missing else ""
    caveats = dict.fromkeys(
        f"{e}: {c}"
        for e, c in zip(pd.concat([table.experiment, unpaired.experiment]), pd.concat([table.caveat, unpaired.caveat]))
        if isinstance(c, str) and c
    )
    text += "".join(f"\n\nCaveat, {c}" for c in caveats)
    return text + "".join(f"\n\nvariant {identity.tag(v)}: `{v}`" for v in variants)
