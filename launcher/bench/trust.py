"""When ddp-bench's figures are not to be trusted, said beside them: each cell is measured `bench.repeats` times
(interleaved with the other cells, so that a busy spell of the host falls on several cells, not on one), the fastest
run is reported (other work on the host only ever slows a run) with the spread of the repeats, the host's load is
taken before and after, and a figure outside physics is flagged: an efficiency above 100 % beyond the spread, a loop
faster than its own data-free ceiling, or a size-1 cell far below that ceiling with its data ready (something else
had the host: every speedup against it is inflated). Pure.
"""

from __future__ import annotations

NOISY = 0.10  # repeats further apart than this share of the fastest: the host was not quiet
BUSY_LOAD = 0.5  # a load average above this share of the cores before the bench: other work on the host
STARVED_SINGLE = 0.5  # a size-1 cell below this share of its ceiling with its data ready: it did not have the host
INPUT_BOUND = 0.10  # report.INPUT_BOUND: data wait above it explains a cell below its ceiling


def combine(runs: list[dict]) -> dict:
    """One cell from its repeats: the fastest run's figures, every run's images/s, and their spread
    ((max - min) / max). A failed repeat makes the cell failed."""
    failed = next((r for r in runs if "error" in r), None)
    if failed is not None:
        return failed
    best = max(runs, key=lambda r: r["images_per_s"])
    rates = [r["images_per_s"] for r in runs]
    spread = (max(rates) - min(rates)) / best["images_per_s"] if best["images_per_s"] else None
    return {**best, "repeats": rates, "spread": spread}


def host_load(before: tuple[float, float, float], after: tuple[float, float, float], cores: int) -> dict:
    """The 1-minute load average before the first cell (other work) and after the last (the bench's own, mostly)."""
    return {"load_before": round(before[0], 2), "load_after": round(after[0], 2), "cores": cores,
            "busy": before[0] > BUSY_LOAD * cores}


def flags(cells: list[dict], host: dict) -> None:
    """Adds "flags" to every measured cell: each reason its figures cannot be trusted as they stand ([] if none)."""
    ran = [c for c in cells if not c.get("skip") and not c.get("error")]
    base = {(c["mode"], c.get("variant", "")): c for c in ran if c["size"] == 1}
    for c in ran:
        found, spread = [], c.get("spread") or 0.0
        if spread > NOISY:
            found.append(f"its repeats differ by {100 * spread:.0f} % ({', '.join(f'{r:.1f}' for r in c['repeats'])} "
                         "images/s): the host was not quiet")
        one = base.get((c["mode"], c.get("variant", "")))
        margin = spread + ((one.get("spread") or 0.0) if one else 0.0)
        eff = c.get("efficiency")
        if c["size"] > 1 and eff is not None and eff > 1.0 + margin:
            found.append(f"efficiency {100 * eff:.0f} % is above 100 % beyond the repeats' spread (±{100 * margin:.0f}"
                         " %): the size-1 cell it is measured against was slowed, not this one sped up")
        pipe = c.get("pipeline_efficiency")
        if pipe is not None and pipe > 1.0 + spread + NOISY:
            found.append(f"the loop ran at {100 * pipe:.0f} % of its own data-free ceiling, which it cannot outrun: "
                         "the ceiling was measured while something else had the host")
        if c["size"] == 1 and pipe is not None and pipe < STARVED_SINGLE and c["data_wait"] <= INPUT_BOUND:
            found.append(f"a size-1 cell at {100 * pipe:.0f} % of its own data-free ceiling with its data ready "
                         f"({100 * c['data_wait']:.0f} % wait): something else had the host, and every speedup "
                         "against it is inflated")
        if found and host.get("busy"):
            found.append(f"the host was busy before the bench: load {host['load_before']:g} on {host['cores']} cores")
        c["flags"] = found


def warnings(cells: list[dict]) -> list[str]:
    """A line per flagged cell, for the console and the report."""
    return [f"{c['mode']} x{c['size']}{' ' + c['variant'] if c.get('variant') else ''}: not to be trusted as it "
            f"stands: {'; '.join(c['flags'])}" for c in cells if c.get("flags")]
