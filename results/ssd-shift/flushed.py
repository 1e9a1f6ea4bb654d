"""SSD's "scale 8" cell under the loss-scaling control, from the gradients alone: the share of the
non-zero activation gradients that FP16 flushes to zero when the loss is shifted down by 2^k,
without a scale and with the static scale 8, read off FP32's histogram of floor(log2|g|) in
results/cpu-grad-stats/ssd_fp32_none (40 steps of SSD300 from random init on the raccoon set, 4
sampled steps, 262M non-zero values). A value survives FP16 if its exponent is at least -25 (the
rule of mpt-report's histogram figures; half of the [2^-25, 2^-24) bin rounds up, half to zero).
Run from the project root: python results/ssd-shift/flushed.py"""

import json

FP16_LOST_EXP = -25
record = json.load(open("results/cpu-grad-stats/ssd_fp32_none/result.json"))
total = record["grad_stats"]["networks"]["model"]["activation"]["total"]
bins = {int(e): c for e, c in total["log2_bins"].items()}
nonzero = sum(bins.values())


def flushed(shift: int) -> float:
    return sum(c for e, c in bins.items() if e + shift < FP16_LOST_EXP) / nonzero


print(f"non-zero activation gradients: {nonzero:,} of {total['values']:,}")
print("k   flushed, no scale   flushed, scale 8   what scale 8 saves")
for k in range(0, 25, 2):
    none, eight = flushed(-k), flushed(3 - k)
    print(f"{k:<3} {none * 100:17.3f}% {eight * 100:17.3f}% {(none - eight) * 100:17.3f} pt")
