"""Verdicts from paired seeds: the arithmetic against scipy, each verdict, the pairing and matching rules."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest
from scipy import stats

from mpt.report import comparisons
from mpt.report.comparisons import DeclarationError, Declared, paired_interval, verdict
from mpt.report.records import mode_label

DECLARED = {
    "name": "toy",
    "metric": "top1",
    "margin": 0.003,
    "relative": False,
    "converged": True,
    "comparisons": [
        {
            "cell": {"precision": "mixed"},
            "against": {"precision": "fp32", "scale": "none"},
            "expect": "equivalent",
            "claim": "Table 1",
        },
        {
            "cell": {"precision": "fp16"},
            "against": {"precision": "fp32", "scale": "none", "precision.norm_fp32": False},
            "expect": "worse",
        },
    ],
}


def run(
    precision: str,
    seed: int,
    value: float | None,
    scale: str = "none",
    status: str = "ok",
    declared: dict | None = DECLARED,
    **config,
) -> dict:
    variant = ",".join(f"{k}={str(v).lower()}" for k, v in config.items())
    row = {
        "run_dir": f"runs/{precision}_{scale}_{variant}_{seed}",
        "status": status,
        "device_type": "cpu",
        "model": "resnet20",
        "data": "imagefolder",
        "schedule": "paper",
        "precision": precision,
        "scale": scale,
        "scale_value": None,
        "variant": variant,
        "mode": mode_label(precision, scale, None),
        "seed": seed,
        "primary_metric": "top1",
        "higher_is_better": True,
        "skipped_every_step": False,
        "metric.top1": value,
        "config.precision.norm_fp32": config.get("precision.norm_fp32", precision == "mixed"),
    }
    if declared:
        row.update({f"config.experiment.{k}": json.dumps(v) if k == "comparisons" else v for k, v in declared.items()})
    return row


FP32 = [0.910, 0.905, 0.912, 0.908, 0.911]


def table(rows: list[dict], extra: tuple[Declared, ...] | list[Declared] = ()) -> pd.DataFrame:
    return comparisons.comparisons(pd.DataFrame(rows), extra)


def test_the_interval_is_scipys_paired_t_interval():
    a = [0.912, 0.907, 0.915, 0.903, 0.910]
    d = [x - y for x, y in zip(a, FP32)]
    mean, low, high = paired_interval(d)
    ref = stats.t.interval(0.95, len(d) - 1, loc=stats.tmean(d), scale=stats.sem(d))
    assert mean == pytest.approx(stats.tmean(d), abs=1e-15)
    assert (low, high) == pytest.approx(ref, abs=1e-12)
    # and the same test scipy's paired t-test makes: zero inside the interval iff p > 0.05
    assert (low < 0 < high) == (stats.ttest_rel(a, FP32).pvalue > 0.05)


def test_differences_near_a_floats_range_give_the_interval_scaled():
    """A run that ended at a perplexity of 1e150 and its pair's: squaring the differences would
    overflow; the interval is the small differences' interval, scaled, as scipy gives it."""
    d = [1.0, 3.0, 2.5]
    ref = stats.t.interval(0.95, len(d) - 1, loc=stats.tmean(d), scale=stats.sem(d))
    mean, low, high = paired_interval([x * 1e200 for x in d])
    assert (mean / 1e200, low / 1e200, high / 1e200) == pytest.approx((stats.tmean(d), *ref), rel=1e-12)
    assert paired_interval([2.0, 2.0]) == (2.0, 2.0, 2.0)  # no spread: the interval is the point
    mean, low, high = paired_interval([1e308, 1e308])  # their sum is not a float: no interval
    assert math.isinf(mean) and math.isnan(low) and math.isnan(high)


def test_one_pair_has_no_interval():
    mean, low, high = paired_interval([0.01])
    assert mean == 0.01 and math.isnan(low) and math.isnan(high)


@pytest.mark.parametrize(
    "low, high, higher, expected",
    [
        (-0.002, 0.001, True, "equivalent"),
        (-0.02, -0.004, True, "worse"),
        (0.004, 0.02, True, "better"),
        (0.004, 0.02, False, "worse"),  # a perplexity that rose
        (-0.01, 0.002, True, "inconclusive"),  # reaches past the margin and crosses zero
        (0.001, 0.002, True, "equivalent"),  # sure of its sign, but inside the margin
    ],
)
def test_each_verdict(low, high, higher, expected):
    assert verdict(low, high, 0.003, higher) == expected


def test_cells_pair_by_seed_with_their_baseline_and_get_their_verdicts():
    mixed = [0.911, 0.904, 0.913, 0.907, 0.911]  # within 0.002 of FP32 in every seed
    fp16 = [0.880, 0.872, 0.885, 0.874, 0.883]  # 3 points below
    rows = [run("fp32", s, v) for s, v in enumerate(FP32)]
    rows += [run("mixed", s, v) for s, v in enumerate(mixed)]
    rows += [run("fp16", s, v, **{"precision.norm_fp32": True}) for s, v in enumerate(fp16)]
    t = table(rows).set_index("cell")
    assert (
        t.loc["mixed", "n"] == 5
        and t.loc["mixed", "verdict"] == "equivalent"
        and t.loc["mixed", "finding"] == "reproduced"
    )
    d = [x - y for x, y in zip(mixed, FP32)]
    assert t.loc["mixed", "delta"] == pytest.approx(sum(d) / 5)
    # FP16 with FP32 batch-norm is compared with FP32 itself: `against` sets norm_fp32 back
    assert (
        t.loc["fp16", "against"] == "fp32"
        and t.loc["fp16", "verdict"] == "worse"
        and t.loc["fp16", "finding"] == "reproduced"
    )


def test_seeds_without_a_pair_are_left_out_and_a_diverged_seed_makes_it_worse():
    rows = [run("fp32", s, v) for s, v in enumerate(FP32[:3])]
    rows += [run("mixed", s, FP32[s % 5] + 0.0005 * (1 + s % 2)) for s in (0, 1, 2, 7)]  # seed 7 has no FP32 pair
    t = table(rows).set_index("cell")
    assert t.loc["mixed", "n"] == 3 and t.loc["mixed", "verdict"] == "equivalent"
    rows.append(run("mixed", 2, None, status="diverged"))
    rows = [r for r in rows if not (r["precision"] == "mixed" and r["seed"] == 2 and r["status"] == "ok")]
    t = table(rows).set_index("cell")
    assert (
        t.loc["mixed", "verdict"] == "worse"
        and t.loc["mixed", "diverged"] == 1
        and "diverged in 1 of 3" in t.loc["mixed", "note"]
    )


def test_a_cell_with_no_baseline_is_not_tested():
    t = table([run("mixed", s, 0.9) for s in range(3)])
    assert t.iloc[0]["finding"] == "not tested" and t.iloc[0]["note"] == "no baseline runs"


def test_a_toy_scale_experiment_never_says_reproduced():
    toy = {**DECLARED, "converged": False}
    rows = [run("fp32", s, v, declared=toy) for s, v in enumerate(FP32)] + [
        run("mixed", s, v, declared=toy) for s, v in enumerate(FP32)
    ]
    assert table(rows).iloc[0]["finding"] == "consistent at toy scale"


def test_a_relative_margin_is_a_share_of_the_baselines_mean():
    lm = {**DECLARED, "metric": "top1", "margin": 0.02, "relative": True}
    rows = [run("fp32", s, 100.0 + s, declared=lm) for s in range(3)] + [
        run("mixed", s, 101.0 + s, declared=lm) for s in range(3)
    ]
    t = table(rows)
    assert t.iloc[0]["margin"] == pytest.approx(0.02 * 101.0)
    assert t.iloc[0]["verdict"] == "equivalent"  # +1 exactly in every pair: an interval of zero width at 1 < 2.02


def test_records_that_declare_one_experiment_differently_are_refused():
    other = {**DECLARED, "margin": 0.01}
    rows = [run("fp32", 0, 0.9), run("mixed", 0, 0.9, declared=other)]
    with pytest.raises(DeclarationError, match="declared differently.*margin 0.003 and 0.01"):
        table(rows)


def test_a_declaration_given_after_the_runs_covers_only_undeclared_runs_and_says_so(tmp_path):
    preset = tmp_path / "late.yaml"
    preset.write_text("experiment:\n" + "".join(f"  {k}: {json.dumps(v)}\n" for k, v in DECLARED.items()))
    late = comparisons.load_declaration(preset)
    rows = [run("fp32", s, v, declared=None) for s, v in enumerate(FP32)] + [
        run("mixed", s, v, declared=None) for s, v in enumerate(FP32)
    ]
    t = table(rows, [late])
    assert t.iloc[0]["declared"] == "after the runs, in late.yaml" and t.iloc[0]["verdict"] == "equivalent"
    assert table(rows).empty
    with pytest.raises(DeclarationError, match="no such file"):
        comparisons.load_declaration(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text(
        "experiment:\n  name: x\n  metric: top1\n  margin: 0.1\n"
        "  comparisons: [{cell: {precision: mixed}, against: {}}]\n"
    )
    with pytest.raises(DeclarationError, match="names nothing in `against`"):
        comparisons.load_declaration(tmp_path / "bad.yaml")


def test_a_caveat_found_after_the_runs_rides_with_its_rows_and_is_printed_under_the_table(tmp_path):
    preset = tmp_path / "late.yaml"
    caveat = "measured before the latched cell was found"
    preset.write_text(
        "experiment:\n" + "".join(f"  {k}: {json.dumps(v)}\n" for k, v in {**DECLARED, "caveat": caveat}.items())
    )
    rows = [run("fp32", s, v, declared=None) for s, v in enumerate(FP32)] + [
        run("mixed", s, v, declared=None) for s, v in enumerate(FP32)
    ]
    t = table(rows, [comparisons.load_declaration(preset)])
    assert list(t["caveat"]) == [caveat] and comparisons.render(t).endswith(f"Caveat, toy: {caveat}")
    assert (
        t.iloc[0]["verdict"] == "equivalent" and t.iloc[0]["finding"] == "not tested"
    )  # no finding from a doubted metric
    plain = table([run("fp32", s, v) for s, v in enumerate(FP32)] + [run("mixed", s, v) for s, v in enumerate(FP32)])
    assert (
        list(plain["caveat"]) == [""]
        and "Caveat" not in comparisons.render(plain)
        and plain.iloc[0]["finding"] == "reproduced"
    )


def test_a_latched_language_model_evaluation_is_named_in_the_note():
    declared = {**DECLARED, "metric": "test_ppl", "margin": 0.02, "relative": True}
    rows = [run("fp32", s, 212.0 + s, declared=declared) for s in range(3)] + [
        run("mixed", s, 213.0 + s, declared=declared) for s in range(3)
    ]
    for r in rows:
        r["metric.test_ppl"], r["metric.test_cell_max"] = r.pop("metric.top1"), 20.0
    rows[4]["metric.test_cell_max"] = 2157.0  # mixed seed 1
    t = table(rows)
    assert t.iloc[0]["note"] == f"{mode_label('mixed', 'none', None)} seed 1's evaluation latched (cell state 2157)"
    assert "seed 1's evaluation latched (cell state 2157) |" in comparisons.render(t)
    rows[4]["metric.test_cell_max"] = 30.0
    assert table(rows).iloc[0]["note"] == "" and "latched" not in comparisons.render(table(rows))


def test_a_cell_that_is_its_own_baseline_is_not_compared():
    # {precision: fp32} against {precision: fp32, ...}: the FP32 cell itself would be compared with
    # itself, a difference of exactly zero that could not have come out otherwise.
    own = {
        **DECLARED,
        "comparisons": [
            {"cell": {"precision": "fp32"}, "against": {"precision": "fp32", "scale": "none"}, "expect": "equivalent"}
        ],
    }
    rows = [run("fp32", s, v, declared=own) for s, v in enumerate(FP32)] + [
        run("fp32", s, v, scale="dynamic", declared=own) for s, v in enumerate(FP32)
    ]
    t = table(rows)
    assert list(t.cell) == ["fp32 + LS (dynamic)"] and t.iloc[0]["verdict"] == "equivalent"


def test_a_lower_is_better_metric_turns_a_rise_into_worse():
    lm = {**DECLARED, "metric": "test_ppl", "margin": 0.02, "relative": True}
    rows = [
        {
            **run("fp32", s, None, declared=lm),
            "primary_metric": "ppl",
            "higher_is_better": False,
            "metric.test_ppl": 200.0 + s,
        }
        for s in range(3)
    ]
    rows += [
        {
            **run("mixed", s, None, declared=lm),
            "primary_metric": "ppl",
            "higher_is_better": False,
            "metric.test_ppl": 215.0 + s * 1.1,
        }
        for s in range(3)
    ]
    t = table(rows).iloc[0]
    assert t["delta"] > 0 and t["ci_low"] > t["margin"] and t["verdict"] == "worse"


def test_a_metric_not_the_tasks_own_takes_its_direction_from_its_name_or_the_declaration():
    loss = {**DECLARED, "metric": "val_loss", "margin": 0.01}
    rows = [{**run("fp32", s, 0.9, declared=loss), "metric.val_loss": 1.0 + s * 0.01} for s in range(3)]
    rows += [{**run("mixed", s, 0.9, declared=loss), "metric.val_loss": 0.9 + s * 0.011} for s in range(3)]
    assert table(rows).iloc[0]["verdict"] == "better"  # a lower loss, on a task whose top1 is higher-is-better
    odd = {**DECLARED, "metric": "top5"}
    with pytest.raises(DeclarationError, match="metric=top5 is not the task's own"):
        table([{**run(p, 0, 0.9, declared=odd), "metric.top5": 0.9} for p in ("fp32", "mixed")])
    rows = [
        {**run(p, s, 0.9, declared={**odd, "higher_is_better": True}), "metric.top5": 0.9 + s / 100}
        for p in ("fp32", "mixed")
        for s in range(3)
    ]
    assert table(rows).iloc[0]["verdict"] == "equivalent"


def test_one_cells_seed_twice_is_refused_naming_both_runs():
    rows = [run("fp32", 0, 0.9), run("fp32", 1, 0.9), run("mixed", 0, 0.9), run("mixed", 1, 0.9)]
    rows.append({**run("fp32", 1, 0.91), "run_dir": "elsewhere/fp32_1"})
    with pytest.raises(DeclarationError, match="elsewhere/fp32_1 are one cell's seed 1 twice"):
        table(rows)


PLANNED = {**DECLARED, "seeds": [0, 1, 2]}


def test_a_planned_pair_not_yet_finished_draws_no_finding_and_the_note_names_it():
    mixed = [FP32[0] + 0.0005, FP32[1] + 0.0006, FP32[2] + 0.0004]
    rows = [run("fp32", s, v, declared=PLANNED) for s, v in enumerate(FP32[:3])]
    rows += [run("mixed", s, v, declared=PLANNED) for s, v in enumerate(mixed[:2])]
    rows.append(run("mixed", 2, None, status="preempted", declared=PLANNED))  # its checkpoint waits for a relaunch
    t = table(rows).set_index("cell")
    # the two finished pairs alone are equivalent, as the unplanned declaration reads them
    assert t.loc["mixed", "verdict"] == "equivalent" and t.loc["mixed", "n"] == 2
    assert (
        t.loc["mixed", "finding"] == "incomplete"
        and "2 of 3 planned pairs finished; seed 2 (preempted) not yet" in t.loc["mixed", "note"]
    )
    unplanned = table([{**r, "config.experiment.seeds": None} for r in rows]).set_index("cell")
    assert unplanned.loc["mixed", "finding"] == "reproduced"
    rows[-1] = run("mixed", 2, mixed[2], declared=PLANNED)
    done = table(rows).set_index("cell")
    assert (
        done.loc["mixed", "finding"] == "reproduced" and done.loc["mixed", "n"] == 3 and done.loc["mixed", "note"] == ""
    )


def test_a_planned_comparison_whose_cell_has_not_begun_is_listed_incomplete_and_an_unplanned_one_is_not():
    rows = [run("fp32", s, v, declared=PLANNED) for s, v in enumerate(FP32[:3])]
    rows += [run("mixed", s, v + 0.0005, declared=PLANNED) for s, v in enumerate(FP32[:3])]
    t = table(rows).set_index("cell")
    assert t.loc["mixed", "finding"] == "reproduced"
    waiting = t.loc["precision=fp16"]
    assert waiting["finding"] == "incomplete" and waiting["n"] == 0 and waiting["note"] == "no run of the cell yet"
    assert waiting["against"] == "precision=fp32, scale=none, precision.norm_fp32=False"
    shown = comparisons.render(t.reset_index())
    assert "| precision=fp16 | precision=fp32, scale=none, precision.norm_fp32=False | top1 | 0 | - | - | - |" in shown
    unplanned = table([{**r, "config.experiment.seeds": None} for r in rows])
    assert list(unplanned["cell"]) == [mode_label("mixed", "none", None)]


def test_a_diverged_seed_finishes_its_pair_and_an_unplanned_seed_is_left_out():
    rows = [run("fp32", s, v, declared=PLANNED) for s, v in enumerate(FP32)]  # seeds 3 and 4 were never planned
    rows += [run("fp16", s, 0.80, declared=PLANNED, **{"precision.norm_fp32": True}) for s in (0, 1)]
    rows.append(run("fp16", 2, None, status="diverged", declared=PLANNED, **{"precision.norm_fp32": True}))
    rows += [run("fp16", s, FP32[s], declared=PLANNED, **{"precision.norm_fp32": True}) for s in (3, 4)]
    t = table(rows).set_index("cell")
    assert t.loc["fp16", "n"] == 2 and t.loc["fp16", "diverged"] == 1  # seeds 3 and 4 not counted
    assert t.loc["fp16", "verdict"] == "worse" and t.loc["fp16", "finding"] == "reproduced"


def test_records_made_before_seeds_were_declared_join_the_ones_that_declare_them():
    rows = [run("fp32", s, v) for s, v in enumerate(FP32[:3])]  # an older record: no experiment.seeds
    rows = [{k: v for k, v in r.items() if k != "config.experiment.seeds"} for r in rows]
    rows += [run("mixed", s, v, declared=PLANNED) for s, v in enumerate(FP32[:2])]
    t = table(rows).set_index("cell")
    assert t.loc["mixed", "finding"] == "incomplete" and "seed 2 not yet" in t.loc["mixed", "note"]


def test_records_that_plan_different_seeds_are_refused():
    rows = [run("fp32", s, v, declared=PLANNED) for s, v in enumerate(FP32[:3])]
    rows.append(run("mixed", 0, 0.9, declared={**DECLARED, "seeds": [0, 1, 2, 3, 4]}))
    with pytest.raises(DeclarationError, match=r"plans seeds \[0, 1, 2\] in .* and \[0, 1, 2, 3, 4\] in"):
        table(rows)


def test_a_records_plan_is_read_from_its_json_and_a_seed_cut_off_then_finished_elsewhere_counts_once():
    as_recorded = {**PLANNED, "seeds": json.dumps(PLANNED["seeds"])}  # records.py flattens a list to JSON
    rows = [run("fp32", s, v, declared=as_recorded) for s, v in enumerate(FP32[:3])]
    rows += [run("mixed", s, FP32[s] + 0.0005, declared=as_recorded) for s in range(3)]
    cut = {**run("mixed", 2, None, status="preempted", declared=as_recorded), "run_dir": "first-call/mixed_2"}
    t = table([*rows, cut]).set_index("cell")
    assert t.loc["mixed", "n"] == 3 and t.loc["mixed", "finding"] == "reproduced"
    t = table(
        [r for r in rows if not (r["precision"] == "mixed" and r["seed"] == 2)] + [cut, {**cut, "run_dir": "x"}]
    ).set_index("cell")
    assert t.loc["mixed", "finding"] == "incomplete" and "seed 2 (preempted) not yet" in t.loc["mixed", "note"]


def test_unplanned_seeds_are_named_and_a_planned_baseline_not_yet_run_is_incomplete():
    rows = [run("fp32", s, v, declared=PLANNED) for s, v in enumerate(FP32)]
    rows += [run("mixed", s, v, declared=PLANNED) for s, v in enumerate(FP32)]
    t = table(rows).set_index("cell")
    assert "seeds 3, 4 not planned, left out" in t.loc["mixed", "note"] and t.loc["mixed", "n"] == 3
    alone = table([run("mixed", s, 0.9, declared=PLANNED) for s in range(3)])
    assert alone.iloc[0]["finding"] == "incomplete" and alone.iloc[0]["note"] == "no baseline runs"
    assert "mixed (resnet20; toy): no baseline runs, incomplete" in comparisons.render(alone)


def test_a_difference_of_1e188_is_written_in_four_figures():
    declared = {**DECLARED, "metric": "test_ppl", "margin": 0.02, "relative": True}
    rows = [run("fp32", s, 136.0 + s, declared=declared) for s in range(3)] + [
        run("mixed", s, 1e188 * (1 + s), declared=declared) for s in range(3)
    ]
    for r in rows:
        r["metric.test_ppl"] = r.pop("metric.top1")
    rendered = comparisons.render(table(rows))
    assert "| +2e+188 | [-4.84e+187, +4.48e+188] |" in rendered  # mean 2e188, t(2) 4.303 x 1e188 / sqrt(3) either side
    assert max(len(cell) for line in rendered.splitlines() for cell in line.split("|")) < 200
